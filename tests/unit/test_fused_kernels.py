"""Fused kernels: every Triton kernel (run by Triton's CPU interpreter) and every CPU fast path
equals its op's plain-PyTorch reference, forward and backward; the references equal the
PyTorch code the model runs unfused; dispatch picks what it says.

Relative error means max |actual - expected| / max |expected| over a tensor, and must stay
below 1e-5 (fp32 inputs). Triton must be importable (the test extra installs it): without it
the Triton tests fail, they do not skip.

The Triton cases run in one subprocess started with TRITON_INTERPRET=1 (`triton_results`):
Triton jits its own library when imported, so interpreting needs the variable set before the
import, and a process that interprets cannot also compile for a GPU -- keeping it out of the
pytest process leaves the other tests (on a GPU machine, real Triton) untouched. The
subprocess imports this module and runs each TRITON_CASES entry with impl="triton"; the tests
compare its outputs and gradients with the expectations computed here.
"""

import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron import fused_kernels as fk
from megatron.fused_kernels import dispatch
from megatron.fused_kernels.fused_bias_dropout import draw_seed, philox4x32_10, triton_keep_mask
from tests.helpers.fused_kernels import (REL, assert_rel_close, assert_same_results, bias_swiglu_case, leaf, rope_case,
                                         run)

ROOT = Path(__file__).resolve().parents[2]


def _require_triton():
    if not fk.triton_available():
        pytest.fail("Triton is not importable; install the test extra: pip install -e .[test]")


def padding_mask(b, sq, sk, seed=1):
    """bool [b, 1, sq, sk], True = masked out, with one fully masked query row (sq // 2 of batch 0)."""
    mask = torch.rand(b, 1, sq, sk, generator=torch.Generator().manual_seed(seed)) < 0.3
    mask[0, 0, sq // 2, :] = True
    return mask


def softmax_case(shape, use_mask, causal, scale=0.7):
    x = leaf(*shape, scale=3.0)
    mask = padding_mask(shape[0], shape[2], shape[3]) if use_mask else None
    return lambda impl: run(lambda t: fk.scale_mask_softmax(t, mask, scale, causal, impl=impl), [x])


def norm_inputs(shape, with_weight, with_bias):
    h = shape[-1]
    return [leaf(*shape, scale=2.0), leaf(h, seed=1) if with_weight else None, leaf(h, seed=2) if with_bias else None]


def layer_norm_case(shape, with_weight, with_bias):
    inputs = norm_inputs(shape, with_weight, with_bias)
    return lambda impl: run(lambda x, w, b: fk.layer_norm(x, w, b, 1e-5, impl=impl), inputs)


def rms_norm_case(shape, with_weight):
    inputs = norm_inputs(shape, with_weight, False)[:2]
    return lambda impl: run(lambda x, w: fk.rms_norm(x, w, 1e-6, impl=impl), inputs)


def bias_gelu_case(shape, with_bias, scale=1.0):
    inputs = [leaf(*shape, scale=scale), leaf(shape[-1], seed=1) if with_bias else None]
    return lambda impl: run(lambda x, b: fk.bias_gelu(x, b, impl=impl), inputs)


def exact_expectation(case, rel=2 ** -6):
    """A Triton case on bf16 inputs and its expectation: the fp64 reference rounded to bf16."""
    return case, lambda impl: case(impl, exact=True), rel


def dropout_inputs(shape=(6, 5, 33)):
    return [leaf(*shape), leaf(shape[-1], seed=1), leaf(*shape, seed=2)]


def dropout_case(prob, training, shape=(6, 5, 33)):
    inputs = dropout_inputs(shape)
    return lambda impl: run(lambda x, b, r: fk.bias_dropout_add(
        x, b, r, prob, training, generator=torch.Generator().manual_seed(7), impl=impl), inputs)


def dropout_philox_expected(prob, shape=(6, 5, 33)):
    """What the Triton kernel must give: the mask of triton_keep_mask for the seed it draws."""
    inputs = dropout_inputs(shape)
    seed = int(draw_seed(torch.Generator().manual_seed(7), torch.device("cpu")))
    keep = triton_keep_mask(seed, inputs[0].numel(), prob).view(shape)
    noise = keep * (0.0 if prob == 1.0 else 1.0 / (1.0 - prob))
    return lambda impl: run(lambda x, b, r: r + (x + b) * noise, inputs)


def ce_inputs(shape, vocab_size, with_mask):
    logits = leaf(*shape, scale=3.0)
    labels = torch.randint(0, vocab_size or shape[-1], shape[:-1], generator=torch.Generator().manual_seed(1))
    labels.view(-1)[1] = -100
    mask = (torch.rand(shape[:-1], generator=torch.Generator().manual_seed(2)) > 0.3) if with_mask else None
    return logits, labels, mask


def ce_case(shape, vocab_size, with_mask):
    logits, labels, mask = ce_inputs(shape, vocab_size, with_mask)
    return lambda impl: run(lambda t: fk.cross_entropy(t, labels, loss_mask=mask, vocab_size=vocab_size, impl=impl),
                            [logits])


def ce_bad_label_case(impl):
    loss = fk.cross_entropy(torch.randn(2, 10), torch.tensor([3, 10]), impl=impl)
    return [loss.isnan()]


# name -> (case run with impl="triton" in the subprocess, its expectation run here[, relative tolerance])
TRITON_CASES = {
    "softmax-pad-causal-2x3x5x7": (softmax_case((2, 3, 5, 7), True, True),) * 2,
    "softmax-pad-1x2x4x4": (softmax_case((1, 2, 4, 4), True, False),) * 2,
    "softmax-causal-kv-2x1x3x9": (softmax_case((2, 1, 3, 9), False, True),) * 2,  # sq < sk
    "softmax-plain-1x2x3x130": (softmax_case((1, 2, 3, 130), False, False),) * 2,
    "layer_norm-3x5x7": (layer_norm_case((3, 5, 7), True, True),) * 2,
    "layer_norm-no-bias-4x33": (layer_norm_case((4, 33), True, False),) * 2,
    "layer_norm-no-params-2x3x10": (layer_norm_case((2, 3, 10), False, False),) * 2,
    "layer_norm-300x6": (layer_norm_case((300, 6), True, True),) * 2,  # several rows per backward program
    "rms_norm-4x33": (rms_norm_case((4, 33), True),) * 2,
    "rms_norm-no-weight-3x2x9": (rms_norm_case((3, 2, 9), False),) * 2,
    "rms_norm-300x6": (rms_norm_case((300, 6), True),) * 2,
    "bias_gelu-3x5x7": (bias_gelu_case((3, 5, 7), True),) * 2,
    "bias_gelu-no-bias-4x33": (bias_gelu_case((4, 33), False),) * 2,
    "bias_gelu-saturated-2x1030": (bias_gelu_case((2, 1030), True, scale=8.0),) * 2,
    "dropout-p0.3": (dropout_case(0.3, True), dropout_philox_expected(0.3)),
    "dropout-p1": (dropout_case(1.0, True), dropout_philox_expected(1.0)),
    "dropout-inference": (dropout_case(0.5, False, (4, 9)),) * 2,
    "dropout-p0-training": (dropout_case(0.0, True, (4, 9)),) * 2,
    "cross_entropy-7x37": (ce_case((7, 37), None, False),) * 2,
    "cross_entropy-padded-5x1000": (ce_case((5, 1000), 937, True),) * 2,
    "cross_entropy-3x2x5000": (ce_case((3, 2, 5000), None, True),) * 2,  # [s, b, V], V over one block
    "cross_entropy-bad-label": (ce_bad_label_case, lambda impl: [torch.tensor([False, True])]),
    "bias_swiglu-3x5x14": (bias_swiglu_case((3, 5, 14), True),) * 2,
    "bias_swiglu-no-bias-4x66": (bias_swiglu_case((4, 66), False),) * 2,
    "bias_swiglu-bf16-2x3x2066": exact_expectation(bias_swiglu_case((2, 3, 2066), True, torch.bfloat16)),
    "rope-3x2x4x8": (rope_case((3, 2, 4, 8), 8),) * 2,
    "rope-partial-interleaved-strided-4x2x3x10": (rope_case((4, 2, 3, 10), 6, True, True),) * 2,
    "rope-partial-strided-5x1x3x12": (rope_case((5, 1, 3, 12), 4, False, True),) * 2,
    "rope-two-head-blocks-1x2x130x64": (rope_case((1, 2, 130, 64), 64),) * 2,
    "rope-bf16-partial-interleaved-strided": exact_expectation(rope_case((4, 2, 3, 10), 6, True, True,
                                                                         torch.bfloat16)),
}


def _triton_worker(path: str) -> None:
    """Subprocess entry: run every Triton case, save {name: results or a traceback} to path."""
    results = {}
    for name, (case, *_) in TRITON_CASES.items():
        try:
            results[name] = case("triton")
        except Exception:  # noqa: BLE001 -- reported by that case's test
            results[name] = traceback.format_exc()
    torch.save(results, path)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    _require_triton()
    path = tmp_path_factory.mktemp("triton") / "results.pt"
    code = f"from tests.unit.test_fused_kernels import _triton_worker; _triton_worker({str(path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"Triton interpreter subprocess failed:\n{proc.stdout}\n{proc.stderr}")
    return torch.load(path)


@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_kernel_matches_reference(triton_results, name):
    result = triton_results[name]
    if isinstance(result, str):
        pytest.fail(f"Triton case {name} raised:\n{result}")
    expected = TRITON_CASES[name][1]("reference")
    if result[0].dtype == torch.bool:
        assert all(torch.equal(a, e) for a, e in zip(result, expected))
    else:
        assert_same_results(result, expected, *TRITON_CASES[name][2:])  # a tolerance of its own, if given


# ---------------------------------------------------------------- references vs unfused PyTorch


def test_softmax_reference_is_megatron_masked_softmax():
    x, mask = leaf(2, 3, 5, 7, scale=3.0), padding_mask(2, 5, 7)
    masked = mask | torch.ones(5, 7, dtype=torch.bool).triu_(3)  # causal, sk - sq + 1
    ours = run(lambda t: fk.scale_mask_softmax(t, mask, 0.7, causal=True, impl="reference"), [x])
    plain = run(lambda t: torch.softmax((t * 0.7).masked_fill(masked, -10000.0), dim=-1)
                .masked_fill(masked.all(-1, keepdim=True), 0.0), [x])
    assert_same_results(ours, plain)
    assert ours[0][0, :, 2].abs().max() == 0 and ours[1][0, :, 2].abs().max() == 0  # the fully masked row
    open_rows = (~masked.all(-1)).expand(2, 3, 5)
    assert torch.allclose(ours[0].sum(-1)[open_rows], torch.ones(()))


def test_softmax_half_precision_computed_in_fp32():
    x = torch.randn(1, 2, 3, 5, dtype=torch.bfloat16)
    probs = fk.scale_mask_softmax(x, None, 2.0, impl="reference")
    assert probs.dtype == torch.bfloat16
    assert torch.equal(probs, torch.softmax(x.float() * 2.0, dim=-1).to(torch.bfloat16))


def test_norm_references_are_torch_norms():
    x, w, b = norm_inputs((3, 5, 7), True, True)
    assert_same_results(run(lambda x, w, b: fk.layer_norm(x, w, b, 1e-5, impl="reference"), [x, w, b]),
                        run(lambda x, w, b: F.layer_norm(x, (7,), w, b, 1e-5), [x, w, b]))
    assert_same_results(run(lambda x, w: fk.rms_norm(x, w, 1e-6, impl="reference"), [x, w]),
                        run(lambda x, w: F.rms_norm(x, (7,), w, 1e-6), [x, w]))


def test_layer_norm_mixed_dtypes():
    """fp32 residual stream, bf16 weights: y in x's dtype, gradients in the parameters' dtypes."""
    x = torch.randn(4, 8)
    w = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    b = torch.zeros(8, dtype=torch.bfloat16, requires_grad=True)
    y = fk.layer_norm(x, w, b, impl="reference")
    y.sum().backward()
    assert y.dtype == torch.float32 and w.grad.dtype == torch.bfloat16 and b.grad.dtype == torch.bfloat16


def test_bias_gelu_reference_is_tanh_gelu():
    x, bias = leaf(3, 5, 7, scale=2.0), leaf(7, seed=1)
    assert_same_results(run(lambda x, b: fk.bias_gelu(x, b, impl="reference"), [x, bias]),
                        run(lambda x, b: F.gelu(x + b, approximate="tanh"), [x, bias]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_dropout_add_reference_is_f_dropout(dtype):
    """Same output, gradients and generator state as residual + F.dropout(x + bias), bit for bit
    (bf16: x and bias in bf16, the residual stream in fp32)."""
    x, bias, residual = dropout_inputs()
    inputs = [x.detach().to(dtype).requires_grad_(), bias.detach().to(dtype).requires_grad_(), residual]
    state = torch.get_rng_state()
    ours = run(lambda x, b, r: fk.bias_dropout_add(x, b, r, 0.3, True, impl="reference"), inputs)
    after_ours = torch.get_rng_state()
    torch.set_rng_state(state)
    plain = run(lambda x, b, r: r + F.dropout(x + b, 0.3, True), inputs)
    assert all(torch.equal(actual, expected) for actual, expected in zip(ours, plain))
    assert torch.equal(after_ours, torch.get_rng_state())
    fk.bias_dropout_add(*inputs, 0.3, False, impl="reference")  # inference draws nothing
    assert torch.equal(after_ours, torch.get_rng_state())


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10, which the Triton dropout mask is built on."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, expected in cases:
        words = philox4x32_10(tuple(torch.tensor([c]) for c in counter), key)
        assert tuple(int(w) for w in words) == expected
    keep = triton_keep_mask(12345, 100_000, 0.1)
    assert abs(keep.float().mean().item() - 0.9) < 0.005


def test_cross_entropy_reference_is_f_cross_entropy():
    logits, labels, mask = ce_inputs((5, 1000), 937, True)
    ours = run(lambda t: fk.cross_entropy(t, labels, loss_mask=mask, vocab_size=937, impl="reference"), [logits])
    plain = run(lambda t: F.cross_entropy(t[:, :937], labels, reduction="none") * mask, [logits])
    assert_same_results(ours, plain)
    assert ours[1][:, 937:].abs().max() == 0 and ours[1][1].abs().max() == 0  # padding and the ignored token


# ---------------------------------------------------------------- CPU fast paths (native, torch.compile)


FAST_PATH_CASES = {
    "scale_mask_softmax": [softmax_case((2, 3, 5, 7), True, True), softmax_case((2, 3, 6, 6), False, True, scale=1.0),
                           softmax_case((2, 3, 7, 5), True, True), softmax_case((1, 2, 4, 9), True, False)],
    "layer_norm": [layer_norm_case((3, 5, 7), True, True)],
    "rms_norm": [rms_norm_case((4, 33), True)],
    "bias_gelu": [bias_gelu_case((3, 5, 7), True), bias_gelu_case((4, 9), False, scale=4.0)],
    "bias_dropout_add": [dropout_case(0.3, True)],
    "cross_entropy": [ce_case((5, 1000), 937, True)],
    "bias_swiglu": [bias_swiglu_case((3, 5, 14), True), bias_swiglu_case((4, 66), False)],
    "rotary_pos_emb": [rope_case((3, 2, 4, 8), 8), rope_case((4, 2, 3, 10), 6, True, True),
                       rope_case((5, 1, 3, 12), 4, False, True)],
}


def test_native_rms_norm_compiles_large_cpu_tensors_only(monkeypatch):
    """rms_norm's native path: the compiled formulas (their numerics are the "compiled" impl's,
    tested with every other implementation) from RMS_COMPILE_MIN_NUMEL elements, the reference
    below; layer_norm's native path never compiles (ATen's kernel)."""
    from megatron.fused_kernels import fused_layer_norm

    calls = []
    spy = fused_layer_norm.Kernels(
        lambda *args: calls.append("forward") or fused_layer_norm._forward_reference(*args),
        lambda *args: calls.append("backward") or fused_layer_norm._backward_reference(*args))
    monkeypatch.setattr(fused_layer_norm, "_COMPILED", spy)
    monkeypatch.setattr(fused_layer_norm, "RMS_COMPILE_MIN_NUMEL", 64)
    small, large = leaf(4, 15, seed=1), leaf(4, 16, seed=2)
    weight = leaf(16, seed=3)
    fk.rms_norm(small, weight[:15], impl="native").sum().backward()
    assert calls == []
    fk.rms_norm(large, weight, impl="native").sum().backward()
    assert calls == ["forward", "backward"]
    fk.layer_norm(large, weight, None, impl="native").sum().backward()
    assert calls == ["forward", "backward"]


def test_native_bias_swiglu_compiles_large_cpu_tensors_only(monkeypatch):
    """bias_swiglu's native path: the compiled formulas from COMPILE_MIN_NUMEL elements (their
    numerics are the "compiled" impl's), ATen's eager silu below."""
    from megatron.fused_kernels import fused_bias_swiglu

    calls = []
    spy = fused_bias_swiglu.Kernels(
        lambda *args: calls.append("forward") or fused_bias_swiglu._forward_reference(*args),
        lambda *args: calls.append("backward") or fused_bias_swiglu._backward_reference(*args))
    monkeypatch.setattr(fused_bias_swiglu, "_COMPILED", spy)
    monkeypatch.setattr(fused_bias_swiglu, "COMPILE_MIN_NUMEL", 64)
    small, large = leaf(4, 14, seed=1), leaf(4, 16, seed=2)
    fk.bias_swiglu(small, impl="native").sum().backward()
    assert calls == []
    fk.bias_swiglu(large, impl="native").sum().backward()
    assert calls == ["forward", "backward"]


def test_native_implementations_match_reference():
    """Every op's "native" implementation (ATen's own kernels), forward and backward, fp32, incl.
    fully masked softmax rows (causal with sq > sk) and the KV-cache causal convention."""
    assert set(FAST_PATH_CASES) == set(fk.OPS)
    for name, cases in FAST_PATH_CASES.items():
        for case in cases:
            assert_same_results(case("native"), case("reference"))


def test_cpu_fast_paths_match_reference():
    """Each op whose CPU fast path is "compiled", on one case, forward and backward (compiling is slow)."""
    for name, cases in FAST_PATH_CASES.items():
        fast = fk.OPS[name].cpu_fast_path  # not select(): MEGATRON_FUSED_IMPL may be set
        assert fast in ("native", "compiled", "reference")
        if fast == "compiled":
            assert_same_results(cases[0]("compiled"), cases[0]("reference"))


def test_native_bf16_within_bf16_rounding_of_the_fp32_reference():
    """bf16 inputs: softmax and GeLU computed in fp32 inside ATen, rounded once to bf16."""
    scores = leaf(2, 3, 6, 6, seed=3).bfloat16()
    native = fk.scale_mask_softmax(scores, None, 0.5, causal=True, impl="native")
    exact = fk.scale_mask_softmax(scores.double(), None, 0.5, causal=True, impl="reference")
    assert native.dtype == torch.bfloat16 and (native.double() - exact).abs().max() <= 2 ** -8
    x, bias = leaf(4, 16, seed=4).bfloat16(), leaf(16, seed=5).bfloat16()
    native = fk.bias_gelu(x, bias, impl="native")
    exact = fk.bias_gelu((x + bias).double(), None, impl="reference")  # Megatron's jit adds in bf16 too
    assert native.dtype == torch.bfloat16
    assert_rel_close(native.double(), exact, rel=2 ** -7)


def test_native_bias_gelu_compiles_the_sigmoid_form_for_large_tensors(monkeypatch):
    """From COMPILE_MIN_NUMEL elements the native bias-GeLU runs gelu through sigmoid, compiled: the
    same function as the reference (fp32, forward and backward, with and without bias; bf16 within
    its rounding). The threshold is lowered so that small tensors take the path here."""
    from megatron.fused_kernels import fused_bias_gelu

    monkeypatch.setattr(fused_bias_gelu, "COMPILE_MIN_NUMEL", 64)
    calls = []
    original = fused_bias_gelu._LARGE_FORWARD
    monkeypatch.setattr(fused_bias_gelu, "_LARGE_FORWARD", lambda *args: calls.append(1) or original(*args))
    for case in (bias_gelu_case((3, 5, 7), True, scale=3.0), bias_gelu_case((4, 33), False)):
        assert_same_results(case("native"), case("reference"))
    assert len(calls) == 2
    x, bias = leaf(8, 16, seed=4).bfloat16(), leaf(16, seed=5).bfloat16()
    exact = fk.bias_gelu((x + bias).double(), None, impl="reference")
    assert_rel_close(fk.bias_gelu(x, bias, impl="native").double(), exact, rel=2 ** -7)


def test_native_bias_gelu_runs_aten_when_compiling_fails(monkeypatch):
    from megatron.fused_kernels import fused_bias_gelu

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(fused_bias_gelu, "COMPILE_MIN_NUMEL", 64)
    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(fused_bias_gelu, "_LARGE_FORWARD", dispatch.compiled(
        fused_bias_gelu._sigmoid_form_forward, fallback=fused_bias_gelu._aten_forward))
    x, bias = leaf(8, 16, seed=4), leaf(16, seed=5)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        y = fk.bias_gelu(x, bias, impl="native")
    assert torch.equal(y, F.gelu(x + bias, approximate="tanh"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        assert torch.equal(fk.bias_gelu(x, bias, impl="native"), y)


# ---------------------------------------------------------------- the CPU attention core


def _composed_attention(q, k, v, heads, mask, causal, scale):
    """softmax(q k^T * scale, masked) v from the reference softmax, in fp64."""
    b = q.shape[0] // heads
    q4, k4, v4 = (x.double().view(b, heads, *x.shape[1:]) for x in (q, k, v))
    probs = fk.scale_mask_softmax(q4 @ k4.transpose(-1, -2), mask, scale, causal=causal, impl="reference")
    return (probs @ v4).view(q.shape)


@pytest.mark.parametrize("query_block", [64, 3, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_core_attention_matches_the_composed_reference(query_block, dtype, monkeypatch):
    """fused_kernels.core_attention, forward and backward, against the reference softmax between two
    matmuls in fp64: causal (block by block of queries; sq = sk, sq > sk with queries that see no
    key, sq < sk), a padding mask with fully masked rows, both, and none."""
    from megatron.fused_kernels import fused_core_attention

    monkeypatch.setattr(fused_core_attention, "QUERY_BLOCK", query_block)
    tol = REL if dtype == torch.float32 else 3e-2
    heads, hn = 3, 4
    for sq, sk in ((8, 8), (9, 7), (7, 9), (1, 5)):
        mask = padding_mask(2, sq, sk)
        for causal, m in ((True, None), (False, None), (False, mask), (True, mask)):
            q, k, v = (leaf(2 * heads, n, hn, seed=seed).to(dtype).detach().requires_grad_()
                       for seed, n in ((1, sq), (2, sk), (3, sk)))
            out = fk.core_attention(q, k, v, scale=0.3, heads=heads, mask=m, causal=causal)
            grad = leaf(*out.shape, seed=4).to(dtype)
            grads = torch.autograd.grad(out, (q, k, v), grad)
            q2, k2, v2 = (x.detach().double().requires_grad_() for x in (q, k, v))
            expected = _composed_attention(q2, k2, v2, heads, m, causal, 0.3)
            expected_grads = torch.autograd.grad(expected, (q2, k2, v2), grad.double())
            for actual, wanted in zip((out, *grads), (expected, *expected_grads)):
                assert actual.dtype == dtype
                assert_rel_close(actual.double(), wanted, rel=tol)


@pytest.mark.parametrize("query_block", [64, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_core_attention_equals_repeated_keys_and_values(query_block, dtype, monkeypatch):
    """queries_per_key r = 3 (2 groups of 3 heads): K and V once per group give what K and V
    repeated for every head give, forward and backward (the K/V gradient summed over the heads),
    causal, with a padding mask, both and none; sq > sk and sq < sk included."""
    from megatron.fused_kernels import fused_core_attention

    monkeypatch.setattr(fused_core_attention, "QUERY_BLOCK", query_block)
    tol = REL if dtype == torch.float32 else 3e-2
    b, groups, r, hn = 2, 2, 3, 4
    for sq, sk in ((8, 8), (9, 7), (7, 9)):
        mask = padding_mask(b, sq, sk)  # [b, 1, sq, sk]: the same for every head
        for causal, m in ((True, None), (False, None), (False, mask), (True, mask)):
            q = leaf(b, groups, sq, r, hn, seed=1).to(dtype).detach().requires_grad_()  # [b, ng, sq, r, hn]
            k, v = (leaf(b, groups, sk, hn, seed=seed).to(dtype).detach().requires_grad_() for seed in (2, 3))
            out = fk.core_attention(q.reshape(b * groups, sq * r, hn), k.view(b * groups, sk, hn),
                                    v.view(b * groups, sk, hn), scale=0.3, heads=groups, mask=m, causal=causal,
                                    queries_per_key=r)  # [b ng, sq r, hn]
            grad = leaf(*out.shape, seed=4).to(dtype)
            grads = torch.autograd.grad(out, (q, k, v), grad)
            # the same heads, one K/V copy each: [b, ng r, s, hn]
            q2 = q.detach().double().requires_grad_()
            k2, v2 = (x.detach().double().requires_grad_() for x in (k, v))
            heads_q = q2.permute(0, 1, 3, 2, 4).reshape(b * groups * r, sq, hn)
            heads_k, heads_v = (x.repeat_interleave(r, dim=1).reshape(b * groups * r, sk, hn) for x in (k2, v2))
            expected = _composed_attention(heads_q, heads_k, heads_v, groups * r, m, causal, 0.3)
            expected = expected.view(b, groups, r, sq, hn).permute(0, 1, 3, 2, 4).reshape(out.shape)
            expected_grads = torch.autograd.grad(expected, (q2, k2, v2), grad.double())
            for actual, wanted in zip((out, *grads), (expected, *expected_grads)):
                assert actual.dtype == dtype
                assert_rel_close(actual.double(), wanted, rel=tol)


def test_core_attention_checks_its_inputs():
    q = torch.zeros(6, 4, 8)
    with pytest.raises(ValueError, match="not a multiple of heads"):
        fk.core_attention(q, q, q, scale=1.0, heads=4)
    with pytest.raises(ValueError, match=r"q \[B, sq, hn\]"):
        fk.core_attention(q, q[:, :, :4], q[:, :, :4], scale=1.0, heads=3)
    with pytest.raises(TypeError, match="bool"):
        fk.core_attention(q, q, q, scale=1.0, heads=3, mask=torch.zeros(2, 1, 4, 4))
    with pytest.raises(ValueError, match="queries_per_key 3"):
        fk.core_attention(q[:, :5], q, q, scale=1.0, heads=3, queries_per_key=3)  # 5 rows: not 3 per position
    with pytest.raises(ValueError, match="must not differ by head"):
        fk.core_attention(q, q[:, :2], q[:, :2], scale=1.0, heads=3, queries_per_key=2,
                          mask=torch.zeros(2, 3, 2, 2, dtype=torch.bool))


# ---------------------------------------------------------------- dispatch


def test_dispatch_picks_by_device(monkeypatch):
    monkeypatch.delenv("MEGATRON_FUSED_IMPL", raising=False)
    for name, op in fk.OPS.items():
        assert fk.select_implementation(name, "cpu") == op.cpu_fast_path
        assert fk.select_implementation(name, "cuda") == ("triton" if fk.triton_available() else "reference")
        assert fk.select_implementation(name, "meta") == "reference"
        assert fk.select_implementation(name, "cpu", impl="reference") == "reference"


def test_dispatch_forcing(monkeypatch):
    monkeypatch.delenv("MEGATRON_FUSED_IMPL", raising=False)
    with fk.force_implementation("reference"):
        assert fk.select_implementation("bias_gelu", "cuda") == "reference"
        assert fk.select_implementation("bias_gelu", "cpu", impl="compiled") == "compiled"  # impl= wins
    assert fk.select_implementation("bias_gelu", "cpu") == fk.OPS["bias_gelu"].cpu_fast_path
    monkeypatch.setenv("MEGATRON_FUSED_IMPL", "reference")
    assert fk.select_implementation("layer_norm", "cpu") == "reference"
    with pytest.raises(ValueError, match="unknown fused-kernel implementation"):
        fk.select_implementation("layer_norm", "cpu", impl="cuda")


def test_dispatch_triton_on_cpu_needs_the_interpreter(monkeypatch):
    _require_triton()
    monkeypatch.delenv("MEGATRON_FUSED_IMPL", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fk.bias_gelu(torch.randn(3), impl="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # only read here: nothing is launched
    assert fk.select_implementation("bias_gelu", "cpu", impl="triton") == "triton"
    assert fk.select_implementation("bias_gelu", "cpu") == fk.OPS["bias_gelu"].cpu_fast_path  # never automatic
    monkeypatch.setattr(dispatch, "triton", None)
    with pytest.raises(RuntimeError, match="not importable"):
        fk.select_implementation("bias_gelu", "cuda", impl="triton")
    assert fk.select_implementation("bias_gelu", "cuda") == "reference"
