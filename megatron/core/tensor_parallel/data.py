"""Broadcast a batch from the first rank of each tensor-parallel group to the others.

Only TP rank 0 reads the data; the other ranks of its group receive the same tensors. Two
broadcasts, whatever the number of keys: the shapes (so receivers can allocate), then all the
tensors packed into one flat buffer.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core import communication, device, parallel_state

# Room for the shape of each tensor in the size broadcast: [ndim, d0, d1, ...] padded.
_MAX_DATA_DIM = 8


def _pack_shapes(keys: list[str], data: dict[str, torch.Tensor], datatype: torch.dtype) -> torch.Tensor:
    rows = []
    for key in keys:
        tensor = data[key]
        if tensor.dtype != datatype:
            raise ValueError(f"broadcast_data: {key!r} has dtype {tensor.dtype}, expected {datatype}")
        if tensor.dim() >= _MAX_DATA_DIM:
            raise ValueError(f"broadcast_data: {key!r} has {tensor.dim()} dims, at most {_MAX_DATA_DIM - 1} supported")
        shape = list(tensor.shape)
        rows.append([len(shape)] + shape + [0] * (_MAX_DATA_DIM - 1 - len(shape)))
    return torch.tensor(rows, dtype=torch.int64)  # [keys, 8]


def broadcast_data(keys: list[str], data: dict[str, Any] | None, datatype: torch.dtype) -> dict[str, torch.Tensor]:
    """{key: tensor} on every rank of the TP group, as `data` holds it on TP rank 0.

    `data` is read on TP rank 0 only (other ranks may pass None); every tensor must have dtype
    `datatype`. The results live on this process's device (megatron.core.device).
    """
    target = device.get_device()
    is_source = parallel_state.get_tensor_model_parallel_rank() == 0
    single = parallel_state.get_tensor_model_parallel_world_size() == 1
    # A TP group of one needs no broadcast (and may not exist as a process group).
    group = None if single else parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()

    if is_source:
        shapes = _pack_shapes(keys, data, datatype).to(target)
    else:
        shapes = torch.empty(len(keys), _MAX_DATA_DIM, dtype=torch.int64, device=target)
    if not single:
        communication.broadcast(shapes, src, group=group)  # [keys, 8]
    sizes = [tuple(int(d) for d in row[1 : 1 + int(row[0])]) for row in shapes.tolist()]
    numels = [int(torch.Size(size).numel()) for size in sizes]

    if is_source:
        flat = torch.cat([data[key].contiguous().view(-1) for key in keys]).to(target)  # [sum numel]
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=target)
    if not single:
        communication.broadcast(flat, src, group=group)
    pieces = torch.split(flat, numels)
    return {key: piece.view(size) for key, piece, size in zip(keys, pieces, sizes)}
