"""The attention core, softmax(q k^T * scale, masked) v, as one autograd node: the CPU fast path.

    q [B, sq, hn], k and v [B, sk, hn] (B = batch x heads)  ->  context [B, sq, hn]

Grouped-query attention (queries_per_key r = np / ng > 1) takes K and V once per group, not
repeated per head: B = batch x groups, and q holds the r heads of each group interleaved by
position, [B, sq * r, hn] with row p * r + j = position p of the group's head j. Each GEMM
then runs all r heads of a group against their one K (M = r x the rows of a block), and the
gradient of K and V is summed over the r heads inside the GEMMs, with no [B r, sk, hn] copies
of K and V forward or backward. r = 1 is multi-head attention, the layout above.

Semantics are fused_softmax.scale_mask_softmax's between two matmuls (Megatron's
DotProductAttention with masked_softmax_fusion and no attention dropout): masked scores take
no probability (Megatron fills -10000), a row whose keys are all masked gives probabilities 0
and a zero gradient, the softmax is computed in fp32 for fp16/bf16 scores and the
probabilities are rounded once to the input dtype.

Why a node of its own: the composed path (matmul, scale, mask fill, softmax, matmul, each an
autograd node) makes an fp32 copy of the [B, sq, sk] scores for the softmax, a second for its
backward, and several temporaries besides; on a 2-core CPU that costs more than the two
matmuls. Here the forward is a batched GEMM, ATen's softmax and a second GEMM; the backward
is four GEMMs around ATen's softmax backward. Only q, k, v and the probabilities are saved
(the [B, sq, sk] tensor the composed path keeps too).

Causal attention without another mask goes block by block of QUERY_BLOCK queries: a block's
scores are written by one GEMM straight into the causal mask's additive bias (baddbmm) over
only the keys its queries can see, so the masked upper part of the scores is neither
computed nor stored (3/8 of it at s = 256). A query that sees no key (sq > sk) gets zero
probabilities. Any other mask is a bool tensor broadcastable to [b, heads, sq, sk] (True =
masked out), applied with masked_fill on the full scores viewed as [b, heads, sq, sk].

Measured per layer on the GPT of bench/compare_peers.py (b=8, 8 heads, s=256, hn=32),
forward + backward, causal: bf16 8.1 ms (9.0 unblocked) against 20.4 ms for torch's
scaled_dot_product_attention (its CPU flash kernel; at hn = 32 its blocked loops stay far
from the GEMM ceiling), fp32 13.4 ms (18.2 unblocked) against 15.8 ms for SDPA.
"""

from __future__ import annotations

import functools

import torch

from megatron.core.utils import apply_function
from megatron.fused_kernels.fused_softmax import MASK_FILL_VALUE


@functools.lru_cache(maxsize=64)
def _causal_bias(rows: int, keys: int, offset: int, dtype: torch.dtype, device: torch.device,
                 repeats: int = 1) -> torch.Tensor:
    """[rows * repeats, keys] additive mask: 0 where key j <= row i + offset, -10000 above; each
    row repeated `repeats` times in a row (the r heads of a query group at one position)."""
    hidden = torch.ones(rows, keys, dtype=torch.bool, device=device).triu_(offset + 1)
    bias = torch.zeros(rows, keys, dtype=dtype, device=device).masked_fill_(hidden, MASK_FILL_VALUE)
    return bias.repeat_interleave(repeats, dim=0) if repeats > 1 else bias


def _combined_bool_mask(mask: torch.Tensor | None, causal: bool, sq: int, sk: int,
                        device: torch.device) -> torch.Tensor | None:
    if not causal:
        return mask
    hidden = torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(sk - sq + 1)
    return hidden if mask is None else mask | hidden


QUERY_BLOCK = 64  # rows of queries per block on the causal path


def _causal_blocks(sq: int, sk: int) -> list[tuple[int, int, int]]:
    """(first query, end query, keys seen) per block of QUERY_BLOCK queries: query i sees keys j <= i + sk - sq."""
    blocks = []
    for start in range(0, sq, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, sq)
        blocks.append((start, end, max(0, min(sk, end + sk - sq))))
    return blocks


class _CausalCoreAttention(torch.autograd.Function):
    """Causal attention block by block of queries: a block sees only the keys up to its last query,
    so the GEMMs, the softmax and its backward skip the masked upper part of the scores (3/8 of
    them at s = 256 with blocks of 64; half as s / block grows)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, r):
        sq, sk = q.shape[1] // r, k.shape[1]  # q [B, sq * r, hn]: r rows per position
        context = torch.empty_like(q)  # [B, sq * r, hn]
        probs = []
        for start, end, keys in _causal_blocks(sq, sk):
            rows = slice(start * r, end * r)  # positions start .. end - 1, all r heads
            if keys == 0:  # every key masked: zero probabilities (Megatron's fused softmax)
                context[:, rows] = 0.0
                probs.append(None)
                continue
            bias = _causal_bias(end - start, keys, start + sk - sq, q.dtype, q.device, r)  # [rows r, keys]
            block = torch.softmax(torch.baddbmm(bias, q[:, rows], k[:, :keys].transpose(1, 2), alpha=scale), -1)
            block[:, : max(0, sq - sk - start) * r] = 0.0  # queries before the first key (sq > sk) see nothing
            context[:, rows] = torch.bmm(block, v[:, :keys])
            probs.append(block)
        ctx.save_for_backward(q, k, v, *[p for p in probs if p is not None])
        ctx.scale, ctx.r, ctx.empty = scale, r, [p is None for p in probs]
        return context

    @staticmethod
    def backward(ctx, grad_context):
        q, k, v, *saved = ctx.saved_tensors
        saved = iter(saved)
        grad_context = grad_context.contiguous()  # [B, sq, hn]; the model's arrives permuted
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        r = ctx.r
        for (start, end, keys), empty in zip(_causal_blocks(q.shape[1] // r, k.shape[1]), ctx.empty):
            rows = slice(start * r, end * r)
            if empty:
                grad_q[:, rows] = 0.0
                continue
            probs, grad = next(saved), grad_context[:, rows]  # [B, rows r, keys], [B, rows r, hn]
            # (a GEMM into a fresh tensor, then an add: baddbmm_ into this strided view of grad_v
            # would loop over the batch in ATen, one small GEMM per head)
            grad_v[:, :keys] += torch.bmm(probs.transpose(1, 2), grad)
            grad_scores = torch._softmax_backward_data(torch.bmm(grad, v[:, :keys].transpose(1, 2)), probs, -1,
                                                       probs.dtype)
            if ctx.scale != 1.0:
                grad_scores.mul_(ctx.scale)
            grad_q[:, rows] = torch.bmm(grad_scores, k[:, :keys])
            grad_k[:, :keys] += torch.bmm(grad_scores.transpose(1, 2), q[:, rows])  # summed over the r heads
        return grad_q, grad_k, grad_v, None, None


class _CoreAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, heads, scale, r):
        batch_heads, sq, _ = q.shape  # heads: query groups when r > 1 (q [B, sq * r, hn])
        sq, sk = sq // r, k.shape[1]
        scores = torch.bmm(q, k.transpose(1, 2))  # [B, sq * r, sk]
        if scale != 1.0:
            scores.mul_(scale)
        masked = _combined_bool_mask(mask, causal, sq, sk, q.device)
        empty_rows = None
        by_head = (batch_heads // heads, heads, sq, r, sk)  # a position's r rows share its mask row
        if masked is not None:
            masked = masked.unsqueeze(-2)  # [.., sq, 1, sk]
            scores.view(by_head).masked_fill_(masked, MASK_FILL_VALUE)
            empty_rows = masked.all(dim=-1, keepdim=True)  # [.., sq, 1, 1], broadcast over b and heads
        probs = torch.softmax(scores, dim=-1)  # ATen: fp32 arithmetic inside for bf16 / fp16
        if empty_rows is not None:
            probs.view(by_head).masked_fill_(empty_rows, 0.0)
        ctx.save_for_backward(q, k, v, probs)
        ctx.scale = scale
        return torch.bmm(probs, v)  # [B, sq, hn]

    @staticmethod
    def backward(ctx, grad_context):
        q, k, v, probs = ctx.saved_tensors
        grad_context = grad_context.contiguous()
        grad_v = torch.bmm(probs.transpose(1, 2), grad_context)  # [B, sk, hn]
        grad_probs = torch.bmm(grad_context, v.transpose(1, 2))  # [B, sq, sk]
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        if ctx.scale != 1.0:
            grad_scores.mul_(ctx.scale)
        grad_q = torch.bmm(grad_scores, k)  # [B, sq, hn]
        grad_k = torch.bmm(grad_scores.transpose(1, 2), q)  # [B, sk, hn]
        return grad_q, grad_k, grad_v, None, None, None, None, None


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, heads: int,
                   mask: torch.Tensor | None = None, causal: bool = False,
                   queries_per_key: int = 1) -> torch.Tensor:
    """softmax(q k^T * scale masked) v for q [B, sq, hn], k, v [B, sk, hn], B = b * heads (batch major).

    mask: bool, True = masked out, broadcastable to [b, heads, sq, sk]; causal adds the causal
    mask. Returns [B, sq, hn] in q's dtype. queries_per_key r > 1 (grouped-query attention):
    heads counts the query groups, q is [B, sq * r, hn] with the group's r heads interleaved by
    position (the module docstring), and the mask must be the same for all r heads of a group:
    broadcastable to [b, groups, sq, sk] with 1 in its heads dim.
    """
    r = int(queries_per_key)
    if (q.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]
            or r < 1 or q.shape[1] % r):
        raise ValueError(f"core_attention expects q [B, sq, hn] and k, v [B, sk, hn] (with queries_per_key "
                         f"{queries_per_key}: q [B, sq * r, hn]); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[0] % heads:
        raise ValueError(f"batch x heads ({q.shape[0]}) is not a multiple of heads ({heads})")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = masked out), got {mask.dtype}")
    if r > 1 and mask is not None and mask.dim() >= 3 and mask.shape[-3] != 1:
        raise ValueError(f"with queries_per_key {r} the mask must not differ by head (its heads dim is "
                         f"{mask.shape[-3]}); repeat K and V per head instead")
    if causal and mask is None:
        return apply_function(_CausalCoreAttention, q, k, v, float(scale), r)
    return apply_function(_CoreAttention, q, k, v, mask, bool(causal), int(heads), float(scale), r)
