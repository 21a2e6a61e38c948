"""bias + dropout + residual add: out = residual + dropout(x + bias, prob, training).

x [..., h], bias [h] or None, residual broadcastable to x (usually the same shape); out has
the promoted dtype of the three (fp32 with an fp32 residual stream). In inference (training
False) or with prob 0 no mask is drawn: out = residual + x + bias.

Where the mask comes from (training, prob > 0). It is drawn from `generator`, by default the
default generator of x's device -- the one megatron.core.tensor_parallel's RNG tracker swaps
in -- so the same generator state gives the same mask:

- "reference" and "compiled" draw it exactly as torch.nn.functional.dropout does on CPU
  (noise = empty_like(t).bernoulli_(1 - prob) / (1 - prob)), so on CPU they give the same
  output and gradients, bit for bit, and leave the generator in the same state as
  `residual + F.dropout(x + bias, prob)`. They keep a bool mask for backward (1 byte per
  element; F.dropout on CPU keeps the noise itself, 2 or 4) and rebuild the noise from it.
- "triton" draws one 64-bit seed from the generator (torch.randint on the device, no host
  sync) and keeps element i when Philox4x32-10(key=seed, counter=i) >> 8 >= round(prob * 2^24)
  (`triton_keep_mask` below is that rule in plain PyTorch). Nothing is saved but the seed: the
  backward regenerates the mask. Its masks differ from F.dropout's (CUDA's own dropout differs
  from CPU's too), with the same distribution.

Backward: dx = d out * noise, dbias = sum of dx over the leading dims, dresidual = d out
(the reference rounds as autograd does through the unfused ops: in t's dtype).

CPU fast path: the reference. The compiled variant draws the mask eagerly too (to stay
F.dropout's) and fuses only the bias add, the scaling and the residual add (and the backward's
product and bias sum); drawing the mask dominates, and it measured 1.04x the reference's
speed, forward + backward, at [s=256, b=8, h=256] with prob 0.1 (bench/fused_ops.py
--threads 1 --clock cpu): no gain worth a compile.
"""

from __future__ import annotations

import torch

from megatron.core.utils import apply_function
from megatron.fused_kernels.dispatch import FusedOp, Kernels, cdiv, compiled, kernel, tl

_BLOCK = 1024
_THRESHOLD_BITS = 24  # the mask compares 24 random bits with round(prob * 2^24)
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_UINT32 = 0xFFFFFFFF


def _drop_threshold(prob: float) -> int:
    return round(prob * (1 << _THRESHOLD_BITS))


def _keep_scale(prob: float, dtype: torch.dtype) -> float:
    """1 / (1 - prob) rounded as F.dropout rounds it (a division in the tensor's dtype); 0 if prob 1."""
    if prob == 1.0:
        return 0.0
    return float(torch.ones((), dtype=dtype).div_(1.0 - prob))


def draw_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The Triton kernel's Philox key: int64 [1] on `device`, drawn from `generator`."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device, generator=generator)


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b, for a < 2^32 and b int64 holding values < 2^32 (no overflow)."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_hi, p_lo = a * b_hi, a * b_lo  # each < 2^48
    high = (p_hi + (p_lo >> 16)) >> 16
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & _UINT32
    return high, low


def philox4x32_10(counter: tuple, key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 (Salmon et al. 2011; Triton's tl.randint) in plain PyTorch: four int64
    tensors of 32-bit words in, four out; key is two 32-bit ints."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _UINT32, (k1 + _PHILOX_KEY_B) & _UINT32
    return c0, c1, c2, c3


def triton_keep_mask(seed: int, numel: int, prob: float, device: torch.device | str | None = None) -> torch.Tensor:
    """The Triton kernel's keep mask, bool [numel], in plain PyTorch: element i is kept when the
    first word of Philox4x32-10(counter (i mod 2^32, i >> 32, 0, 0), key (seed mod 2^32,
    seed >> 32)), shifted right by 8, is at least round(prob * 2^24)."""
    index = torch.arange(numel, dtype=torch.int64, device=device)
    zeros = torch.zeros_like(index)
    word, _, _, _ = philox4x32_10((index & _UINT32, index >> 32, zeros, zeros), (seed & _UINT32, (seed >> 32) & _UINT32))
    return (word >> (32 - _THRESHOLD_BITS)) >= _drop_threshold(prob)


# ---------------------------------------------------------------- reference and compiled


def _apply_noise(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                 noise: torch.Tensor | None) -> torch.Tensor:
    t = x if bias is None else x + bias
    return residual + (t if noise is None else t * noise)


def _noise_grad(grad_out: torch.Tensor, noise: torch.Tensor | None, x_dtype: torch.dtype,
                bias_dtype: torch.dtype | None):
    """(dx, dbias) as autograd computes them for residual + F.dropout(x + bias): in t's dtype."""
    t_dtype = x_dtype if bias_dtype is None else torch.promote_types(x_dtype, bias_dtype)
    grad_t = grad_out.to(t_dtype)
    if noise is not None:
        grad_t = grad_t * noise
    dbias = None if bias_dtype is None else grad_t.sum_to_size(grad_t.shape[-1:])
    return grad_t.to(x_dtype), dbias


def _draw_noise(x: torch.Tensor, bias: torch.Tensor | None, prob: float, training: bool,
                generator: torch.Generator | None) -> torch.Tensor | None:
    """F.dropout's noise for t = x + bias (bernoulli(1 - p) / (1 - p) in t's dtype), or None."""
    if not training or prob == 0.0:
        return None
    dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    if prob == 1.0:
        return torch.zeros(x.shape, dtype=dtype, device=x.device)
    return torch.empty(x.shape, dtype=dtype, device=x.device).bernoulli_(1.0 - prob, generator=generator).div_(1.0 - prob)


def _rebuild_noise(keep: torch.Tensor, dtype: torch.dtype, prob: float) -> torch.Tensor:
    """The forward's noise, bit for bit, from its bool mask: keep / (1 - prob) in t's dtype."""
    if prob == 1.0:
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return keep.to(dtype).div_(1.0 - prob)


def _eager_forward(apply_noise):
    """Forward of "reference" / "compiled": the mask drawn as F.dropout draws it, then apply_noise."""
    def forward(x, bias, residual, prob, training, generator):
        noise = _draw_noise(x, bias, prob, training, generator)
        return apply_noise(x, bias, residual, noise), (None if noise is None else noise != 0)
    return forward


def _eager_backward(noise_grad):
    def backward(grad_out, keep, x_dtype, bias_dtype, prob):
        t_dtype = x_dtype if bias_dtype is None else torch.promote_types(x_dtype, bias_dtype)
        noise = None if keep is None else _rebuild_noise(keep, t_dtype, prob)
        return noise_grad(grad_out, noise, x_dtype, bias_dtype)
    return backward


# ---------------------------------------------------------------- Triton


@kernel
def _forward_kernel(x_ptr, b_ptr, r_ptr, out_ptr, seed_ptr, n, h, threshold, scale,
                    HAS_BIAS: tl.constexpr, TRAINING: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    t = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        t = t + tl.load(b_ptr + offs % h, mask=inside, other=0.0).to(tl.float32)
    if TRAINING:
        keep = (tl.randint(tl.load(seed_ptr), offs) >> 8).to(tl.int32) >= threshold
        t = tl.where(keep, t * scale, 0.0)
    out = tl.load(r_ptr + offs, mask=inside, other=0.0).to(tl.float32) + t
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=inside)


@kernel
def _backward_kernel(g_ptr, dx_ptr, seed_ptr, n, threshold, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    keep = (tl.randint(tl.load(seed_ptr), offs) >> 8).to(tl.int32) >= threshold
    tl.store(dx_ptr + offs, tl.where(keep, g * scale, 0.0).to(dx_ptr.dtype.element_ty), mask=inside)


def _forward_triton(x, bias, residual, prob, training, generator):
    dtype = torch.promote_types(torch.promote_types(x.dtype, residual.dtype),
                                x.dtype if bias is None else bias.dtype)
    x = x.contiguous()
    residual = residual.expand(x.shape).contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    dropping = training and prob > 0.0
    seed = draw_seed(generator, x.device) if dropping else None
    n = x.numel()
    if n > 0:
        _forward_kernel[(cdiv(n, _BLOCK),)](x, bias if bias is not None else x, residual, out,
                                            seed if seed is not None else x, n, x.shape[-1],
                                            _drop_threshold(prob), _keep_scale(prob, x.dtype),
                                            HAS_BIAS=bias is not None, TRAINING=dropping, BLOCK=_BLOCK)
    return out, seed


def _backward_triton(grad_out, seed, x_dtype, bias_dtype, prob):
    has_bias = bias_dtype is not None
    if seed is None:
        return _noise_grad(grad_out, None, x_dtype, bias_dtype)
    grad_out = grad_out.contiguous()
    dx = torch.empty(grad_out.shape, dtype=x_dtype, device=grad_out.device)
    n = dx.numel()
    if n > 0:
        _backward_kernel[(cdiv(n, _BLOCK),)](grad_out, dx, seed, n, _drop_threshold(prob),
                                             _keep_scale(prob, x_dtype), BLOCK=_BLOCK)
    dbias = dx.reshape(-1, dx.shape[-1]).sum(dim=0, dtype=torch.float32) if has_bias else None
    return dx, dbias


OP = FusedOp(
    name="bias_dropout_add",
    cpu_fast_path="reference",
    implementations={
        "reference": Kernels(_eager_forward(_apply_noise), _eager_backward(_noise_grad)),
        # the reference already is ATen's add and bernoulli kernels: nothing more native to call
        "native": Kernels(_eager_forward(_apply_noise), _eager_backward(_noise_grad)),
        "compiled": Kernels(_eager_forward(compiled(_apply_noise)), _eager_backward(compiled(_noise_grad))),
        "triton": Kernels(_forward_triton, _backward_triton),
    },
)


class _BiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, prob, training, generator, kernels):
        out, state = kernels.forward(x, bias, residual, prob, training, generator)
        ctx.save_for_backward(state)  # the bool mask (reference, compiled), the seed (triton) or None
        ctx.meta = (x.dtype, None if bias is None else bias.dtype, residual.dtype, residual.shape, prob, kernels)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (state,) = ctx.saved_tensors
        x_dtype, bias_dtype, residual_dtype, residual_shape, prob, kernels = ctx.meta
        dx, dbias = kernels.backward(grad_out, state, x_dtype, bias_dtype, prob)
        dbias = None if dbias is None else dbias.to(bias_dtype)
        dresidual = grad_out.sum_to_size(residual_shape).to(residual_dtype)
        return dx, dbias, dresidual, None, None, None, None


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, prob: float,
                     training: bool, *, generator: torch.Generator | None = None,
                     impl: str | None = None) -> torch.Tensor:
    """residual + dropout(x + bias, prob, training), x [..., h], bias [h] or None.

    The mask is drawn from generator (default: the default generator of x's device); see the
    module docstring for how each implementation draws it. impl forces an implementation.
    """
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {prob!r}")
    if bias is not None and bias.shape != x.shape[-1:]:
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not match the last dim of x {tuple(x.shape)}")
    if residual.shape != x.shape and torch.broadcast_shapes(x.shape, residual.shape) != x.shape:
        raise ValueError(f"residual of shape {tuple(residual.shape)} does not broadcast to x {tuple(x.shape)}")
    kernels = OP.kernels(x.device, impl)
    return apply_function(_BiasDropoutAdd, x, bias, residual, float(prob), bool(training), generator, kernels)
