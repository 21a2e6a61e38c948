"""Small helpers of the training framework: rank-aware printing.

Every helper writes a whole line (text and newline) in one write call. Under torchrun all ranks
share the launcher's stdout and stderr; with PYTHONUNBUFFERED=1 `print(text)` makes two writes
(the text, then the newline), and another rank's line could land between them. A single write
of one line (well under PIPE_BUF, 4096 bytes) reaches a pipe whole.
"""

from __future__ import annotations

import datetime
import sys
from typing import Optional, TextIO

import torch.distributed as dist


def get_rank_safe() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size_safe() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_last_rank() -> bool:
    return get_rank_safe() == get_world_size_safe() - 1


def print_line(message: str, stream: Optional[TextIO] = None) -> None:
    """Write message and its newline to stream (stdout by default) in one write, flushed, on this rank."""
    stream = stream or sys.stdout
    stream.write(message + "\n")
    stream.flush()


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only."""
    if get_rank_safe() == 0:
        print_line(message)


def print_rank_last(message: str, stream: Optional[TextIO] = None) -> None:
    """Print on the last global rank (the one that holds the loss under pipeline parallelism)."""
    if is_last_rank():
        print_line(message, stream)


def print_datetime(string: str) -> None:
    """Megatron's '[string] datetime: YYYY-MM-DD HH:MM:SS' marker line."""
    print_rank_0(f"[{string}] datetime: {timestamp()} ")


def timestamp() -> str:
    """Local time as Megatron prints it in its log lines: 'YYYY-MM-DD HH:MM:SS'."""
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
