"""bias + SwiGLU (Megatron-Core's bias_swiglu_impl), forward and backward.

    a = x1 + b1,  u = x2 + b2          x1 / x2 the first (gate) / second (up) half of the last dim
    y = silu(a) * u = a * sigmoid(a) * u
    da = dy * u * sigmoid(a) * (1 + a * (1 - sigmoid(a))),  du = dy * silu(a),  dx = cat(da, du)

x [..., 2f], bias [2f] or None; y [..., f] in x's dtype; dbias = the sum of dx over the leading
dims, in bias's dtype. The forward saves x and bias only, as Megatron's does: the backward
recomputes a, u and the sigmoid. The reference and the Triton kernel compute in fp32 and round
once; "native" computes in x's dtype with ATen's own silu kernels (fp32 inside for bf16), as
Megatron's jit does in the input dtype.

CPU fast path: "compiled" -- torch.compile of the reference's formulas, one loop each way.
Measured forward + backward of x [256, 8, 2 * 688] without bias (Llama's linears have none;
bench/fused_ops.py --threads 1 --clock cpu --repeats 20), ms, fp32 / bf16: unfused F.silu(x1) * x2
under autograd 6.89 / 8.27, reference 15.55 / 22.48, eager native 8.59 / 10.65, compiled 4.54 / 5.88.
Eager, saving the input only costs a recomputed silu in the backward (autograd keeps silu(x1), an
[..., f] activation, instead).

"native" (what the model passes on CPU) is eager below COMPILE_MIN_NUMEL elements: F.silu and an
in-place multiply forward; aten's silu_backward and silu written into the two halves of one dx
backward. From COMPILE_MIN_NUMEL up (a layer's activations) it runs the compiled formulas, as
bias_gelu's and rms_norm's native paths do (same shape, 2 threads, one run: eager 5.42 / 4.12,
compiled 4.13 / 3.39, unfused autograd 6.31 / 3.50).

Triton: one elementwise kernel each way over [rows, f] (the two halves read from one row of x);
dbias is summed by PyTorch from dx.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.utils import apply_function
from megatron.fused_kernels.dispatch import BiasActivation, FusedOp, Kernels, cdiv, compile_pays, compiled, kernel, tl

_BLOCK = 1024


def _halves_fp32(x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    t = x.to(torch.promote_types(x.dtype, torch.float32))
    if bias is not None:
        t = t + bias
    a, u = torch.chunk(t, 2, dim=-1)  # [..., f] each
    return a, u


def _forward_reference(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    a, u = _halves_fp32(x, bias)
    return (a * torch.sigmoid(a) * u).to(x.dtype)


def _backward_reference(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None):
    """(dx in x's dtype, dbias fp32 [2f] or None)."""
    a, u = _halves_fp32(x, bias)
    sig = torch.sigmoid(a)
    g = grad_y.to(a.dtype)
    dx = torch.cat((g * u * sig * (1.0 + a * (1.0 - sig)), g * a * sig), dim=-1)
    dbias = None if bias is None else dx.reshape(-1, x.shape[-1]).sum(dim=0)
    return dx.to(x.dtype), dbias


def _halves_native(x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    a, u = torch.chunk(x, 2, dim=-1)  # views of x
    if bias is not None:
        b1, b2 = torch.chunk(bias.to(x.dtype), 2)  # added in x's dtype, as Megatron's jit does
        a, u = a + b1, u + b2
    return a, u


def _forward_eager(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    gate, up = torch.chunk(x, 2, dim=-1)  # views of x
    if bias is None:
        return F.silu(gate).mul_(up)
    b1, b2 = torch.chunk(bias.to(x.dtype), 2)  # added in x's dtype, as Megatron's jit does
    y = F.silu(gate + b1, inplace=True)
    return y.mul_(up + b2)


def _backward_eager(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None):
    a, u = _halves_native(x, bias)
    f = a.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [..., 2f]; each half written twice in place
    da, du = dx[..., :f], dx[..., f:]
    torch.mul(grad_y, u, out=da)
    torch.ops.aten.silu_backward.grad_input(da, a, grad_input=da)  # da = dy * u * silu'(a)
    torch.ops.aten.silu.out(a, out=du)
    du.mul_(grad_y)  # du = dy * silu(a)
    dbias = None if bias is None else dx.reshape(-1, x.shape[-1]).sum(dim=0, dtype=torch.float32)
    return dx, dbias


COMPILE_MIN_NUMEL = 1 << 20  # below this the native path stays eager (compiling would not pay back)
# Compiled on first use; where compiling fails (no C++ compiler) the eager ATen path runs instead, warned once.
_COMPILED = Kernels(compiled(_forward_reference, fallback=_forward_eager),
                    compiled(_backward_reference, fallback=_backward_eager))



def _forward_native(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return (_COMPILED.forward if compile_pays(x, COMPILE_MIN_NUMEL) else _forward_eager)(x, bias)


def _backward_native(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None):
    return (_COMPILED.backward if compile_pays(x, COMPILE_MIN_NUMEL) else _backward_eager)(grad_y, x, bias)


@kernel
def _forward_kernel(x_ptr, b_ptr, y_ptr, n, f, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # over y [rows, f]
    inside = offs < n
    col = offs % f
    gate = (offs // f) * (2 * f) + col  # x1's element in x [rows, 2f]; x2's is f further
    a = tl.load(x_ptr + gate, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + gate + f, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a = a + tl.load(b_ptr + col, mask=inside, other=0.0).to(tl.float32)
        u = u + tl.load(b_ptr + f + col, mask=inside, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))  # exp overflow -> inf -> sigmoid 0: still exact
    tl.store(y_ptr + offs, (a * sig * u).to(y_ptr.dtype.element_ty), mask=inside)


@kernel
def _backward_kernel(g_ptr, x_ptr, b_ptr, dx_ptr, n, f, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    col = offs % f
    gate = (offs // f) * (2 * f) + col
    a = tl.load(x_ptr + gate, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + gate + f, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a = a + tl.load(b_ptr + col, mask=inside, other=0.0).to(tl.float32)
        u = u + tl.load(b_ptr + f + col, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    tl.store(dx_ptr + gate, (g * u * sig * (1.0 + a * (1.0 - sig))).to(dx_ptr.dtype.element_ty), mask=inside)
    tl.store(dx_ptr + gate + f, (g * a * sig).to(dx_ptr.dtype.element_ty), mask=inside)


def _forward_triton(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x = x.contiguous()
    f = x.shape[-1] // 2
    y = x.new_empty(*x.shape[:-1], f)
    n = y.numel()
    if n > 0:
        _forward_kernel[(cdiv(n, _BLOCK),)](x, bias if bias is not None else x, y, n, f,
                                            HAS_BIAS=bias is not None, BLOCK=_BLOCK)
    return y


def _backward_triton(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None):
    x, grad_y = x.contiguous(), grad_y.contiguous()
    dx = torch.empty_like(x)
    n = grad_y.numel()
    if n > 0:
        _backward_kernel[(cdiv(n, _BLOCK),)](grad_y, x, bias if bias is not None else x, dx, n, x.shape[-1] // 2,
                                             HAS_BIAS=bias is not None, BLOCK=_BLOCK)
    dbias = None if bias is None else dx.reshape(-1, x.shape[-1]).sum(dim=0, dtype=torch.float32)
    return dx, dbias


OP = FusedOp(
    name="bias_swiglu",
    cpu_fast_path="compiled",
    implementations={
        "native": Kernels(_forward_native, _backward_native),
        "reference": Kernels(_forward_reference, _backward_reference),
        "compiled": _COMPILED,
        "triton": Kernels(_forward_triton, _backward_triton),
    },
)


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None = None, *, impl: str | None = None) -> torch.Tensor:
    """silu(x1 + b1) * (x2 + b2) for x [..., 2f] (x1 the gate half, x2 the up half) and bias [2f]
    or None; y [..., f] in x's dtype. impl forces an implementation; see dispatch.py."""
    if x.shape[-1] % 2:
        raise ValueError(f"bias_swiglu: the last dim of x {tuple(x.shape)} must be even (gate and up halves)")
    if bias is not None and bias.shape != x.shape[-1:]:
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not match the last dim of x {tuple(x.shape)}")
    return apply_function(BiasActivation, x, bias, OP.kernels(x.device, impl))
