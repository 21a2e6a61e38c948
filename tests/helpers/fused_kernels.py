"""Fused-kernel checks: relative-error asserts, seeded leaf tensors, and the cases that run one kernel
(forward and backward) for any impl (tests/unit/test_fused_kernels.py, test_fused_rope_swiglu.py).

Relative error means max |actual - expected| / max |expected| over a tensor.
"""

import torch

from megatron import fused_kernels as fk

REL = 1e-5


def assert_rel_close(actual, expected, rel=REL):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = expected.abs().max().clamp_min(1e-30)
    error = (actual - expected).abs().max() / scale
    assert error < rel, f"relative error {error:.3g} >= {rel}"


def assert_same_results(results, expected, rel=REL):
    assert len(results) == len(expected)
    for actual, reference in zip(results, expected):
        assert_rel_close(actual, reference, rel)


def run(fn, inputs, grad_seed=1234):
    """[output, *grads of the inputs that require grad] of fn(*inputs), with a fixed random d output."""
    for tensor in inputs:
        if tensor is not None:
            tensor.grad = None
    out = fn(*inputs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)))
    return [out.detach()] + [t.grad.clone() for t in inputs if t is not None and t.requires_grad]


def leaf(*shape, scale=1.0, seed=0, dtype=torch.float32):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype).requires_grad_()


def bias_swiglu_case(shape, with_bias, dtype=torch.float32):
    """shape [..., 2f]; the case takes exact=True to run the reference in fp64 (results in dtype)."""
    inputs = [leaf(*shape, scale=2.0, dtype=dtype), leaf(shape[-1], seed=1, dtype=dtype) if with_bias else None]

    def case(impl, exact=False):
        args = [None if t is None else t.detach().double().requires_grad_() for t in inputs] if exact else inputs
        results = run(lambda x, b: fk.bias_swiglu(x, b, impl=impl), args)
        return [r.to(dtype) for r in results] if exact else results

    return case


def rope_freqs(s, rot, interleaved, base=10000.0):
    """[s, 1, 1, rot] fp32 angles in Megatron-Core's layout: cat(f, f), or each angle twice adjacently."""
    inv_freq = base ** (-torch.arange(0, rot, 2, dtype=torch.float32) / rot)  # [rot / 2]
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)  # [s, rot / 2]
    f = f.repeat_interleave(2, dim=-1) if interleaved else torch.cat((f, f), dim=-1)
    return f[:, None, None, :]


def rope_case(shape, rot, interleaved=False, strided=False, dtype=torch.float32):
    """t [s, b, heads, hn]; strided: t is the middle third of a fused [s, b, heads, 3 hn] leaf (a
    strided view, as a split of a fused QKV). exact=True runs the reference in fp64, as above."""
    s, b, heads, hn = shape
    freqs = rope_freqs(s, rot, interleaved)
    source = leaf(s, b, heads, 3 * hn if strided else hn, seed=6, dtype=dtype)

    def view(x):
        return x[..., hn:2 * hn] if strided else x

    def case(impl, exact=False):
        args = [source.detach().double().requires_grad_()] if exact else [source]
        results = run(lambda x: fk.rotary_pos_emb(view(x), freqs, interleaved, impl=impl), args)
        return [r.to(dtype) for r in results] if exact else results

    return case
