"""Where a tensor-parallel rank's slice of a parameter sits in the whole (serial) parameter.

A split parameter carries the attributes the layers set (layers.py); they name one of three
layouts of its partition dim (d = partition_dim, n = the local size along d, t ranks):

    layout       attributes                          rank r holds, along d
    contiguous   partition_stride 1                  [r n, (r + 1) n)
    strided      partition_stride k > 1              blocks r, r + t, ..., r + (k - 1) t of the
                                                     whole cut into t k blocks of n / k (SwiGLU's
                                                     linear_fc1, k = 2: [gate_r ; up_r])
    rows         partition_rows (d = 0), a list      exactly those rows, in that order; rows
                                                     listed by several ranks are replicas (the
                                                     K/V rows of multi-query attention under TP)

A parameter without tensor_model_parallel (or with it False) is replicated: every rank holds it
whole. gather_tensor_parallel rebuilds the whole tensor over the TP group (gradients, weights);
merge_shards does the same from shards held in one process (a checkpoint converter merging
TP files), shard_for_rank cuts rank r's slice out of a whole tensor (its inverse).
Both read the attributes from a parameter or from a plain mapping of the same names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import communication, parallel_state
from megatron.core.tensor_parallel.utils import divide


def _attribute(attrs: Any, name: str, default: Any = None) -> Any:
    if isinstance(attrs, Mapping):
        return attrs.get(name, default)
    return getattr(attrs, name, default)


def is_tensor_parallel(attrs: Any) -> bool:
    """Whether the parameter (or attribute mapping) is split over the TP ranks."""
    return bool(_attribute(attrs, "tensor_model_parallel", False))


def strided_partition_indices(local_size: int, tp: int, rank: int, stride: int = 1) -> list[int]:
    """Global indices, in local order, of rank `rank`'s local_size entries along a partition dim
    cut into tp * stride equal blocks dealt round-robin (stride 1: one contiguous range)."""
    block = divide(local_size, stride)
    return [(rank + b * tp) * block + w for b in range(stride) for w in range(block)]


def partition_indices(attrs: Any, local_size: int, tp: int, rank: int) -> list[int]:
    """Global indices along partition_dim of the local entries of rank `rank` (see the table)."""
    rows = _attribute(attrs, "partition_rows")
    if rows is not None:
        if _attribute(attrs, "partition_dim", 0) != 0:
            raise ValueError("partition_rows needs partition_dim 0")
        if len(rows) != local_size:
            raise ValueError(f"partition_rows lists {len(rows)} rows, the local tensor has {local_size}")
        return [int(row) for row in rows]  # plain ints (a tensor of rows gives 0-d tensors: unhashable offsets)
    return strided_partition_indices(local_size, tp, rank, int(_attribute(attrs, "partition_stride", 1)))


def shard_for_rank(full: torch.Tensor, attrs: Any, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice (of tp) of the whole tensor `full` in the layout `attrs` names.

    attrs: a parameter, or a mapping with tensor_model_parallel, partition_dim, partition_stride
    and, for the rows layout, partition_rows -- the rows of *this* rank (e.g. from
    megatron.model.attention.qkv_partition_rows). A replicated tensor is returned as it is.
    """
    if not is_tensor_parallel(attrs) or tp == 1:
        return full
    dim = int(_attribute(attrs, "partition_dim"))
    rows = _attribute(attrs, "partition_rows")
    local_size = len(rows) if rows is not None else divide(full.shape[dim], tp)
    index = torch.tensor(partition_indices(attrs, local_size, tp, rank), dtype=torch.long, device=full.device)
    return full.index_select(dim, index)


def gather_tensor_parallel(param: Any, local_tensor: torch.Tensor,
                           group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The whole tensor from every TP rank's `local_tensor` (param's slice: a weight or its gradient).

    Collective over `group` (default: parallel_state's tensor-parallel group). Replicated tensors
    come back as they are. In the rows layout each rank's partition_rows is gathered too, and
    rows held by several ranks must be equal on all of them (ValueError otherwise: e.g. a
    replicated K/V gradient that was not summed over its replicas).
    """
    if not is_tensor_parallel(param):
        return local_tensor
    if group is None:
        group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    if tp == 1:
        return local_tensor
    local = local_tensor.contiguous()
    pieces = [torch.empty_like(local) for _ in range(tp)]
    communication.all_gather(pieces, local, group=group)  # tp x the local slice
    attrs = [param] * tp
    if _attribute(param, "partition_rows") is not None:
        own = torch.tensor(list(_attribute(param, "partition_rows")), dtype=torch.long)
        rows = [torch.empty_like(own) for _ in range(tp)]
        communication.all_gather(rows, own, group=group)  # every rank's rows, [n] x tp
        attrs = [{"tensor_model_parallel": True, "partition_dim": 0, "partition_rows": r.tolist()} for r in rows]
    return merge_shards(pieces, attrs)


def merge_shards(shards: Sequence[torch.Tensor], attrs: Sequence[Any]) -> torch.Tensor:
    """The whole tensor from every rank's slice: shards[r] of rank r, in the layout attrs[r] names
    (one parameter or mapping per rank: their partition_rows differ in the rows layout).

    Each entry is written at its global index; entries held by several ranks must be equal
    (ValueError otherwise, as when no rank holds some index). A replicated tensor: shards[0].
    """
    if not is_tensor_parallel(attrs[0]):
        return shards[0]
    tp, dim = len(shards), int(_attribute(attrs[0], "partition_dim"))
    indices = [partition_indices(a, s.shape[dim], tp, r) for r, (s, a) in enumerate(zip(shards, attrs))]
    size = max(max(ix) for ix in indices) + 1
    shape = list(shards[0].shape)
    shape[dim] = size
    full = shards[0].new_zeros(shape)
    written = torch.zeros(size, dtype=torch.bool)
    for rank, (piece, ix) in enumerate(zip(shards, indices)):
        index = torch.tensor(ix, dtype=torch.long)
        seen = written[index]  # [n] local entries some earlier rank wrote already
        if seen.any():
            old = full.index_select(dim, index[seen].to(full.device))
            new = piece.index_select(dim, seen.nonzero().flatten().to(piece.device))
            if not torch.equal(old, new):
                raise ValueError(f"rank {rank}'s copy of the replicated indices {index[seen].tolist()[:8]} along "
                                 f"dim {dim} differs from another rank's (max difference "
                                 f"{(old - new).abs().max().item():.3g})")
        full.index_copy_(dim, index.to(full.device), piece)
        written[index] = True
    if not written.all():
        missing = (~written).nonzero().flatten().tolist()
        raise ValueError(f"no rank holds the indices {missing[:8]} along dim {dim}")
    return full


def without_duplicate_rows(param: Any, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (param's local slice or gradient) less the rows [start, end) that param marks as
    another rank's replica (tensor_parallel_duplicate_rows): what a norm or count over the TP
    group adds once. Unmarked tensors come back as they are."""
    rows = _attribute(param, "tensor_parallel_duplicate_rows")
    if rows is None:
        return tensor
    start, end = rows
    return torch.cat([tensor[:start], tensor[end:]])


__all__ = [
    "gather_tensor_parallel",
    "is_tensor_parallel",
    "merge_shards",
    "partition_indices",
    "shard_for_rank",
    "strided_partition_indices",
    "without_duplicate_rows",
]
