"""The one door every collective goes through, with an optional counter of what went through it.

Tensor-parallel layers, gradient reduction and data broadcasting call these wrappers rather
than `torch.distributed` directly, so a test (or `--log-communication-stats`) can see exactly
which collectives ran, on which group, and how many bytes they moved:

    with count_communication() as counter:
        loss = model(batch); loss.backward()
    counter.summary()   # {("all_reduce", "tp"): (4, 65536), ...}

Sizes are those of the FULL tensor of the collective (all_reduce / broadcast: the tensor;
all_gather: the gathered output; reduce_scatter: the input before scattering), so a count is
independent of the group size. Counting is off by default and costs one bool check per call.
Each call also runs under the hang watchdog's deadline (watchdog.py; off unless started).
Only dim-0 collectives exist here: a gather along another dim is a gather of a transposed copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state, watchdog

SUM = dist.ReduceOp.SUM

# Recent torch deprecates all_gather_into_tensor / reduce_scatter_tensor for the *_single names
# (same arguments); older builds only have the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CommEvent:
    """One collective call: op name, group name (parallel_state.group_name), full-tensor size."""

    op: str
    group: str
    numel: int
    nbytes: int


class CommCounter:
    """Records the collectives issued while it is active, in call order."""

    def __init__(self) -> None:
        self.events: list[CommEvent] = []

    def record(self, event: CommEvent) -> None:
        self.events.append(event)

    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        """{(op, group): (calls, total nbytes)}, keys in first-seen order."""
        totals: dict[tuple[str, str], tuple[int, int]] = {}
        for event in self.events:
            calls, nbytes = totals.get((event.op, event.group), (0, 0))
            totals[(event.op, event.group)] = (calls + 1, nbytes + event.nbytes)
        return totals

    def reset(self) -> None:
        self.events.clear()


# Counters currently recording (innermost last); the global one is among them while enabled.
_ACTIVE: list[CommCounter] = []
_GLOBAL_COUNTER = CommCounter()


@contextlib.contextmanager
def count_communication() -> Iterator[CommCounter]:
    """Count the collectives issued inside the block; nested blocks each see their own calls
    (and an outer counter sees the inner block's calls too)."""
    counter = CommCounter()
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)


def set_counting(enabled: bool) -> None:
    """Switch the process-wide counter (`get_global_counter()`) on or off."""
    if enabled and _GLOBAL_COUNTER not in _ACTIVE:
        _ACTIVE.insert(0, _GLOBAL_COUNTER)
    elif not enabled and _GLOBAL_COUNTER in _ACTIVE:
        _ACTIVE.remove(_GLOBAL_COUNTER)


def get_global_counter() -> CommCounter:
    """The counter that `set_counting(True)` feeds (for `--log-communication-stats`)."""
    return _GLOBAL_COUNTER


def record(op: str, group: dist.ProcessGroup | None, tensor: torch.Tensor) -> None:
    """Count one operation on `tensor` in every active counter (the wrappers below and p2p traffic call this)."""
    if not _ACTIVE:
        return
    event = CommEvent(op, parallel_state.group_name(group), tensor.numel(), tensor.numel() * tensor.element_size())
    for counter in _ACTIVE:
        counter.record(event)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: dist.ReduceOp = SUM,
               async_op: bool = False) -> Any:
    """Reduce `tensor` in place over `group` (None: the world); returns it (async_op: the Work to wait on)."""
    record("all_reduce", group, tensor)
    with watchdog.watch("all_reduce", group):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return watchdog.watched_work(work, "all_reduce", group) if async_op else tensor


def all_gather_into_tensor(
    output: torch.Tensor, input_: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Any:
    """output [t * n, ...] = the ranks' input_ [n, ...] concatenated along dim 0 in rank order.

    Returns output (async_op: the Work to wait on). input_ may be a view of output.
    """
    record("all_gather", group, output)
    with watchdog.watch("all_gather", group):
        work = _all_gather_single(output, input_, group=group, async_op=async_op)
    return watchdog.watched_work(work, "all_gather", group) if async_op else output


def reduce_scatter_tensor(
    output: torch.Tensor,
    input_: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp = SUM,
    async_op: bool = False,
) -> Any:
    """output [n, ...] = this rank's dim-0 chunk of the sum over ranks of input_ [t * n, ...].

    Returns output (async_op: the Work to wait on). output may be a view of input_.
    """
    record("reduce_scatter", group, input_)
    with watchdog.watch("reduce_scatter", group):
        work = _reduce_scatter_single(output, input_, op=op, group=group, async_op=async_op)
    return watchdog.watched_work(work, "reduce_scatter", group) if async_op else output


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Overwrite `tensor` with global rank `src`'s copy on every rank of `group`; returns it."""
    record("broadcast", group, tensor)
    with watchdog.watch("broadcast", group):
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def all_to_all_single(output: torch.Tensor, input_: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Rank r sends rows [sum(in[:j]), sum(in[:j+1])) of input_ to rank j of `group` and receives rank j's
    rows for it into output's j-th chunk (dim 0, split sizes per rank); returns output.

    Counted as what leaves this rank: the rows sent to the other ranks (the own chunk stays put), so
    a dispatcher's count is exactly the tokens it routes off-rank.
    """
    if _ACTIVE:
        own = dist.get_rank(group) if group is not None else dist.get_rank()
        row = input_[0].numel() if input_.dim() > 1 else 1
        numel = (sum(input_split_sizes) - input_split_sizes[own]) * row
        event = CommEvent("all_to_all", parallel_state.group_name(group), numel, numel * input_.element_size())
        for counter in _ACTIVE:
            counter.record(event)
    with watchdog.watch("all_to_all", group):
        dist.all_to_all_single(output, input_, output_split_sizes, input_split_sizes, group=group)
    return output


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor,
               group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """outputs[j] = rank j's `tensor` (list form: the pieces may differ in shape); returns outputs."""
    if _ACTIVE:
        numel = sum(piece.numel() for piece in outputs)
        _record_event("all_gather", group, numel, numel * tensor.element_size())
    with watchdog.watch("all_gather", group):
        dist.all_gather(outputs, tensor, group=group)
    return outputs


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int,
           group: dist.ProcessGroup | None = None) -> None:
    """Global rank `dst` receives every rank's `tensor` into gather_list (None on the other ranks)."""
    record("gather", group, tensor)
    with watchdog.watch("gather", group):
        dist.gather(tensor, gather_list, dst=dst, group=group)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int,
            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Rank j of `group` receives scatter_list[j] of global rank `src` into `tensor`; returns it."""
    record("scatter", group, tensor)
    with watchdog.watch("scatter", group):
        dist.scatter(tensor, scatter_list, src=src, group=group)
    return tensor


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Blocking send of `tensor` to global rank `dst`."""
    record("p2p_send", group, tensor)
    with watchdog.watch("p2p", group, peer=f"rank {dst} to receive"):
        dist.send(tensor, dst, group=group)


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Blocking receive into `tensor` from global rank `src`; returns it."""
    record("p2p_recv", group, tensor)
    with watchdog.watch("p2p", group, peer=f"rank {src} to send"):
        dist.recv(tensor, src, group=group)
    return tensor


def batch_isend_irecv(ops: list[dist.P2POp]) -> list[Any]:
    """Issue point-to-point operations together (counted one by one); returns their requests.

    The wait is the caller's (p2p_communication waits under its own deadline and the watchdog)."""
    for op in ops:
        record("p2p_" + ("send" if op.op is dist.isend else "recv"), op.group, op.tensor)
    return dist.batch_isend_irecv(ops)


class RingExchange:
    """A started ring exchange (ring_exchange_start); wait() blocks until both halves are done."""

    def __init__(self, requests: list, group: dist.ProcessGroup | None, send_to: int, recv_from: int) -> None:
        self._requests, self._group, self._peers = requests, group, (send_to, recv_from)

    def wait(self) -> None:
        send_to, recv_from = self._peers
        with watchdog.watch("cp_ring", self._group, peer=f"rank {recv_from} to send, rank {send_to} to receive"):
            for request in self._requests:
                request.wait()
        self._requests = []


def ring_exchange_start(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, send_to: int, recv_from: int,
                        group: dist.ProcessGroup | None = None) -> RingExchange:
    """Start sending `send_tensor` to global rank `send_to` and receiving `recv_tensor` from `recv_from`
    (context parallelism's ring: keys and values forward, their gradients back); the caller computes
    meanwhile and waits on the returned handle before reading recv_tensor or writing send_tensor.

    Counted as one "cp_ring" send of the tensor; the watchdog names the exchange and both peers."""
    record("cp_ring", group, send_tensor)
    ops = [dist.P2POp(dist.isend, send_tensor, send_to, group), dist.P2POp(dist.irecv, recv_tensor, recv_from, group)]
    return RingExchange(dist.batch_isend_irecv(ops), group, send_to, recv_from)


def ring_exchange(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, send_to: int, recv_from: int,
                  group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """ring_exchange_start and wait: the blocking exchange; returns recv_tensor."""
    ring_exchange_start(send_tensor, recv_tensor, send_to, recv_from, group).wait()
    return recv_tensor


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of `group` is here (counted as a call that moves no bytes)."""
    _record_event("barrier", group, 0, 0)
    with watchdog.watch("barrier", group):
        dist.barrier(group=group)


# Object collectives pickle Python values: they are counted as calls, without a size (the pickles'
# sizes are only known inside torch.distributed).

def all_gather_object(outputs: list[Any], obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """outputs[j] = rank j's `obj`; returns outputs."""
    _record_event("all_gather_object", group, 0, 0)
    with watchdog.watch("all_gather_object", group):
        dist.all_gather_object(outputs, obj, group=group)
    return outputs


def broadcast_object_list(objects: list[Any], src: int, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `objects` become global rank `src`'s (same length everywhere); returns them."""
    _record_event("broadcast_object", group, 0, 0)
    with watchdog.watch("broadcast_object", group):
        dist.broadcast_object_list(objects, src=src, group=group)
    return objects


def scatter_object_list(output: list[Any], inputs: list[Any] | None, src: int,
                        group: dist.ProcessGroup | None = None) -> Any:
    """output[0] = inputs[j] of global rank `src` on rank j of `group`; returns output[0]."""
    _record_event("scatter_object", group, 0, 0)
    with watchdog.watch("scatter_object", group):
        dist.scatter_object_list(output, inputs, src=src, group=group)
    return output[0]


def _record_event(op: str, group: dist.ProcessGroup | None, numel: int, nbytes: int) -> None:
    if not _ACTIVE:
        return
    event = CommEvent(op, parallel_state.group_name(group), numel, nbytes)
    for counter in _ACTIVE:
        counter.record(event)
