"""Hang watchdog: a deadline around every collective and pipeline exchange.

A rank that waits in a collective (megatron/core/communication.py) or a pipeline send/receive
(p2p_communication.py) longer than the deadline prints one line to stderr and exits non-zero,
so torchrun tears the job down instead of letting it hang until the process-group timeout:

    rank 0: stuck for 5 s in all_reduce on group tp [0, 1] (micro-batch 3 of 8, iteration 5);
    waiting for ranks [1] of the group (--watchdog-seconds 5)

Every rank that is stuck prints its own line, so together they say who waits on whom; a rank
that never reaches the operation (computing, or itself stalled) prints nothing, which is how the
laggard shows up. How it works: the wrappers enter `watch(op, group, peer)`, which records the
pending operation; a daemon thread started by `start()` looks at it every fraction of a second
(gloo and NCCL waits release the GIL) and past the deadline reports and calls os._exit. Off
(start() not called) a watch costs one check. The schedules tell the watchdog which micro-batch
they are on (note_schedule / note_step), which the line names.

Fault injection for tests, read here only: MEGATRON_TEST_STALL="rank=1,op=all_reduce,group=tp,after=3"
makes global rank 1 sleep (seconds=600 unless given) before its 3rd all_reduce on group tp. op
matches a communication name (all_reduce, all_gather, reduce_scatter, broadcast, all_to_all), a
pipeline exchange (recv_forward, send_forward_recv_backward, ...) or "p2p" for any of those;
group is optional.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

import torch.distributed as dist

from megatron.core import parallel_state

EXIT_CODE = 124  # what timeout(1) returns for a command that ran past its deadline
STALL_ENV = "MEGATRON_TEST_STALL"
P2P_OPS = ("recv_forward", "recv_backward", "send_forward", "send_backward", "send_forward_recv_backward",
           "send_backward_recv_forward", "send_forward_recv_forward", "send_backward_recv_backward",
           "send_forward_backward_recv_forward_backward")


@dataclass(frozen=True)
class Pending:
    """The operation this rank waits in."""

    op: str
    group: str                 # parallel_state.group_name
    ranks: List[int]           # the group's global ranks
    waiting_for: str           # the peer (p2p) or the rest of the group
    position: str              # where the schedule is: "micro-batch 3 of 8, iteration 5"
    started: float             # time.monotonic()


@dataclass
class _Schedule:
    """What the pipeline schedule last told us."""

    iteration: Optional[int] = None    # 1-based, like the log line; None: not training yet
    evaluating: bool = False
    num_microbatches: Optional[int] = None
    microbatch: Optional[int] = None   # None: outside the micro-batch loop (gradient reduction, optimizer)
    virtual_stage: Optional[int] = None

    def describe(self, microbatch: Optional[int] = None, virtual_stage: Optional[int] = None) -> str:
        microbatch = self.microbatch if microbatch is None else microbatch
        virtual_stage = self.virtual_stage if virtual_stage is None else virtual_stage
        parts = []
        if self.num_microbatches is not None:
            if microbatch is not None:
                parts.append(f"micro-batch {microbatch} of {self.num_microbatches}")
            else:
                parts.append("after the micro-batches")
            if virtual_stage:
                parts.append(f"model chunk {virtual_stage}")
        if self.evaluating:
            parts.append("evaluation")
        elif self.iteration is not None:
            parts.append(f"iteration {self.iteration}")
        return ", ".join(parts)


@dataclass
class _Stall:
    rank: int
    op: str
    group: Optional[str]
    after: int
    seconds: float
    seen: int = 0


_seconds: Optional[float] = None
_pending: Optional[Pending] = None
_schedule = _Schedule()
_first_iteration: Optional[Callable[[], int]] = None
_thread: Optional[threading.Thread] = None
_stall: Optional[_Stall] = None


# ------------------------------------------------------------------------------ set-up

def start(seconds: Optional[float], first_iteration: Optional[Callable[[], int]] = None) -> None:
    """Fail any collective or pipeline exchange pending after `seconds` (None: no deadline).

    first_iteration() gives the iterations done before this run (a resumed checkpoint's), read at
    the first training step so the line's iteration matches the log's. Idempotent: a second call
    changes the deadline. Only a distributed run has something to wait on; in one process it is off.
    """
    global _seconds, _first_iteration, _thread, _stall
    _stall = _parse_stall(os.environ.get(STALL_ENV))
    if seconds is not None and seconds <= 0:
        raise ValueError(f"--watchdog-seconds must be positive, got {seconds}")
    if seconds is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        _seconds = None
        return
    _seconds, _first_iteration = float(seconds), first_iteration
    # The pipeline exchange has a deadline of its own (raising PipelineTimeoutError); it waits at
    # least until ours has spoken (p2p_communication reads deadline() and grace_seconds()).
    if _thread is None:
        _thread = threading.Thread(target=_monitor, name="megatron-watchdog", daemon=True)
        _thread.start()


def stop() -> None:
    """No deadline any more (the thread stays, idle)."""
    global _seconds
    _seconds = None


def deadline() -> Optional[float]:
    return _seconds


def grace_seconds() -> float:
    """How long after the deadline the watchdog may take to report (and end) a stuck rank."""
    return max(2.0, 0.5 * (_seconds or 0.0))



def _poll_interval() -> float:
    return min(0.25, (_seconds or 1.0) / 20)


# ------------------------------------------------------------------------------ what the schedules say

def note_schedule(num_microbatches: int, forward_only: bool) -> None:
    """A schedule starts over num_microbatches micro-batches (forward_only: evaluation)."""
    if not forward_only:
        if _schedule.iteration is None:
            _schedule.iteration = (_first_iteration() if _first_iteration is not None else 0) or 0
        _schedule.iteration += 1
    _schedule.evaluating = forward_only
    _schedule.num_microbatches = num_microbatches
    _schedule.microbatch = None
    _schedule.virtual_stage = None


def note_step(microbatch: Optional[int], virtual_stage: Optional[int] = None) -> None:
    """The schedule runs a forward or backward step of `microbatch` (None: the loop is over)."""
    _schedule.microbatch = microbatch
    _schedule.virtual_stage = virtual_stage


# ------------------------------------------------------------------------------ the watch

@contextlib.contextmanager
def watch(op: str, group: Optional[dist.ProcessGroup] = None, peer: Optional[str] = None,
          microbatch: Optional[int] = None, virtual_stage: Optional[int] = None) -> Iterator[None]:
    """Wrap one blocking wait: `op` on `group`; peer names what a p2p exchange waits for
    (default: the rest of the group); microbatch/virtual_stage override the schedule's."""
    global _pending
    if _stall is not None:
        _maybe_stall(op, parallel_state.group_name(group))
    if _seconds is None:
        yield
        return
    ranks = _ranks(group)
    if peer is None:
        others = [r for r in ranks if r != dist.get_rank()]
        peer = f"ranks {others} of the group" if others else "nothing (a group of one)"
    previous = _pending
    _pending = Pending(op, parallel_state.group_name(group), ranks, peer,
                       _schedule.describe(microbatch, virtual_stage), time.monotonic())
    try:
        yield
    finally:
        _pending = previous


class WatchedWork:
    """An async collective's handle whose wait() is watched (what communication returns for async_op)."""

    def __init__(self, work: dist.Work, op: str, group: Optional[dist.ProcessGroup]) -> None:
        self._work, self._op, self._group = work, op, group

    def wait(self, *args, **kwargs):
        with watch(self._op, self._group):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def watched_work(work, op: str, group: Optional[dist.ProcessGroup]):
    """work itself when the watchdog is off, else a WatchedWork around it."""
    return work if _seconds is None or work is None else WatchedWork(work, op, group)


def _ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


# ------------------------------------------------------------------------------ expiry

def describe(pending: Pending, now: float) -> str:
    """The line a stuck rank prints."""
    where = f" ({pending.position})" if pending.position else ""
    return (f"rank {dist.get_rank()}: stuck for {now - pending.started:.0f} s in {pending.op} on group "
            f"{pending.group} {pending.ranks}{where}; waiting for {pending.waiting_for} "
            f"(--watchdog-seconds {_seconds:g})")


def _monitor() -> None:
    while True:
        time.sleep(_poll_interval())
        pending, seconds = _pending, _seconds
        if pending is None or seconds is None:
            continue
        now = time.monotonic()
        if now - pending.started > seconds:
            _expire(describe(pending, now))


def _expire(line: str) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_CODE)  # the main thread is inside a C++ wait: only a hard exit ends it


# ------------------------------------------------------------------------------ fault injection (tests)

def _parse_stall(spec: Optional[str]) -> Optional[_Stall]:
    if not spec:
        return None
    fields = dict(part.split("=", 1) for part in spec.split(",") if part.strip())
    unknown = set(fields) - {"rank", "op", "group", "after", "seconds"}
    if unknown or "rank" not in fields or "op" not in fields:
        raise ValueError(f"{STALL_ENV}={spec!r}: expected rank=R,op=NAME[,group=G][,after=N][,seconds=S]")
    return _Stall(int(fields["rank"]), fields["op"], fields.get("group"), int(fields.get("after", 1)),
                  float(fields.get("seconds", 600)))


def _maybe_stall(op: str, group: str) -> None:
    stall = _stall
    if not dist.is_initialized() or dist.get_rank() != stall.rank:
        return
    if stall.op != op and not (stall.op == "p2p" and op in P2P_OPS):
        return
    if stall.group is not None and stall.group != group:
        return
    stall.seen += 1
    if stall.seen == stall.after:
        sys.stderr.write(f"rank {stall.rank}: {STALL_ENV}: sleeping {stall.seconds:g} s before {op} #{stall.after} "
                         f"on group {group}\n")
        sys.stderr.flush()
        time.sleep(stall.seconds)
