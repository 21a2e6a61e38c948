"""LayerNorm and RMSNorm over the last dimension, forward and backward.

    layer_norm: y = (x - mean) * rstd * weight + bias,  rstd = 1 / sqrt(var + eps)   (biased var)
    rms_norm:   y = x * rstd * weight,                  rstd = 1 / sqrt(mean(x^2) + eps)

x [..., h], weight and bias [h] (either may be None). Statistics are taken in fp32 (for
fp16/bf16 inputs too); y has x's dtype and the gradients of weight and bias their own dtypes,
so an fp32 residual stream with bf16 weights works (cast y to the weight dtype after, as apex's
MixedFusedLayerNorm does). The forward saves mean and rstd per row ([rows] fp32); the backward
recomputes x_hat from them:

    w_dy = dy * weight;  dx = (w_dy - x_hat * mean(x_hat * w_dy) - mean(w_dy)) * rstd
    (rms_norm: without the mean(w_dy) term);  dweight = sum_rows dy * x_hat;  dbias = sum_rows dy

The references: layer_norm's is F.layer_norm's own kernels (aten native_layer_norm and its
backward, run in fp32); rms_norm's is the formulas above in PyTorch ops ("_forward_reference",
"_backward_reference"), which the tests also check against F.layer_norm and F.rms_norm.

CPU fast path of both: "compiled" -- torch.compile of the formulas above, one pass each way;
measured 1.18x (layer_norm) and 3.56x (rms_norm) faster than the references, forward +
backward, at [s=256, b=8, h=256] (bench/fused_ops.py --threads 1 --clock cpu).

"native" (what the model's default --fused-kernels-cpu-impl asks for): layer_norm is ATen's
native_layer_norm. ATen has no CPU RMSNorm backward, so rms_norm on CPU tensors of at least
RMS_COMPILE_MIN_NUMEL elements runs the compiled formulas (as bias_gelu's native path compiles
its large tensors): forward + backward at [2048, 256], 2 threads, 0.43 against 1.28 ms (fp32)
and 0.48 against 1.64 ms (bf16) for the reference, a few seconds of compiling once per process.
Smaller tensors (tests, tiny models) run the reference eagerly; if compiling fails (no C++
compiler) it warns once and the reference runs.

Triton: the forward runs one program per row, the whole row in one block (h up to 65536: the
"persistent" kernel of Megatron's --persist-layer-norm); the backward runs at most 256 programs,
each over a run of rows, writing per-program partial sums of dweight/dbias that are then summed
(deterministic: no atomics).
"""

from __future__ import annotations

import torch

from megatron.core.utils import apply_function
from megatron.fused_kernels.dispatch import (FusedOp, Kernels, cdiv, compile_pays, compiled, kernel,
                                             next_power_of_2, tl)

MAX_TRITON_HIDDEN = 65536
_MAX_BACKWARD_PROGRAMS = 256


def _x_hat(x: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor) -> torch.Tensor:
    centred = x if mean is None else x - mean.unsqueeze(-1)
    return centred * rstd.unsqueeze(-1)


def _forward_reference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                       rms: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(y, mean [rows] or None for rms, rstd [rows]); rows are the leading dims flattened."""
    xf = x.reshape(-1, x.shape[-1]).to(torch.promote_types(x.dtype, torch.float32))  # [rows, h]
    mean = None if rms else xf.mean(dim=-1)
    centred = xf if mean is None else xf - mean.unsqueeze(-1)
    rstd = torch.rsqrt(centred.square().mean(dim=-1) + eps)
    y = centred * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).view(x.shape), mean, rstd


def _backward_reference(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                        mean: torch.Tensor | None, rstd: torch.Tensor, has_bias: bool):
    """(dx in x's dtype, dweight fp32 or None, dbias fp32 or None)."""
    h = x.shape[-1]
    acc = torch.promote_types(x.dtype, torch.float32)
    xf, dy = x.reshape(-1, h).to(acc), grad_y.reshape(-1, h).to(acc)  # [rows, h]
    x_hat = _x_hat(xf, mean, rstd)
    w_dy = dy if weight is None else dy * weight
    dx = w_dy - x_hat * (x_hat * w_dy).mean(dim=-1, keepdim=True)
    if mean is not None:
        dx = dx - w_dy.mean(dim=-1, keepdim=True)
    dx = dx * rstd.unsqueeze(-1)
    dweight = None if weight is None else (dy * x_hat).sum(dim=0)
    dbias = dy.sum(dim=0) if has_bias else None
    return dx.to(x.dtype).view(x.shape), dweight, dbias


@kernel
def _forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, h, eps,
                    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < h
    x = tl.load(x_ptr + row * h + cols, mask=inside, other=0.0).to(tl.float32)
    if IS_RMS:
        centred = x
    else:
        mean = tl.sum(x, axis=0) / h
        tl.store(mean_ptr + row, mean)
        centred = tl.where(inside, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / h + eps)
    tl.store(rstd_ptr + row, rstd)
    y = centred * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * h + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


@kernel
def _backward_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, rows, h, rows_per_program,
                     IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < h
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, rows)):
        x = tl.load(x_ptr + row * h + cols, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * h + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        if IS_RMS:
            x_hat = x * rstd
        else:
            x_hat = tl.where(inside, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        w_dy = dy
        if HAS_WEIGHT:
            w_dy = dy * w
        dx = w_dy - x_hat * (tl.sum(x_hat * w_dy, axis=0) / h)
        if not IS_RMS:
            dx = dx - tl.sum(w_dy, axis=0) / h
        tl.store(dx_ptr + row * h + cols, (dx * rstd).to(dx_ptr.dtype.element_ty), mask=inside)
        dw += dy * x_hat
        db += dy
    if HAS_WEIGHT:
        tl.store(dw_ptr + pid * h + cols, dw, mask=inside)
    if HAS_BIAS:
        tl.store(db_ptr + pid * h + cols, db, mask=inside)


def _num_warps(block: int) -> int:
    return min(16, max(1, block // 512))


def _forward_triton(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                    rms: bool):
    h = x.shape[-1]
    if h > MAX_TRITON_HIDDEN:
        return _forward_reference(x, weight, bias, eps, rms)
    x = x.contiguous()
    rows = x.numel() // h
    y = torch.empty_like(x)
    stats = torch.empty(2, rows, dtype=torch.float32, device=x.device)  # mean, rstd
    block = next_power_of_2(h)
    if rows > 0:
        _forward_kernel[(rows,)](x, weight if weight is not None else x, bias if bias is not None else x, y,
                                 stats[0], stats[1], h, float(eps), IS_RMS=rms, HAS_WEIGHT=weight is not None,
                                 HAS_BIAS=bias is not None, BLOCK=block, num_warps=_num_warps(block))
    return y, (None if rms else stats[0]), stats[1]


def _backward_triton(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                     mean: torch.Tensor | None, rstd: torch.Tensor, has_bias: bool):
    h = x.shape[-1]
    if h > MAX_TRITON_HIDDEN:
        return _backward_reference(grad_y, x, weight, mean, rstd, has_bias)
    x, grad_y = x.contiguous(), grad_y.contiguous()
    rows = x.numel() // h
    rows_per_program = max(1, cdiv(rows, _MAX_BACKWARD_PROGRAMS))
    programs = cdiv(rows, rows_per_program)
    dx = torch.empty_like(x)
    partial = torch.zeros(2, programs, h, dtype=torch.float32, device=x.device)  # dweight, dbias per program
    block = next_power_of_2(h)
    if rows > 0:
        _backward_kernel[(programs,)](grad_y, x, weight if weight is not None else x,
                                      mean if mean is not None else rstd, rstd, dx, partial[0], partial[1],
                                      rows, h, rows_per_program, IS_RMS=mean is None,
                                      HAS_WEIGHT=weight is not None, HAS_BIAS=has_bias, BLOCK=block,
                                      num_warps=_num_warps(block))
    dweight = partial[0].sum(dim=0) if weight is not None else None
    dbias = partial[1].sum(dim=0) if has_bias else None
    return dx, dweight, dbias


def _forward_aten(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                  rms: bool):
    """LayerNorm's reference: F.layer_norm's own kernel (aten native_layer_norm), in fp32."""
    assert not rms, "aten's native_layer_norm has no RMS variant"
    acc = torch.promote_types(x.dtype, torch.float32)
    weight, bias = (None if p is None else p.to(acc) for p in (weight, bias))
    y, mean, rstd = torch.native_layer_norm(x.to(acc), x.shape[-1:], weight, bias, eps)  # stats [..., 1]
    return y.to(x.dtype), mean, rstd


def _backward_aten(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                   mean: torch.Tensor | None, rstd: torch.Tensor, has_bias: bool):
    acc = torch.promote_types(x.dtype, torch.float32)
    bias_like = x.new_empty(x.shape[-1:], dtype=acc) if has_bias else None  # only its shape is read
    dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
        grad_y.to(acc), x.to(acc), x.shape[-1:], mean, rstd, None if weight is None else weight.to(acc), bias_like,
        [True, weight is not None, has_bias])
    return dx.to(x.dtype), dweight, dbias


_COMPILED = Kernels(compiled(_forward_reference), compiled(_backward_reference))
_TRITON = Kernels(_forward_triton, _backward_triton)
RMS_COMPILE_MIN_NUMEL = 1 << 18  # below this rms_norm's native path stays eager (compiling would not pay back)



def _rms_forward_native(x, weight, bias, eps, rms):
    forward = _COMPILED.forward if compile_pays(x, RMS_COMPILE_MIN_NUMEL) else _forward_reference
    return forward(x, weight, bias, eps, rms)


def _rms_backward_native(grad_y, x, weight, mean, rstd, has_bias):
    backward = _COMPILED.backward if compile_pays(x, RMS_COMPILE_MIN_NUMEL) else _backward_reference
    return backward(grad_y, x, weight, mean, rstd, has_bias)


LAYER_NORM = FusedOp(
    name="layer_norm",
    cpu_fast_path="compiled",
    implementations={"reference": Kernels(_forward_aten, _backward_aten),
                     "native": Kernels(_forward_aten, _backward_aten), "compiled": _COMPILED, "triton": _TRITON},
)
RMS_NORM = FusedOp(
    name="rms_norm",
    cpu_fast_path="compiled",
    implementations={"reference": Kernels(_forward_reference, _backward_reference),
                     "native": Kernels(_rms_forward_native, _rms_backward_native), "compiled": _COMPILED,
                     "triton": _TRITON},
)


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, kernels):
        y, mean, rstd = kernels.forward(x, weight, bias, eps, rms)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias, ctx.kernels = bias is not None, kernels
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = ctx.kernels.backward(grad_y, x, weight, mean, rstd, ctx.has_bias)
        dweight = None if dweight is None else dweight.to(weight.dtype)
        dbias = None if dbias is None else dbias.to(ctx.bias_dtype)
        return dx, dweight, dbias, None, None, None


def _check(x: torch.Tensor, *params: torch.Tensor | None) -> None:
    for param in params:
        if param is not None and param.shape != x.shape[-1:]:
            raise ValueError(f"norm parameter of shape {tuple(param.shape)} does not match the last dim of "
                             f"x {tuple(x.shape)}")


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5,
               *, impl: str | None = None) -> torch.Tensor:
    """LayerNorm over the last dim of x [..., h]; y in x's dtype, statistics in fp32.

    Same function as F.layer_norm(x, (h,), weight, bias, eps). impl forces an implementation.
    """
    _check(x, weight, bias)
    return apply_function(_Norm, x, weight, bias, float(eps), False, LAYER_NORM.kernels(x.device, impl))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-5, *,
             impl: str | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., h]: x / sqrt(mean(x^2) + eps) * weight; y in x's dtype."""
    _check(x, weight)
    return apply_function(_Norm, x, weight, None, float(eps), True, RMS_NORM.kernels(x.device, impl))
