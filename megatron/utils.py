"""Small helpers of the training framework: rank-aware printing."""

from __future__ import annotations

import datetime

import torch.distributed as dist


def get_rank_safe() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size_safe() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_last_rank() -> bool:
    return get_rank_safe() == get_world_size_safe() - 1


def _print_line(message: str) -> None:
    # One write per line: unbuffered stdout would write the text and the newline separately,
    # and another rank's line could land between them.
    print(message + "\n", end="", flush=True)


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only."""
    if get_rank_safe() == 0:
        _print_line(message)


def print_rank_last(message: str) -> None:
    """Print on the last global rank (the one that holds the loss under pipeline parallelism)."""
    if is_last_rank():
        _print_line(message)


def print_datetime(string: str) -> None:
    """Megatron's '[string] datetime: YYYY-MM-DD HH:MM:SS' marker line."""
    time_str = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    print_rank_0(f"[{string}] datetime: {time_str} ")
