"""A schedule tracer: what each rank's pipeline schedule did, in order, and when.

Off by default (one branch per step when off). Turned on, the schedules record one Event per
forward or backward step of a micro-batch on a model chunk, with wall-clock start and end,
and keep count of the micro-batches in flight (forwarded, not yet back-propagated) on this
rank, the quantity that bounds activation memory: at most PP on the first stage under 1F1B.

    with tracing() as trace:
        forward_backward(...)
    trace.events          # [Event("F", 0, 0, t0, t1), Event("F", 1, 0, ...), ...]
    trace.order()         # [("F", 0, 0), ("F", 1, 0), ..., ("B", 7, 0)]
    trace.max_in_flight   # the most micro-batches held at once
    trace.bubble_fraction()

bench/pipeline_bubble.py gathers these from every rank and compares the measured bubble with
the theory.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple


@dataclass(frozen=True)
class Event:
    kind: str            # "F" forward, "B" backward
    microbatch: int      # 0-based index within the global batch
    virtual_stage: int   # model chunk of this rank (0 without interleaving)
    start: float         # time.perf_counter() seconds
    end: float


@dataclass
class Trace:
    events: List[Event] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def order(self) -> List[Tuple[str, int, int]]:
        """The (kind, micro-batch, virtual stage) sequence, without times."""
        return [(e.kind, e.microbatch, e.virtual_stage) for e in self.events]

    def busy_seconds(self) -> float:
        return sum(e.end - e.start for e in self.events)

    def span(self) -> Tuple[float, float]:
        return (min(e.start for e in self.events), max(e.end for e in self.events))

    def bubble_fraction(self, start: Optional[float] = None, end: Optional[float] = None) -> float:
        """Idle time over busy time on this rank between start and end (default: its own span).

        The theory's (p-1)/m is bubble time over ideal compute time, the same ratio.
        """
        first, last = self.span()
        start = first if start is None else start
        end = last if end is None else end
        busy = self.busy_seconds()
        return (end - start - busy) / busy


_active: Optional[Trace] = None


@contextlib.contextmanager
def tracing() -> Iterator[Trace]:
    """Record the schedules' steps on this rank while the block runs."""
    global _active
    previous, _active = _active, Trace()
    try:
        yield _active
    finally:
        _active = previous


def is_tracing() -> bool:
    return _active is not None


@contextlib.contextmanager
def step(kind: str, microbatch: int, virtual_stage: int) -> Iterator[None]:
    """Wrap one forward ("F") or backward ("B") step of the schedule."""
    trace = _active
    if trace is None:
        yield
        return
    if kind == "F":
        trace.in_flight += 1
        trace.max_in_flight = max(trace.max_in_flight, trace.in_flight)
    start = time.perf_counter()
    yield
    trace.events.append(Event(kind, microbatch, virtual_stage, start, time.perf_counter()))
    if kind == "B":
        trace.in_flight -= 1


def forward_only_done(count: int = 1) -> None:
    """A forward-only step keeps nothing for backward: it leaves the in-flight count."""
    if _active is not None:
        _active.in_flight -= count
