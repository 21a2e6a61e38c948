"""The device-specific choices the model leaves to this package, made in one place.

The model (megatron/model) says what to compute; which kernel computes it depends on the device
and dtype of the tensors, and is decided here:

    implementation(cpu_impl, x)   the impl= a fused op gets for x: the config's CPU choice
                                  (fused_kernels_cpu_impl) for CPU tensors, else None (the op's own
                                  automatic choice: Triton on CUDA)
    dropout(x, p, training)       F.dropout, keeping a 1-byte mask for backward on CPU as CUDA does
    fast_attention_core(...)      the attention core as one node on CPU (fused_core_attention),
                                  when the config's fast path is on; None where it does not apply
    flash_attention(...)          --use-flash-attn: flash-attn on CUDA in half precision with a
                                  causal or no mask, torch's scaled_dot_product_attention otherwise
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.fused_kernels import fused_core_attention

try:  # optional: never required, used on CUDA when importable
    from flash_attn import flash_attn_func
except (ImportError, OSError):  # not installed, or built for another CUDA / torch
    flash_attn_func = None


def implementation(cpu_impl: str | None, tensor: torch.Tensor) -> str | None:
    """The impl= for a fused op on `tensor`: `cpu_impl` on CPU (tests and tiny runs skip
    torch.compile's start-up unless asked for it), None elsewhere -- the package's own choice
    (Triton on CUDA), which force_implementation / MEGATRON_FUSED_IMPL can still override."""
    return cpu_impl if tensor.device.type == "cpu" else None


class _DropoutKeepingBoolMask(torch.autograd.Function):
    """F.dropout as it runs on CPU -- noise = empty_like(x).bernoulli_(1 - p) / (1 - p), out = x * noise,
    the same draws and the same bits -- but saving a 1-byte mask for backward, not the noise."""

    @staticmethod
    def forward(ctx, x, p):
        noise = torch.empty_like(x).bernoulli_(1.0 - p)
        mask = noise.bool()
        ctx.p = p
        ctx.save_for_backward(mask)
        return x * noise.div_(1.0 - p)

    @staticmethod
    def backward(ctx, grad_output):
        (mask,) = ctx.saved_tensors
        return grad_output * mask.to(grad_output.dtype).div_(1.0 - ctx.p), None  # the forward's noise, rebuilt


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout(x, p, training), with a bool mask (1 byte per element) saved for backward on CPU
    too: on CUDA torch's fused dropout already saves one, on CPU F.dropout saves its noise in x's
    dtype. Same masks and outputs as F.dropout (the same draws); only the memory kept differs."""
    if (not training or p in (0.0, 1.0) or x.device.type != "cpu"
            or not (torch.is_grad_enabled() and x.requires_grad)):
        return F.dropout(x, p, training)
    return _DropoutKeepingBoolMask.apply(x, p)


def fast_attention_core(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, is_causal: bool, *, cpu_impl: str | None,
                        dropout_active: bool) -> torch.Tensor | None:
    """softmax(q k^T / sqrt(hn), masked) v as one autograd node (fused_core_attention), for
    q [sq, b, np, hn] and k, v [sk, b, ng, hn] (ng divides np: grouped-query attention) on CPU
    with the "native" fast path and no active attention dropout; returns [sq, b, np * hn], or
    None where it does not apply (the caller then runs its composed path). Measured faster than
    the composed path and than SDPA's CPU flash kernel, fp32 and bf16 (fused_core_attention.py).

    K and V go in once per group (the core's queries_per_key), not repeated per head, unless the
    mask differs by head."""
    if dropout_active or implementation(cpu_impl, query) != "native":
        return None
    sq, b, np_, hn = query.shape
    ng = key.shape[2]
    mask = None if is_causal else attention_mask
    if ng != np_ and mask is not None and mask.dim() >= 3 and mask.shape[-3] != 1:  # a mask per head
        key, value = (x.repeat_interleave(np_ // ng, dim=2) for x in (key, value))  # [sk, b, np, hn]
        ng = np_
    r = np_ // ng
    # Copies where the rows are strided: as views of mixed_qkv their transposes would be copied inside
    # each bmm. The inference cache's prefix ([b, ng, max_s, hn] buffers) is read in place.
    q = query.view(sq, b, ng, r, hn).permute(1, 2, 0, 3, 4).reshape(b * ng, sq * r, hn)  # [b ng, sq r, hn]
    k, v = (_dense_rows(x.permute(1, 2, 0, 3).reshape(b * ng, -1, hn)) for x in (key, value))  # [b ng, sk, hn]
    context = fused_core_attention.core_attention(q.contiguous(), k, v, scale=1.0 / hn ** 0.5, heads=ng,
                                                  mask=mask, causal=is_causal, queries_per_key=r)
    context = context.view(b, ng, sq, r, hn).permute(2, 0, 1, 3, 4)  # [b ng, sq r, hn] -> [sq, b, ng, r, hn]
    return context.reshape(sq, b, np_ * hn)  # [sq, b, np * hn]


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, n, hn] as it is where bmm reads its matrices in place -- each a dense block, or stored
    column by column (the inference cache's keys), whatever the stride between them -- else a
    contiguous copy."""
    if x.stride(1) == 1 or (x.stride(2) == 1 and x.stride(1) == x.shape[2]):
        return x
    return x.contiguous()


def _flash_attn_applies(query: torch.Tensor, attention_mask: torch.Tensor | None, is_causal: bool) -> bool:
    """flash_attn_func can compute this call: installed, CUDA, half precision, causal or unmasked."""
    return (flash_attn_func is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and (is_causal or attention_mask is None))


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, is_causal: bool, *, dropout_p: float,
                    softmax_scale: float) -> torch.Tensor:
    """q [sq, b, np, hn], k, v [sk, b, ng, hn] (ng divides np: grouped-query attention) -> [sq, b, np, hn].

    flash-attn's flash_attn_func when it imports, the tensors are fp16/bf16 on CUDA and the mask
    is the causal one or none; otherwise scaled_dot_product_attention, which takes any bool mask
    (True = masked out). Rows whose keys are all masked average the values, as Megatron's -10000
    fill does (SDPA alone gives 0 there).
    """
    if _flash_attn_applies(query, attention_mask, is_causal):
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [s, b, n, hn] -> [b, s, n, hn]
        context = flash_attn_func(q, k, v, dropout_p, softmax_scale=softmax_scale, causal=is_causal)
        return context.transpose(0, 1)  # [b, sq, np, hn] -> [sq, b, np, hn]
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, n, hn] -> [b, n, s, hn]
    keep = None if is_causal or attention_mask is None else ~attention_mask  # SDPA: True = takes part
    grouped = k.shape[1] != q.shape[1]
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=softmax_scale, enable_gqa=grouped)  # [b, np, sq, hn]
    if keep is not None:
        fully_masked = attention_mask.all(dim=-1, keepdim=True)  # [b or 1, 1, sq, 1]
        mean_v = v.mean(dim=-2, keepdim=True)  # [b, ng, 1, hn]
        if grouped:
            mean_v = mean_v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        context = torch.where(fully_masked, mean_v, context)  # [b, np, sq, hn]
    return context.permute(2, 0, 1, 3)  # [b, np, sq, hn] -> [sq, b, np, hn]
