"""Named wall-clock timers, as Megatron's `timers('name', log_level=0).start()/.stop()`.

A timer accumulates the time between start() and stop() calls; elapsed(reset=True) returns the
total in seconds and starts again from zero. Accelerator work is synchronised before each
reading (a no-op on CPU), so GPU timings are honest. Timers whose log_level is above
--timing-log-level are free no-ops.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

from megatron.core import device


class _Timer:
    def __init__(self, name: str) -> None:
        self.name = name
        self._elapsed = 0.0
        self._started: Optional[float] = None

    def start(self, barrier: bool = False) -> None:
        if self._started is not None:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        device.synchronize()
        self._started = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        if self._started is None:
            raise RuntimeError(f"timer {self.name!r} is not started")
        device.synchronize()
        self._elapsed += time.perf_counter() - self._started
        self._started = None

    def reset(self) -> None:
        self._elapsed = 0.0
        self._started = None

    @property
    def running(self) -> bool:
        return self._started is not None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated so far (including a running interval)."""
        running = self._started is not None
        if running:
            self.stop()
        total = self._elapsed
        if reset:
            self._elapsed = 0.0
        if running:
            self.start()
        return total


class _NullTimer:
    running = False

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def reset(self) -> None:
        pass

    def elapsed(self, reset: bool = True) -> float:
        return 0.0


class Timers:
    """A registry of timers; timers(name, log_level) returns (and creates) one."""

    def __init__(self, log_level: int = 0) -> None:
        self._log_level = log_level
        self._timers: Dict[str, _Timer] = {}
        self._null = _NullTimer()

    def __call__(self, name: str, log_level: int = 0):
        if log_level > self._log_level:
            return self._null
        if name not in self._timers:
            self._timers[name] = _Timer(name)
        return self._timers[name]
