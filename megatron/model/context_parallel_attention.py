"""Causal self-attention over a sequence split across the context-parallel (CP) ranks.

Each of the N CP ranks holds s/N tokens in Megatron's load-balanced layout (chunks r and 2N-1-r of
2N; megatron/core/context_parallel.py): its queries, keys and values [s/N, b, heads, hn] after the
projection and RoPE (the angles of the real positions). Every layer's attention needs the keys and
values of earlier positions held elsewhere; cp_comm_type says how they travel (Megatron's names):

    p2p        ring attention: K/V blocks go round the CP ring (N-1 shifts). Each block gives a
               partial result and its log-sum-exp; partials merge by LSE, so the result is the softmax
               over every key. A chunk pair is masked by the real positions, rows / columns with no
               visible key are skipped: with the load-balanced layout a block from an earlier rank
               is (all queries x the block's first half), from a later rank (the queries' second
               half x the whole block). Each shift is started before the block it overlaps, so
               the next K/V travel while this one computes (gloo's isend/irecv run in the
               background). Backward sends the K/V gradients back round the ring.
    allgather  K/V all-gathered (the whole sequence), local queries masked by their real positions;
               backward reduce-scatters the K/V gradients.
    a2a        Ulysses: all-to-all from sequence-split [s/N, b, np, hn] to head-split [s, b, np/N, hn],
               the ordinary causal core attention on the whole sequence, all-to-all back. Needs
               np / tp divisible by N; K/V with fewer groups are repeated up to that.
    a2a+p2p    a2a inside groups of a consecutive CP ranks, then the p2p ring over the N/a groups
               (hierarchical_context_parallel_sizes [a, N/a]).

allgather and a2a run the layer's core attention module (DotProductAttention, its fused CPU path,
or SDPA with --use-flash-attn); p2p runs the block softmax here (it needs each block's LSE).
Gradients flow through differentiable exchanges (autograd), so backward is exact by construction.
Attention dropout draws from the tensor-parallel rank's stream as without CP (as in Megatron, the
CP ranks of one TP rank share the seed).

Masks: the causal mask (is_causal, or the loader's causal mask cut to this rank's rows,
[b or 1, 1, s/N, s]), or a mask over the whole row in global order, [b or 1, 1, s, s] (True =
masked; packed sequences: GPTModel._forward_packed gives the per-document causal mask of the
uncut row). A global mask is ANDed with the causal mask of the real positions and every comm type
cuts it by the real positions of its queries and keys: p2p's blocks take the rows of their queries
and the columns of the block's keys (no exchange: each rank has the whole mask), allgather its
query rows, a2a the whole mask (position order), a2a+p2p the group's rows and columns. Every token
must see itself (a query with no key has no softmax). ALiBi is refused (TransformerConfig/validation).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.context_parallel import (cp_positions, gather_sequence, heads_to_sequence, ring_shift_start,
                                            sequence_to_heads)
from megatron.model.layers import tensor_parallel_dropout_context


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[s, b, ng, hn] -> [s, b, heads, hn], each group's head repeated."""
    return x if x.shape[2] == heads else x.repeat_interleave(heads // x.shape[2], dim=2)


def _group_positions(seq_length: int, cp_size: int, cp_ranks: list[int], device) -> torch.Tensor:
    """The real positions of the tokens of CP ranks `cp_ranks`, concatenated in that order."""
    return torch.cat([cp_positions(seq_length, cp_size, r, device) for r in cp_ranks])


class _Block:
    """One query set against one K/V block: softmax partials (out [b, np, sq, hn], lse [b, np, sq])."""

    def __init__(self, scale: float, dropout_p: float) -> None:
        self.scale, self.dropout_p = scale, dropout_p

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_q: torch.Tensor,
                 pos_k: torch.Tensor, mask: torch.Tensor | None = None):
        """mask: None (causal) or the global mask [B, s, s] (True = masked, B = b or 1, causal included)."""
        if mask is None:
            visible = (pos_k[None, :] <= pos_q[:, None])[None]  # [1, sq, sk]
        else:
            visible = ~mask.index_select(1, pos_q).index_select(2, pos_k)  # [B, sq, sk]
        rows = visible.any(dim=2).any(dim=0).nonzero().squeeze(1)
        cols = visible.any(dim=1).any(dim=0).nonzero().squeeze(1)
        if rows.numel() == 0:
            return None
        sq, b, np_, hn = q.shape
        all_rows = rows.numel() == sq
        q_part = q if all_rows else q.index_select(0, rows)
        if cols.numel() != k.shape[0]:
            k, v = k.index_select(0, cols), v.index_select(0, cols)
        masked = ~visible.index_select(1, rows).index_select(2, cols)  # [B, sq', sk'] True = masked
        # A row may see a key of this block in one batch row and none in another (another document):
        # no softmax there (lse -inf, output 0), no NaN in either direction.
        empty = masked.all(dim=2)[:, None, :, None] if mask is not None else None  # [B, 1, sq', 1]
        if empty is not None and not empty.any():
            empty = None
        k, v = _repeat_kv(k, np_), _repeat_kv(v, np_)
        qh = q_part.permute(1, 2, 0, 3).float()  # [sq', b, np, hn] -> [b, np, sq', hn]
        kh = k.permute(1, 2, 3, 0).float()  # [sk', b, np, hn] -> [b, np, hn, sk']
        vh = v.permute(1, 2, 0, 3).float()  # [sk', b, np, hn] -> [b, np, sk', hn]
        scores = torch.matmul(qh, kh) * self.scale  # [b, np, sq', sk']
        if masked.any():
            scores = scores.masked_fill(masked[:, None], float("-inf"))
        # softmax = e / l with e = exp(scores - rowmax), l = sum(e): autograd keeps e only (one
        # [b, np, sq', sk'] tensor); normalising the [sq', hn] output instead of e saves a second one.
        with torch.no_grad():  # a shift that cancels in e / l: no gradient, nothing saved
            rowmax = scores.amax(dim=-1, keepdim=True)  # finite where a row sees a key
            if empty is not None:
                rowmax = rowmax.masked_fill(empty, 0.0)
        e = torch.exp(scores - rowmax)
        total = e.sum(dim=-1, keepdim=True)  # [b, np, sq', 1]; >= 1 where a row sees a key
        if empty is not None:
            total = total.masked_fill(empty, 1.0)  # e is 0 there: output 0
        lse = (rowmax + torch.log(total)).squeeze(-1)  # [b, np, sq']
        if empty is not None:
            lse = lse.masked_fill(empty.squeeze(-1), float("-inf"))
        if self.dropout_p > 0:  # dropout of the probabilities = dropout of e, then the same division
            with tensor_parallel_dropout_context(partitioned=True):  # this rank's heads only
                e = F.dropout(e, self.dropout_p)
        out = torch.matmul(e, vh) / total  # [b, np, sq', hn]
        if not all_rows:  # rows without a visible key: nothing (lse -inf)
            out = out.new_zeros(b, np_, sq, hn).index_copy(2, rows, out)
            lse = lse.new_full((b, np_, sq), float("-inf")).index_copy(2, rows, lse)
        return out, lse


def _merge(acc, part):
    """Two softmax partials over disjoint keys -> the partial over both (the first has finite lse)."""
    if part is None:
        return acc
    out, lse = acc
    part_out, part_lse = part
    merged = torch.logaddexp(lse, part_lse)  # [b, np, sq]
    out = out * torch.exp(lse - merged).unsqueeze(-1) + part_out * torch.exp(part_lse - merged).unsqueeze(-1)
    return out, merged


def ring_attention(query, key, value, pos_q, positions_of, group, scale: float, dropout_p: float,
                   mask: torch.Tensor | None = None):
    """p2p: query [sq, b, np, hn] at pos_q against every ring rank's key/value [sk, b, ng, hn];
    positions_of(ring rank) -> that rank's key positions; mask None (causal) or the global mask
    [B, s, s] (causal included), cut by the positions. Returns [sq, b, np * hn]."""
    size = torch.distributed.get_world_size(group)
    me = torch.distributed.get_rank(group)
    block = _Block(scale, dropout_p)
    kv = torch.stack((key, value))  # [2, sk, b, ng, hn]: one exchange per step
    # Each shift is started before the block it overlaps: the next K/V travel while this one computes.
    incoming, handle = ring_shift_start(kv, group) if size > 1 else (None, None)
    acc = block(query, key, value, pos_q, positions_of(me), mask)  # the own block: every row sees itself
    for step in range(1, size):
        handle.wait()
        kv = incoming  # ring rank (me - step)'s keys and values
        if step < size - 1:
            incoming, handle = ring_shift_start(kv, group)  # passed on while this block computes
        acc = _merge(acc, block(query, kv[0], kv[1], pos_q, positions_of((me - step) % size), mask))
    out = acc[0].to(query.dtype)  # [b, np, sq, hn]
    sq, b, np_, hn = query.shape
    return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)  # [b, np, sq, hn] -> [sq, b, np * hn]


def _is_causal_mask(mask, pos_q: torch.Tensor) -> bool:
    """Whether mask [b or 1, 1, s/N, s] (True = masked) is the causal mask of the queries at pos_q."""
    seq_length = pos_q.shape[0] * parallel_state.get_context_parallel_world_size()
    if mask is None or mask.dim() != 4 or tuple(mask.shape[-2:]) != (pos_q.shape[0], seq_length):
        return False
    causal = torch.arange(seq_length, device=mask.device)[None, :] > pos_q[:, None]  # [s/N, s]
    return bool(torch.equal(mask.bool(), causal.expand_as(mask)))


def _global_mask(mask, pos_q: torch.Tensor, seq_length: int):
    """None for the causal mask (cut to this rank's rows, [b or 1, 1, s/N, s]); for a mask over the
    whole row [b or 1, 1, s, s] (packed sequences): [B, s, s] bool, True = masked, the causal mask
    included. Anything else is refused."""
    if _is_causal_mask(mask, pos_q):
        return None
    if mask is None or mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[-2:]) != (seq_length, seq_length):
        raise ValueError("context parallelism takes the causal mask or a mask over the whole sequence "
                         f"[b, 1, {seq_length}, {seq_length}] (packed sequences); got "
                         f"{None if mask is None else tuple(mask.shape)}")
    future = torch.ones(seq_length, seq_length, dtype=torch.bool, device=mask.device).triu_(1)
    masked = mask[:, 0].bool() | future  # [B, s, s]
    if masked.diagonal(dim1=1, dim2=2).any():
        raise ValueError("context parallelism needs every token to attend to itself: the attention mask "
                         "masks a token's own position")
    return masked


def _natural_order(seq_length: int, cp_size: int, cp_ranks: list[int], device):
    """(permutation putting the ranks' concatenated tokens in position order, its inverse)."""
    order = torch.argsort(_group_positions(seq_length, cp_size, cp_ranks, device))
    return order, torch.argsort(order)


def context_parallel_attention(core_attention, config, layer_number: int, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask, is_causal: bool, attention_bias) -> torch.Tensor:
    """query [s/N, b, np/t, hn], key / value [s/N, b, ng/t, hn] (this CP rank's tokens) ->
    context [s/N, b, np/t * hn], by the layer's cp_comm_type. With is_causal the attention_mask (the
    block's local one) is ignored: the mask of the real positions is built here. A given mask is
    either that causal mask, as get_batch_on_this_cp_rank cuts a loader's [b, 1, s, s] one
    ([b or 1, 1, s/N, s]), or a mask over the whole uncut row [b or 1, 1, s, s] in position order
    (packed sequences), ANDed with the causal mask and cut here by each comm type."""
    kind = config.cp_comm_type_of(layer_number)
    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    group = parallel_state.get_context_parallel_group()
    s_local, b, np_, hn = query.shape
    seq_length = s_local * cp_size
    device = query.device
    pos_q = cp_positions(seq_length, cp_size, cp_rank, device)
    mask = None if is_causal else _global_mask(attention_mask, pos_q, seq_length)  # None: causal
    if attention_bias is not None:
        raise ValueError("context parallelism does not take an attention bias (ALiBi)")
    scale = 1.0 / math.sqrt(hn)
    dropout_p = config.attention_dropout if core_attention.training else 0.0
    if kind == "p2p":
        return ring_attention(query, key, value, pos_q, lambda r: cp_positions(seq_length, cp_size, r, device),
                              group, scale, dropout_p, mask)
    if kind == "allgather":
        order, _ = _natural_order(seq_length, cp_size, list(range(cp_size)), device)
        # [s/N, b, ng, hn] each -> [2, s, b, ng, hn] in position order
        kv = gather_sequence(torch.stack((key, value), dim=1), group).index_select(0, order).transpose(0, 1)
        if mask is None:
            rows = (torch.arange(seq_length, device=device)[None, :] > pos_q[:, None]).view(1, 1, s_local, seq_length)
        else:
            rows = mask.index_select(1, pos_q)[:, None]  # [B, 1, s/N, s]: this rank's queries, every key
        return core_attention(query, kv[0], kv[1], rows, False, None)  # [s/N, b, np * hn]
    if kind == "a2a":
        return _ulysses(core_attention, query, key, value, group, cp_size, list(range(cp_size)), seq_length, mask)
    # a2a+p2p: Ulysses inside the a2a group, the ring across the groups
    a2a_group, p2p_group = parallel_state.get_hierarchical_context_parallel_groups()
    inner = torch.distributed.get_world_size(a2a_group)
    ring_rank = cp_rank // inner  # a2a groups hold consecutive CP ranks

    def members(ring: int) -> list[int]:
        return list(range(ring * inner, (ring + 1) * inner))

    q, k, v = _to_heads(query, key, value, a2a_group, inner)  # [inner s/N, b, np/inner, hn], k/v likewise
    context = ring_attention(q, k, v, _group_positions(seq_length, cp_size, members(ring_rank), device),
                             lambda r: _group_positions(seq_length, cp_size, members(r), device), p2p_group,
                             scale, dropout_p, mask)  # [inner s/N, b, np/inner * hn]
    return _from_heads(context, a2a_group, inner, np_, hn)


def _to_heads(query, key, value, group, size: int):
    """Sequence-split q/k/v -> head-split over the whole group's tokens (K/V repeated up to a multiple)."""
    np_ = query.shape[2]
    if key.shape[2] % size:
        key, value = _repeat_kv(key, np_), _repeat_kv(value, np_)
    return heads_to_sequence(query, group), heads_to_sequence(key, group), heads_to_sequence(value, group)


def _from_heads(context: torch.Tensor, group, size: int, np_: int, hn: int) -> torch.Tensor:
    s_all, b, _ = context.shape
    context = context.view(s_all, b, np_ // size, hn)  # [s, b, np/N, hn]
    out = sequence_to_heads(context, group)  # [s/N, b, np, hn]
    return out.reshape(s_all // size, b, np_ * hn)


def _ulysses(core_attention, query, key, value, group, cp_size: int, cp_ranks: list[int], seq_length: int,
             mask: torch.Tensor | None = None):
    s_local, b, np_, hn = query.shape
    q, k, v = _to_heads(query, key, value, group, cp_size)  # [s, b, np/N, hn] in rank-chunk order
    order, inverse = _natural_order(seq_length, cp_size, cp_ranks, query.device)
    q, k, v = (x.index_select(0, order) for x in (q, k, v))  # position order
    if mask is None:
        causal = torch.ones(seq_length, seq_length, dtype=torch.bool, device=query.device).triu(1).view(
            1, 1, seq_length, seq_length)
        context = core_attention(q, k, v, causal, True, None)  # [s, b, np/N * hn]
    else:  # the global mask: every query, every key, position order
        context = core_attention(q, k, v, mask[:, None], False, None)  # [s, b, np/N * hn]
    context = context.index_select(0, inverse)  # back to rank-chunk order
    return _from_heads(context, group, cp_size, np_, hn)
