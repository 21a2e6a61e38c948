"""torch_dist: names, constants and the rank helpers shared by its modules.

See megatron/dist_checkpointing/__init__.py for the layout and the rules.
"""

from __future__ import annotations

import os
from typing import Tuple

import torch.distributed as dist

from megatron.core.utils import print_line

FORMAT = "torch_dist"
METADATA_JSON = "metadata.json"
COMMON_FILE = "common.pt"
DCP_METADATA = ".metadata"
LAYOUT_VERSION = 1
CHECKPOINT_VERSION = 3.0
_CONTENT_FORMAT = "megatron-torch-dist"
_TRACKER_NAME = "latest_checkpointed_iteration.txt"
# Test hook: "ITERATION:PATH" makes the async writer of that iteration create PATH after writing
# its files and then wait (up to 10 minutes), so a test can kill the run mid-save deterministically.
HOLD_ENV = "MEGATRON_TEST_ASYNC_SAVE_HOLD"

Offsets = Tuple[int, ...]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _print_rank_0(message: str) -> None:
    if _rank() == 0:
        print_line(message)


def partial_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, ".iter_{:07d}.partial".format(iteration))


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, "iter_{:07d}".format(iteration))
