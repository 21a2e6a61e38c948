"""Rotary position embedding on [s, b, heads, hn] (Megatron-Core's apply_rotary_pos_emb, bshd), forward and backward.

    rot = freqs.shape[-1] (even, <= hn); only the first rot channels of each head rotate
    y[..., :rot] = x * cos(freqs) + rotate_half(x) * sin(freqs)
    y[..., rot:] = x[..., rot:]                                       (partial rotary, --rotary-percent)
    non-interleaved: rotate_half(x) = cat(-x2, x1), x1 and x2 the two halves of the rot channels,
                     so channel i pairs with i + rot/2; freqs = cat(f, f)
    interleaved:     rotate_half(x)[2i] = -x[2i + 1], rotate_half(x)[2i + 1] = x[2i];
                     freqs = f with each angle repeated twice adjacently
    backward:        dx = the same with -sin (the inverse rotation); no gradient for freqs

t [s, b, heads, hn], any float dtype, may be a strided view (a split of the fused QKV output);
freqs [s, 1, 1, rot] fp32 angles in Megatron-Core's layout above, where both channels of a
pair share one angle -- the backward is the transpose of the forward only then. y and dx are
contiguous, in t's dtype. cos and sin are taken in fp32 (from freqs) and rounded to t's dtype
as Megatron-Core does; the reference then computes in t's dtype, as Megatron-Core's unfused
_apply_rotary_pos_emb_bshd does (so the two agree bit for bit), while the Triton kernel computes
in fp32 and rounds once. The forward saves freqs only: the backward needs no activation.

CPU fast path: "native" -- cos and sin in t's dtype (rotate_half's signs folded into the sin
table), the pairs swapped into the output tensor, then one in-place multiply and one
torch.addcmul_: no rotate_half copy, no cat, one activation-sized allocation; the same on the
gradient. Measured forward + backward of q [256, 8, 8, 32] and k [256, 8, 2, 32] (k a strided
view of a fused QKV, 2 query groups; bench/fused_ops.py --threads 1 --clock cpu --repeats 20),
ms, fp32 / bf16: Megatron-Core's unfused formula under autograd 3.59 / 3.25, reference
4.90 / 3.78, native 2.45 / 2.76, compiled 3.87 / 3.71. Native is the fastest, without compiling.

Triton: one kernel each way (the backward is the forward with sin negated); a program takes
one (s, b) position and a block of heads, the pairs along the other block axis, cos and sin
read from [s, rot] fp32 tables computed by PyTorch (exact, like the reference's), t read
through its strides, the pass-through channels copied in the same program.
"""

from __future__ import annotations

import torch

from megatron.core.utils import apply_function
from megatron.fused_kernels.dispatch import FusedOp, Kernels, cdiv, compiled, kernel, next_power_of_2, tl

_MAX_TILE = 4096  # elements of x one Triton program rotates (heads x pairs)


def _pair_slices(rot: int, interleaved: bool) -> tuple[slice, slice]:
    """The first and the second channel of every rotating pair."""
    if interleaved:
        return slice(0, rot, 2), slice(1, rot, 2)
    return slice(0, rot // 2), slice(rot // 2, rot)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[..., rot]: cat(-x2, x1), or per pair (-x[2i + 1], x[2i]) when interleaved."""
    first, second = _pair_slices(x.shape[-1], interleaved)
    if not interleaved:
        return torch.cat((-x[..., second], x[..., first]), dim=-1)
    return torch.stack((-x[..., second], x[..., first]), dim=-1).flatten(-2)


def _rotate_reference(x: torch.Tensor, freqs: torch.Tensor, interleaved: bool, sign: float) -> torch.Tensor:
    rot = freqs.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos = torch.cos(freqs.float()).to(x.dtype)  # [s, 1, 1, rot]
    sin = (sign * torch.sin(freqs.float())).to(x.dtype)
    return torch.cat((x_rot * cos + _rotate_half(x_rot, interleaved) * sin, x_pass), dim=-1)


def _forward_reference(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _rotate_reference(t, freqs, interleaved, 1.0)


def _backward_reference(grad_y: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _rotate_reference(grad_y, freqs, interleaved, -1.0)


def _rotate_native(x: torch.Tensor, freqs: torch.Tensor, interleaved: bool, sign: float) -> torch.Tensor:
    rot = freqs.shape[-1]
    first, second = _pair_slices(rot, interleaved)
    cos = torch.cos(freqs.float()).to(x.dtype)  # [s, 1, 1, rot]
    sin = sign * torch.sin(freqs.float())
    sin[..., first] *= -1.0  # rotate_half's sign: rotate_half(x) * sin = swap_pairs(x) * this
    sin = sin.to(x.dtype)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [s, b, heads, hn], contiguous
    y_rot = y[..., :rot]
    y_rot[..., first] = x[..., second]  # the pairs swapped, then scaled in place: no other activation-sized tensor
    y_rot[..., second] = x[..., first]
    y_rot.mul_(sin).addcmul_(x[..., :rot], cos)
    if rot < x.shape[-1]:
        y[..., rot:] = x[..., rot:]
    return y


def _forward_native(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _rotate_native(t, freqs, interleaved, 1.0)


def _backward_native(grad_y: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _rotate_native(grad_y, freqs, interleaved, -1.0)


@kernel
def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, b, heads, hn, rot, pairs, stride_s, stride_b, stride_h,
                   stride_d, sign, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # s * b + batch index
    pos = row // b
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    pair = tl.arange(0, BLOCK_P)[None, :]  # [1, BLOCK_P]
    if INTERLEAVED:
        first = 2 * pair
        second = first + 1
    else:
        first = pair
        second = pair + pairs
    in_rot = pair < pairs
    inside = (head < heads) & in_rot
    x_row = x_ptr + pos * stride_s + (row % b) * stride_b + head * stride_h
    y_row = y_ptr + row * heads * hn + head * hn  # y is contiguous [s, b, heads, hn]
    x1 = tl.load(x_row + first * stride_d, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second * stride_d, mask=inside, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + pos * rot + first, mask=in_rot, other=0.0)
    cos2 = tl.load(cos_ptr + pos * rot + second, mask=in_rot, other=0.0)
    sin1 = sign * tl.load(sin_ptr + pos * rot + first, mask=in_rot, other=0.0)
    sin2 = sign * tl.load(sin_ptr + pos * rot + second, mask=in_rot, other=0.0)
    tl.store(y_row + first, (x1 * cos1 - x2 * sin1).to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(y_row + second, (x2 * cos2 + x1 * sin2).to(y_ptr.dtype.element_ty), mask=inside)
    if BLOCK_PASS > 0:  # channels rot..hn pass through
        cols = rot + tl.arange(0, BLOCK_PASS)[None, :]
        passing = (head < heads) & (cols < hn)
        tl.store(y_row + cols, tl.load(x_row + cols * stride_d, mask=passing, other=0.0), mask=passing)


def _rotate_triton(x: torch.Tensor, freqs: torch.Tensor, interleaved: bool, sign: float) -> torch.Tensor:
    s, b, heads, hn = x.shape
    rot = freqs.shape[-1]
    angles = freqs.float().reshape(s, rot)
    cos, sin = torch.cos(angles).contiguous(), torch.sin(angles).contiguous()  # [s, rot] fp32
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_p = next_power_of_2(rot // 2)
    block_h = min(next_power_of_2(heads), max(1, _MAX_TILE // block_p))
    block_pass = next_power_of_2(hn - rot) if rot < hn else 0
    if x.numel() > 0:
        _rotate_kernel[(s * b, cdiv(heads, block_h))](x, cos, sin, y, b, heads, hn, rot, rot // 2, *x.stride(),
                                                      sign, INTERLEAVED=interleaved, BLOCK_H=block_h,
                                                      BLOCK_P=block_p, BLOCK_PASS=block_pass)
    return y


def _forward_triton(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _rotate_triton(t, freqs, interleaved, 1.0)


def _backward_triton(grad_y: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return _rotate_triton(grad_y, freqs, interleaved, -1.0)


OP = FusedOp(
    name="rotary_pos_emb",
    cpu_fast_path="native",
    implementations={
        "native": Kernels(_forward_native, _backward_native),
        "reference": Kernels(_forward_reference, _backward_reference),
        "compiled": Kernels(compiled(_forward_reference), compiled(_backward_reference)),
        "triton": Kernels(_forward_triton, _backward_triton),
    },
)


class _RotaryPosEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, interleaved, kernels):
        ctx.save_for_backward(freqs)
        ctx.interleaved, ctx.kernels = interleaved, kernels
        return kernels.forward(t, freqs, interleaved)

    @staticmethod
    def backward(ctx, grad_y):
        (freqs,) = ctx.saved_tensors
        return ctx.kernels.backward(grad_y, freqs, ctx.interleaved), None, None, None


def _check(t: torch.Tensor, freqs: torch.Tensor) -> None:
    if t.dim() != 4:
        raise ValueError(f"rotary_pos_emb: t must be [s, b, heads, hn], got shape {tuple(t.shape)}")
    s, hn, rot = t.shape[0], t.shape[-1], freqs.shape[-1]
    if freqs.dim() != 4 or freqs.shape[:3] != (s, 1, 1) or rot % 2 or rot > hn:
        raise ValueError(f"rotary_pos_emb: freqs must be [s={s}, 1, 1, rot_dim] with rot_dim even and <= hn={hn}, "
                         f"got shape {tuple(freqs.shape)}")


def rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, *,
                   impl: str | None = None) -> torch.Tensor:
    """RoPE on t [s, b, heads, hn] with freqs [s, 1, 1, rot_dim] fp32 (Megatron-Core's layout).

    The first rot_dim channels of each head rotate, the rest pass through; y is contiguous, in
    t's dtype. impl forces an implementation; see dispatch.py.
    """
    _check(t, freqs)
    return apply_function(_RotaryPosEmb, t, freqs, bool(interleaved), OP.kernels(t.device, impl))
