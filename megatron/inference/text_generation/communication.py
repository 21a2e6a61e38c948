"""Megatron-LM's text-generation broadcasts (megatron.inference.text_generation.communication).

    broadcast_tensor(size, dtype, tensor=None, rank=0, data_parallel=False)  global rank `rank`'s tensor on every rank
    broadcast_list / broadcast_int_list / broadcast_float_list(size, values=None, rank=0, data_parallel=False)
    broadcast_from_last_pipeline_stage(size, dtype, tensor=None)            the last stage's tensor on every stage
    broadcast_from_last_to_first_pipeline_stage(size, dtype, tensor=None)   ... on the first stage (None between)
    copy_from_last_to_first_pipeline_stage(size, dtype, tensor)             ... copied into the first stage's tensor
    send_to_next_pipeline_rank(tensor) / recv_from_prev_pipeline_rank_(recv_buffer)

As in Megatron, the tensor (or list) is needed only on the sending rank; the others give its size
and dtype. With data_parallel=True the broadcast stays inside this rank's model-parallel (TP x PP)
group, from its first rank. Buffers are made on the project's device (megatron.core.device), where
Megatron used the current CUDA device, so the same calls run on CPU with gloo.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron.core import communication, device, parallel_state

Size = int | Sequence[int] | torch.Size


def _empty(size: Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device=device.get_device())


def _sendable(tensor: torch.Tensor | None, what: str) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"{what}: the sending rank must give the tensor")
    return tensor.to(device.get_device()).contiguous()


def broadcast_tensor(size: Size, dtype: torch.dtype, tensor: torch.Tensor | None = None, rank: int = 0,
                     data_parallel: bool = False) -> torch.Tensor:
    """Global rank `rank`'s tensor on every rank of the world (data_parallel: of this model replica,
    from its first rank); the other ranks receive into a new [size] tensor of dtype."""
    group = None
    if data_parallel:
        rank, group = parallel_state.get_model_parallel_src_rank(), parallel_state.get_model_parallel_group()
    if dist.get_rank() == rank:
        tensor = _sendable(tensor, "broadcast_tensor")
    else:
        tensor = _empty(size, dtype)
    return communication.broadcast(tensor, rank, group=group)


def broadcast_list(size: Size, dtype: torch.dtype, list_values=None, rank: int = 0,
                   data_parallel: bool = False) -> torch.Tensor:
    """broadcast_tensor of torch.tensor(list_values, dtype), given on the sending rank only."""
    source = parallel_state.get_model_parallel_src_rank() if data_parallel else rank
    tensor = None
    if dist.get_rank() == source:
        tensor = torch.tensor(list_values, dtype=dtype, device=device.get_device())
    return broadcast_tensor(size, dtype, tensor=tensor, rank=rank, data_parallel=data_parallel)


def broadcast_int_list(size: Size, int_list=None, rank: int = 0, data_parallel: bool = False) -> torch.Tensor:
    """A list of ints as an int64 tensor on every rank (see broadcast_tensor)."""
    return broadcast_list(size, torch.int64, list_values=int_list, rank=rank, data_parallel=data_parallel)


def broadcast_float_list(size: Size, float_list=None, rank: int = 0, data_parallel: bool = False) -> torch.Tensor:
    """A list of floats as a float32 tensor on every rank (see broadcast_tensor)."""
    return broadcast_list(size, torch.float32, list_values=float_list, rank=rank, data_parallel=data_parallel)


def broadcast_from_last_pipeline_stage(size: Size, dtype: torch.dtype,
                                       tensor: torch.Tensor | None = None) -> torch.Tensor | None:
    """The last pipeline stage's tensor on every stage (as given when there is one stage)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    if parallel_state.is_pipeline_last_stage():
        tensor = _sendable(tensor, "broadcast_from_last_pipeline_stage")
    else:
        tensor = _empty(size, dtype)
    return communication.broadcast(tensor, parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())


def _last_to_first(tensor: torch.Tensor) -> None:
    """Send tensor from the last stage to the first (p2p), or receive it there in place."""
    group = parallel_state.get_pipeline_model_parallel_group()
    if parallel_state.is_pipeline_last_stage():
        communication.send(tensor, parallel_state.get_pipeline_model_parallel_first_rank(), group=group)
    else:
        communication.recv(tensor, parallel_state.get_pipeline_model_parallel_last_rank(), group=group)


def broadcast_from_last_to_first_pipeline_stage(size: Size, dtype: torch.dtype,
                                                tensor: torch.Tensor | None = None) -> torch.Tensor | None:
    """The last stage's tensor on the first stage; the last stage keeps its own; the stages between
    get None (and need not call). One stage: tensor as given."""
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    if first and last:
        return tensor
    if not (first or last):
        return None
    tensor = _sendable(tensor, "broadcast_from_last_to_first_pipeline_stage") if last else _empty(size, dtype)
    _last_to_first(tensor)
    return tensor


def copy_from_last_to_first_pipeline_stage(size: Size, dtype: torch.dtype, tensor: torch.Tensor) -> None:
    """Overwrite the first stage's tensor (which may be a non-contiguous view) with the last stage's."""
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    if (first and last) or not (first or last):
        return
    if tensor is None:
        raise ValueError("copy_from_last_to_first_pipeline_stage: the first and last stages must give the tensor")
    buffer = tensor if tensor.is_contiguous() else (tensor.contiguous() if last else _empty(size, dtype))
    _last_to_first(buffer)
    if first and buffer is not tensor:
        tensor[...] = buffer


def send_to_next_pipeline_rank(tensor: torch.Tensor | None = None) -> None:
    """Send tensor to the next pipeline stage (nothing on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return
    tensor = _sendable(tensor, "send_to_next_pipeline_rank")
    group = parallel_state.get_pipeline_model_parallel_group()
    communication.send(tensor, parallel_state.get_pipeline_model_parallel_next_rank(), group=group)


def recv_from_prev_pipeline_rank_(recv_buffer: torch.Tensor | None = None) -> None:
    """Receive the previous stage's tensor into recv_buffer, in place (nothing on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return
    if recv_buffer is None:
        raise ValueError("recv_from_prev_pipeline_rank_: give the buffer to receive into")
    group = parallel_state.get_pipeline_model_parallel_group()
    communication.recv(recv_buffer, parallel_state.get_pipeline_model_parallel_prev_rank(), group=group)
