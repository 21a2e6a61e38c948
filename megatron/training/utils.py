"""Small helpers of the training framework, under Megatron-LM's megatron.training.utils names.

The rank-aware print helpers live in megatron.core.utils (the lower layers print through them
too, and never import this package); they are imported here under the names Megatron's scripts
import from megatron.training.utils.
"""

from __future__ import annotations

import datetime

from megatron.core.utils import (  # noqa: F401  (Megatron's megatron.training.utils names)
    get_rank_safe,
    get_world_size_safe,
    is_last_rank,
    print_line,
    print_rank_0,
    print_rank_last,
)


def print_datetime(string: str) -> None:
    """Megatron's '[string] datetime: YYYY-MM-DD HH:MM:SS' marker line."""
    print_rank_0(f"[{string}] datetime: {timestamp()} ")


def timestamp() -> str:
    """Local time as Megatron prints it in its log lines: 'YYYY-MM-DD HH:MM:SS'."""
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
