"""--exit-signal-handler: remember a SIGTERM so the training loop can save and exit cleanly.

The handler only sets a flag; the loop polls signals_received() once per iteration, where
all ranks agree (an all-reduce) so that they save the same checkpoint together.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import communication


class DistributedSignalHandler:
    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = sig
        self._received = False
        self._previous = None

    def __enter__(self) -> "DistributedSignalHandler":
        self._received = False
        self._previous = signal.getsignal(self.sig)

        def handler(signum: int, frame: Optional[FrameType]) -> None:
            self._received = True

        signal.signal(self.sig, handler)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(self.sig, self._previous if self._previous is not None else signal.SIG_DFL)

    def signals_received(self) -> bool:
        """True when any rank has received the signal."""
        flag = torch.tensor([1 if self._received else 0], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized():
            communication.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
