"""--exit-signal-handler: remember a SIGTERM so the training loop can save and exit cleanly.

The handler only sets a flag; the loop polls signals_received() once per iteration, where
all ranks agree (an all-reduce) so that they save the same checkpoint together. A scheduler
signals every process of the job: the DataLoader workers ignore SIGTERM under this flag
(megatron/data/data_samplers.py), and torchrun forwards its own SIGTERM to each training
process, then waits for it (docs/training.md, Exits).
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import communication, device


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
        # on the device: NCCL reduces accelerator tensors only
        flag = torch.tensor([1 if self._received else 0], dtype=torch.int32, device=device.get_device())
        if dist.is_available() and dist.is_initialized():
            communication.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
