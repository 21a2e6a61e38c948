"""Model- and data-parallel state, with Megatron's `parallel_state.get_*` accessor names.

Today only the trivial layout exists: one process, or a world whose every rank is its own
model-parallel group (tensor = pipeline = expert = 1). The tensor/pipeline/data-parallel
groups in Megatron's `tp-cp-ep-dp-pp` rank order arrive with the parallelism issues; code
written against these accessors (checkpoint names, samplers, logging) does not change then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


@dataclass
class _State:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    initialized: bool = False


_STATE = _State()


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1) -> None:
    """Record the parallel layout. Only sizes of 1 are available so far."""
    sizes = {"tensor_model_parallel_size": tensor_model_parallel_size,
             "pipeline_model_parallel_size": pipeline_model_parallel_size,
             "expert_model_parallel_size": expert_model_parallel_size}
    unsupported = {name: size for name, size in sizes.items() if size != 1}
    if unsupported:
        raise ValueError(f"parallel sizes {unsupported} are not available yet; only 1 is supported")
    _STATE.tensor_model_parallel_size = tensor_model_parallel_size
    _STATE.pipeline_model_parallel_size = pipeline_model_parallel_size
    _STATE.expert_model_parallel_size = expert_model_parallel_size
    _STATE.initialized = True


def destroy_model_parallel() -> None:
    global _STATE
    _STATE = _State()


def model_parallel_is_initialized() -> bool:
    return _STATE.initialized


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def get_tensor_model_parallel_world_size() -> int:
    return _STATE.tensor_model_parallel_size


def get_tensor_model_parallel_rank() -> int:
    return 0


def get_pipeline_model_parallel_world_size() -> int:
    return _STATE.pipeline_model_parallel_size


def get_pipeline_model_parallel_rank() -> int:
    return 0


def get_expert_model_parallel_world_size() -> int:
    return _STATE.expert_model_parallel_size


def get_expert_model_parallel_rank() -> int:
    return 0


def get_data_parallel_world_size() -> int:
    return _world()[1]


def get_data_parallel_rank() -> int:
    return _world()[0]


def get_data_parallel_group() -> Optional[dist.ProcessGroup]:
    """The data-parallel group: the whole world while every rank is its own model replica."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def get_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """None: with tensor = pipeline = 1 each rank is a model-parallel group of one."""
    return None


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1
