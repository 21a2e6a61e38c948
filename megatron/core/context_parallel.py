"""Context parallelism: the sequence split over the ranks of the CP group, and the exchanges between them.

Megatron's load-balanced layout: a sequence of s tokens is cut into 2N chunks of s/2N (N = CP size)
and CP rank r holds chunks r and 2N-1-r, in that order. Under a causal mask the later a token, the
more keys it attends to; pairing an early chunk with a late one gives every rank the same work.
s = 16, N = 2 (chunks of 4):

    rank 0  positions 0..3  and 12..15
    rank 1  positions 4..7  and  8..11

`cp_positions` gives a rank's positions, `split_for_cp_rank` cuts a tensor along its sequence dim
(megatron.training.utils.get_batch_on_this_cp_rank uses it on the batch, the model on RoPE's angles).

The differentiable exchanges the attention uses (every collective goes through communication.py):
    ring_shift(_start)  p2p: send to the next rank of the ring, receive from the previous one
                        (started, waited on after the caller's compute); backward sends the
                        gradient the other way round
    gather_sequence     allgather: [s/N, ...] -> [s, ...] in rank order; backward reduce-scatters
    heads_to_sequence   a2a (Ulysses): [s/N, b, n, hn] -> [s, b, n/N, hn] (chunks in rank order)
    sequence_to_heads   its inverse; each is the other's backward
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import communication


def cp_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Long [seq_length / cp_size]: the global positions CP rank `cp_rank` holds (chunks r and 2N-1-r)."""
    if cp_size == 1:
        return torch.arange(seq_length, device=device)
    if seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x --context-parallel-size "
                         f"({2 * cp_size}): the load-balanced split cuts it into 2N chunks")
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat((first, second))


def split_for_cp_rank(tensor: torch.Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's tokens of `tensor` along `seq_dim` (load-balanced chunks r and 2N-1-r)."""
    if cp_size == 1:
        return tensor
    index = cp_positions(tensor.shape[seq_dim], cp_size, cp_rank, device=tensor.device)
    return tensor.index_select(seq_dim, index)


def _ranks_of(group: Optional[dist.ProcessGroup]) -> list[int]:
    return dist.get_process_group_ranks(group)


class _RingShift(torch.autograd.Function):
    """x on every rank of the ring -> the previous rank's x; backward: the gradient to the previous rank.

    The forward only starts the exchange: the handle goes into `started` and the output may be
    read once it has been waited on (the caller computes on the current block meanwhile)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup, started: list) -> torch.Tensor:
        ctx.group = group
        ranks = _ranks_of(group)
        me = ranks.index(dist.get_rank())
        received = torch.empty_like(tensor)
        started.append(communication.ring_exchange_start(tensor, received, send_to=ranks[(me + 1) % len(ranks)],
                                                         recv_from=ranks[(me - 1) % len(ranks)], group=group))
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _shift(grad, ctx.group, step=-1), None, None


def _shift(tensor: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """Send `tensor` to the rank `step` places on in the group's ring, receive from `step` places back."""
    ranks = _ranks_of(group)
    me = ranks.index(dist.get_rank())
    received = torch.empty_like(tensor)
    communication.ring_exchange(tensor.contiguous(), received, send_to=ranks[(me + step) % len(ranks)],
                                recv_from=ranks[(me - step) % len(ranks)], group=group)
    return received


def ring_shift_start(tensor: torch.Tensor, group: dist.ProcessGroup):
    """Start receiving the previous ring rank's `tensor` (same shape on every rank), differentiable:
    (the output, a handle to wait() on before reading it; `tensor` must not change until then)."""
    started: list = []
    received = _RingShift.apply(tensor.contiguous(), group, started)
    return received, started[0]


def ring_shift(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The previous ring rank's `tensor`, differentiable (the blocking form of ring_shift_start)."""
    received, handle = ring_shift_start(tensor, group)
    handle.wait()
    return received


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        output = tensor.new_empty((size * tensor.shape[0],) + tuple(tensor.shape[1:]))
        return communication.all_gather_into_tensor(output, tensor.contiguous(), group=group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        output = grad.new_empty((grad.shape[0] // size,) + tuple(grad.shape[1:]))
        return communication.reduce_scatter_tensor(output, grad.contiguous(), group=ctx.group), None


def gather_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[s/N, ...] on each rank -> [s, ...]: the ranks' pieces along dim 0 in group rank order."""
    return _GatherSequence.apply(tensor, group)


def _heads_to_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    s, b, n, hn = tensor.shape
    # [s, b, N, n/N, hn] -> [N, s, b, n/N, hn]: head block j goes to rank j
    send = tensor.view(s, b, size, n // size, hn).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)  # [N, s, b, n/N, hn]: rank j's tokens of this rank's heads
    rows = [s * b * (n // size) * hn] * size
    communication.all_to_all_single(received.view(-1), send.view(-1), rows, rows, group=group)
    return received.view(size * s, b, n // size, hn)  # [N s, b, n/N, hn]


def _sequence_to_heads(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    s_all, b, n_local, hn = tensor.shape
    s = s_all // size
    send = tensor.contiguous()  # [N, s, b, n/N, hn]: chunk j goes back to rank j
    received = torch.empty_like(send)  # [N, s, b, n/N, hn]: head block j from rank j
    rows = [s * b * n_local * hn] * size
    communication.all_to_all_single(received.view(-1), send.view(-1), rows, rows, group=group)
    # [N, s, b, n/N, hn] -> [s, b, N, n/N, hn] -> [s, b, n, hn]
    return received.view(size, s, b, n_local, hn).permute(1, 2, 0, 3, 4).reshape(s, b, size * n_local, hn)


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _heads_to_sequence(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group), None


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _sequence_to_heads(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group), None


def heads_to_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Ulysses' all-to-all: [s/N, b, n, hn] -> [s, b, n/N, hn] (rank j's tokens j-th; this rank's n/N heads)."""
    if tensor.shape[2] % dist.get_world_size(group):
        raise ValueError(f"{tensor.shape[2]} heads do not split over the {dist.get_world_size(group)} ranks "
                         "of the all-to-all (--cp-comm-type a2a)")
    return _HeadsToSequence.apply(tensor, group)


def sequence_to_heads(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse all-to-all: [s, b, n/N, hn] -> [s/N, b, n, hn]."""
    return _SequenceToHeads.apply(tensor, group)


CP_EXCHANGE_KINDS = ("p2p", "allgather", "a2a")


def cp_exchange_bytes(kind: str, cp_size: int, layers: int, seq_length: int, micro_batch_size: int,
                      heads: int, groups: int, kv_channels: int, element_bytes: int = 4,
                      sent: bool = False) -> float:
    """Bytes one CP rank's attention exchanges move for `layers` layers and one micro-batch, forward
    and backward once each (heads, groups: this TP rank's query heads and K/V groups).

    By default in communication.py's counting convention (what count_communication records, which
    bench/context_parallel.py checks against the real exchanges):
        p2p        2 L (N-1) 2 (s/N) b ng hn e        the K/V pair sent N-1 times forward, its gradient back
        allgather  2 L 2 s b ng hn e                  the gathered K/V forward, its reduce-scatter back
        a2a        2 L (N-1)/N (s/N) b hn (2 np + 2 ng') e   q, k, v and the context each way
                   (ng' = ng, or np when N does not divide ng: K/V are repeated first)
    sent=True: what the rank itself puts on its links; for allgather a ring all-gather and
    reduce-scatter send (N-1)/N of the gathered tensor, the other two already count that.
    Recompute (selective or full) reruns the forward exchange in backward: 3/2 of this."""
    n = cp_size
    if n == 1:
        return 0.0
    s, b, hn, e = seq_length, micro_batch_size, kv_channels, element_bytes
    if kind == "p2p":
        return 2 * layers * (n - 1) * 2 * (s / n) * b * groups * hn * e
    if kind == "allgather":
        return 2 * layers * 2 * s * b * groups * hn * e * ((n - 1) / n if sent else 1)
    if kind == "a2a":
        kv = groups if groups % n == 0 else heads
        return 2 * layers * (n - 1) / n * (s / n) * b * hn * (2 * heads + 2 * kv) * e
    raise ValueError(f"cp_exchange_bytes: no formula for cp_comm_type {kind!r} (one of {', '.join(CP_EXCHANGE_KINDS)})")
