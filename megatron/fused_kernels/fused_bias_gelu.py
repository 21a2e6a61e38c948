"""bias + GeLU, Megatron's tanh approximation (Megatron-LM's fused_bias_gelu.py), forward and backward.

    t = x + bias
    y = 0.5 * t * (1 + tanh(0.79788456 * t * (1 + 0.044715 * t^2)))
    dy/dt = 0.5 * t * (1 - tanh^2) * (0.79788456 + 0.1070322243 * t^2) + 0.5 * (1 + tanh)

x [..., ffn], bias [ffn] or None. The constants are Megatron's (0.79788456 = sqrt(2 / pi) to 8
digits; 0.1070322243 = 3 * 0.044715 * 0.79788456), the same function as
F.gelu(t, approximate="tanh") to within 1e-7. It is computed in fp32 and cast back to x's dtype
(Megatron's jit runs it in the input dtype). The forward saves x and bias, as Megatron's does,
and the backward recomputes t; dbias is the sum of dx over the leading dims.

CPU fast path: "native" -- ATen's own tanh GeLU and its backward (one vectorised pass each way,
fp32 internally for bf16) after a bias add in x's dtype (Megatron's jit also adds in the input
dtype; the reference adds in fp32). ATen's tanh is slow on CPU (its GeLU takes 3.5x the erf
GeLU's time), so for tensors of at least COMPILE_MIN_NUMEL elements "native" runs the same
function written through sigmoid, 0.5 * (1 + tanh(u)) = sigmoid(2u), compiled by torch.compile
into one vectorised loop each way (fp32 inside, the bias add included): at [s=256, b=8,
ffn=1024] forward + backward 1.6 ms against 4.2 ms for ATen's kernels, for about 2 to 4 s of
compiling once per process and shape. Smaller tensors (tests, tiny models) never compile; if
compiling fails (no C++ compiler) it warns once and ATen's kernels run. "compiled" is
torch.compile of the reference's tanh formula (bench/fused_ops.py).

Triton: one elementwise kernel each way over the flattened tensor (tanh written with exp, which
Triton's interpreter and every GPU back-end have); dbias is summed by PyTorch from dx.
"""

from __future__ import annotations

import torch

from megatron.core.utils import apply_function
from megatron.fused_kernels.dispatch import BiasActivation, FusedOp, Kernels, cdiv, compile_pays, compiled, kernel, tl

_BLOCK = 1024


def _forward_reference(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    t = x.to(torch.promote_types(x.dtype, torch.float32))
    if bias is not None:
        t = t + bias
    y = t * 0.5 * (1.0 + torch.tanh(0.79788456 * t * (1.0 + 0.044715 * t * t)))
    return y.to(x.dtype)


def _backward_reference(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None):
    """(dx in x's dtype, dbias fp32 [ffn] or None)."""
    t = x.to(torch.promote_types(x.dtype, torch.float32))
    if bias is not None:
        t = t + bias
    tanh_out = torch.tanh(0.79788456 * t * (1.0 + 0.044715 * t * t))
    slope = 0.5 * t * ((1.0 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * t * t)) + 0.5 * (1.0 + tanh_out)
    dx = slope * grad_y
    dbias = None if bias is None else dx.reshape(-1, x.shape[-1]).sum(dim=0)
    return dx.to(x.dtype), dbias


@kernel
def _forward_kernel(x_ptr, b_ptr, y_ptr, n, ffn, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    t = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        t = t + tl.load(b_ptr + offs % ffn, mask=inside, other=0.0).to(tl.float32)
    u = 0.79788456 * t * (1.0 + 0.044715 * t * t)
    tanh_u = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)  # exp overflow -> inf -> tanh 1: still exact
    tl.store(y_ptr + offs, (t * 0.5 * (1.0 + tanh_u)).to(y_ptr.dtype.element_ty), mask=inside)


@kernel
def _backward_kernel(g_ptr, x_ptr, b_ptr, dx_ptr, n, ffn, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    t = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        t = t + tl.load(b_ptr + offs % ffn, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    u = 0.79788456 * t * (1.0 + 0.044715 * t * t)
    tanh_u = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
    slope = 0.5 * t * ((1.0 - tanh_u * tanh_u) * (0.79788456 + 0.1070322243 * t * t)) + 0.5 * (1.0 + tanh_u)
    tl.store(dx_ptr + offs, (slope * g).to(dx_ptr.dtype.element_ty), mask=inside)


def _forward_triton(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n > 0:
        _forward_kernel[(cdiv(n, _BLOCK),)](x, bias if bias is not None else x, y, n, x.shape[-1],
                                            HAS_BIAS=bias is not None, BLOCK=_BLOCK)
    return y


def _backward_triton(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None):
    x, grad_y = x.contiguous(), grad_y.contiguous()
    dx = torch.empty_like(x)
    n = x.numel()
    if n > 0:
        _backward_kernel[(cdiv(n, _BLOCK),)](grad_y, x, bias if bias is not None else x, dx, n, x.shape[-1],
                                             HAS_BIAS=bias is not None, BLOCK=_BLOCK)
    dbias = None if bias is None else dx.reshape(-1, x.shape[-1]).sum(dim=0, dtype=torch.float32)
    return dx, dbias


# 0.5 * (1 + tanh(u)) = sigmoid(2u): the same function through sigmoid, which vectorises as an exp
_TWO_C = 2 * 0.7978845608028654
_A = 0.044715
COMPILE_MIN_NUMEL = 1 << 20  # below this the native path stays eager (compiling would not pay back)


def _sigmoid_form_forward(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    t = (x if bias is None else x + bias).float()
    return (t * torch.sigmoid(_TWO_C * t * (1.0 + _A * t * t))).to(x.dtype)


def _sigmoid_form_backward(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    t = (x if bias is None else x + bias).float()
    s = torch.sigmoid(_TWO_C * t * (1.0 + _A * t * t))
    slope = s + t * s * (1.0 - s) * _TWO_C * (1.0 + 3.0 * _A * t * t)
    return (grad_y.float() * slope).to(x.dtype)


def _aten_forward(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.gelu(x if bias is None else x + bias, approximate="tanh")


def _aten_backward(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(grad_y, x if bias is None else x + bias, approximate="tanh")


# Compiled on first use; where compiling fails (no C++ compiler) ATen's kernels run instead, warned once.
_LARGE_FORWARD = compiled(_sigmoid_form_forward, fallback=_aten_forward)
_LARGE_BACKWARD = compiled(_sigmoid_form_backward, fallback=_aten_backward)



def _forward_native(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return (_LARGE_FORWARD if compile_pays(x, COMPILE_MIN_NUMEL) else _aten_forward)(x, bias)


def _backward_native(grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None):
    dx = (_LARGE_BACKWARD if compile_pays(x, COMPILE_MIN_NUMEL) else _aten_backward)(grad_y, x, bias)
    dbias = None if bias is None else dx.reshape(-1, x.shape[-1]).sum(dim=0, dtype=torch.float32)
    return dx, dbias


OP = FusedOp(
    name="bias_gelu",
    cpu_fast_path="native",
    implementations={
        "native": Kernels(_forward_native, _backward_native),
        "reference": Kernels(_forward_reference, _backward_reference),
        "compiled": Kernels(compiled(_forward_reference), compiled(_backward_reference)),
        "triton": Kernels(_forward_triton, _backward_triton),
    },
)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None, *, impl: str | None = None) -> torch.Tensor:
    """gelu_tanh(x + bias) for x [..., ffn] and bias [ffn] (or None); y in x's dtype.

    impl forces an implementation ("triton", "compiled", "reference"); see dispatch.py.
    """
    if bias is not None and bias.shape != x.shape[-1:]:
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not match the last dim of x {tuple(x.shape)}")
    return apply_function(BiasActivation, x, bias, OP.kernels(x.device, impl))
