"""Scale + mask + softmax over attention scores, with Megatron's FusedScaleMaskSoftmax semantics.

    probs = softmax(masked_fill(scores * scale, mask, -10000.0))     scores, probs [b, np, sq, sk]

- mask: bool, broadcastable to [b, np, sq, sk] (usually [b or 1, 1, sq, sk]); True = masked out.
  Masked scores become -10000.0, not -inf (Megatron's fill: it fits in fp16).
- causal=True also masks key j for query i when j > i + (sk - sq): the upper triangle for
  sq == sk, and the KV-cache convention (the last query sees every key) for sq < sk.
- The softmax runs in fp32 for fp16/bf16 scores and the probabilities are cast back.
- A row with every key masked gives all-zero probabilities and a zero gradient, as Megatron's
  fused CUDA kernel does (scaled_masked_softmax: `scale_value = max == -10000 ? 0 : 1`);
  Megatron's unfused fallback, like a plain masked_fill + softmax, gives 1/sk instead. Such
  rows are padding queries, whose outputs the loss mask drops, so training is the same.
- Backward: d scores = scale * probs * (d probs - sum(d probs * probs)), from the saved probs.

CPU fast path: "native" -- the scale and mask fill in place on one copy of the scores, then
ATen's softmax and softmax-backward kernels in the scores' dtype (fp32 arithmetic inside for
bf16, the probabilities rounded once, as Megatron's fused kernel does; the reference casts the
scores to fp32 and back). "compiled" fuses the same into one pass with torch.compile.
Timings: bench/fused_ops.py. The model's CPU attention goes further (fused_core_attention.py).

Triton: one program per row of sk scores (a power-of-two block of at least sk, so up to
sk = 32768); the mask is read through its broadcast strides, the causal mask computed.
"""

from __future__ import annotations

import torch

from megatron.core.utils import apply_function
from megatron.fused_kernels.dispatch import FusedOp, Kernels, compiled, kernel, next_power_of_2, tl

MASK_FILL_VALUE = -10000.0  # Megatron's (megatron.model.utils.ATTENTION_MASK_FILL_VALUE)
MAX_TRITON_SK = 32768


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32 for fp16/bf16/fp32, fp64 stays


def _combined_mask(mask: torch.Tensor | None, causal: bool, sq: int, sk: int,
                   device: torch.device) -> torch.Tensor | None:
    if not causal:
        return mask
    causal_mask = torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(sk - sq + 1)  # [sq, sk]
    return causal_mask if mask is None else mask | causal_mask


def _forward_reference(scores: torch.Tensor, mask: torch.Tensor | None, scale: float,
                       causal: bool) -> torch.Tensor:
    sq, sk = scores.shape[-2:]
    x = scores.to(_accumulation_dtype(scores.dtype)) * scale
    masked = _combined_mask(mask, causal, sq, sk, scores.device)
    if masked is not None:
        x = x.masked_fill(masked, MASK_FILL_VALUE)
    probs = torch.softmax(x, dim=-1)
    if masked is not None:
        probs = probs.masked_fill(masked.all(dim=-1, keepdim=True), 0.0)  # fully masked rows
    return probs.to(scores.dtype)


def _backward_reference(grad_probs: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    acc = _accumulation_dtype(probs.dtype)
    y, g = probs.to(acc), grad_probs.to(acc)
    grad = scale * y * (g - (g * y).sum(dim=-1, keepdim=True))
    return grad.to(probs.dtype)


@kernel
def _forward_kernel(x_ptr, mask_ptr, y_ptr, sq, sk, heads, scale,
                    mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k,
                    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row of scores viewed as [b * np * sq, sk]
    cols = tl.arange(0, BLOCK)
    in_row = cols < sk
    x = tl.load(x_ptr + row * sk + cols, mask=in_row, other=0.0).to(tl.float32) * scale
    q = row % sq
    masked = cols < 0  # nothing masked yet
    if HAS_MASK:
        head = (row // sq) % heads
        batch = row // (sq * heads)
        offset = batch * mask_stride_b + head * mask_stride_h + q * mask_stride_q
        masked = tl.load(mask_ptr + offset + cols * mask_stride_k, mask=in_row, other=0) != 0
    if CAUSAL:
        masked = masked | (cols > q + (sk - sq))
    x = tl.where(masked, -10000.0, x)  # MASK_FILL_VALUE (a kernel cannot read module globals)
    x = tl.where(in_row, x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    open_keys = tl.sum((in_row & ~masked).to(tl.int32), axis=0)
    y = tl.where(open_keys > 0, y, 0.0)
    tl.store(y_ptr + row * sk + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


@kernel
def _backward_kernel(g_ptr, y_ptr, dx_ptr, sk, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < sk
    y = tl.load(y_ptr + row * sk + cols, mask=in_row, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * sk + cols, mask=in_row, other=0.0).to(tl.float32)
    dx = scale * y * (g - tl.sum(g * y, axis=0))
    tl.store(dx_ptr + row * sk + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_row)


def _num_warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _forward_triton(scores: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    causal: bool) -> torch.Tensor:
    b, heads, sq, sk = scores.shape
    if sk > MAX_TRITON_SK:
        return _forward_reference(scores, mask, scale, causal)
    x = scores.contiguous()
    probs = torch.empty_like(x)
    strides = (0, 0, 0, 0)
    if mask is not None:
        mask = mask.expand(b, heads, sq, sk).view(torch.uint8)  # broadcast dims get stride 0
        strides = mask.stride()
    block = next_power_of_2(sk)
    _forward_kernel[(b * heads * sq,)](x, mask if mask is not None else x, probs, sq, sk, heads, float(scale),
                                       *strides, HAS_MASK=mask is not None, CAUSAL=causal, BLOCK=block,
                                       num_warps=_num_warps(block))
    return probs


def _backward_triton(grad_probs: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    sk = probs.shape[-1]
    if sk > MAX_TRITON_SK:
        return _backward_reference(grad_probs, probs, scale)
    grad_probs = grad_probs.contiguous()
    grad = torch.empty_like(probs)
    block = next_power_of_2(sk)
    _backward_kernel[(probs.numel() // sk,)](grad_probs, probs, grad, sk, float(scale), BLOCK=block,
                                             num_warps=_num_warps(block))
    return grad


def _forward_native(scores: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    causal: bool) -> torch.Tensor:
    """torch.softmax in scores' dtype (ATen computes fp16/bf16 rows in fp32 and rounds the result)."""
    sq, sk = scores.shape[-2:]
    x = scores * scale if scale != 1.0 else scores
    masked = _combined_mask(mask, causal, sq, sk, scores.device)
    if masked is not None:  # in place only on our own product
        x = x.masked_fill_(masked, MASK_FILL_VALUE) if x is not scores else x.masked_fill(masked, MASK_FILL_VALUE)
    probs = torch.softmax(x, dim=-1)
    if masked is not None and (not causal or sq > sk or mask is not None):  # causal alone, sq <= sk: no empty row
        probs.masked_fill_(masked.all(dim=-1, keepdim=True), 0.0)
    return probs


def _backward_native(grad_probs: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    grad = torch._softmax_backward_data(grad_probs.to(probs.dtype), probs, -1, probs.dtype)
    return grad.mul_(scale) if scale != 1.0 else grad


OP = FusedOp(
    name="scale_mask_softmax",
    cpu_fast_path="native",
    implementations={
        "native": Kernels(_forward_native, _backward_native),
        "reference": Kernels(_forward_reference, _backward_reference),
        "compiled": Kernels(compiled(_forward_reference), compiled(_backward_reference)),
        "triton": Kernels(_forward_triton, _backward_triton),
    },
)


class _ScaleMaskSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, mask, scale, causal, kernels):
        probs = kernels.forward(scores, mask, scale, causal)
        ctx.save_for_backward(probs)
        ctx.scale, ctx.kernels = scale, kernels
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        (probs,) = ctx.saved_tensors
        return ctx.kernels.backward(grad_probs, probs, ctx.scale), None, None, None, None


def scale_mask_softmax(scores: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0,
                       causal: bool = False, *, impl: str | None = None) -> torch.Tensor:
    """softmax(masked_fill(scores * scale, mask, -10000)) over the last dim of scores [b, np, sq, sk].

    mask: bool, True = masked out, broadcastable to scores (e.g. [b, 1, sq, sk]); causal adds
    the causal mask. Returns probs in scores' dtype (computed in fp32); fully masked rows are 0.
    impl forces an implementation ("triton", "compiled", "reference"); see dispatch.py.
    """
    if scores.dim() != 4:
        raise ValueError(f"scale_mask_softmax expects scores [b, np, sq, sk], got shape {tuple(scores.shape)}")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = masked out), got {mask.dtype}")
    return apply_function(_ScaleMaskSoftmax, scores, mask, float(scale), bool(causal), OP.kernels(scores.device, impl))
