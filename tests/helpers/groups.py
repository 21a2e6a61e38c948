"""Explicit data-parallel groups inside the 4-rank DistributedPool (sizes other than the pool's world / tp)."""

import torch.distributed as dist

from megatron.core import parallel_state

WORLD = 4


def dp_group(d: int, created: list):
    """This rank's data-parallel group of size d (tp = 1: the pool's 4 ranks cut into 4 / d groups)."""
    if d == parallel_state.get_data_parallel_world_size():
        return parallel_state.get_data_parallel_group()
    mine = None
    for start in range(0, WORLD, d):  # new_group is collective: every rank creates every group
        group = dist.new_group(list(range(start, start + d)))
        created.append(group)
        if start <= dist.get_rank() < start + d:
            mine = group
    return mine


def destroy_groups(created: list) -> None:
    for group in created:
        dist.destroy_process_group(group)
