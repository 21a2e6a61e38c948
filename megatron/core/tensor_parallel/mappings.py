"""Autograd-aware moves of activations into and out of the tensor-parallel region.

Each mapping is a pair of conjugate operations: what the forward does to activations, the
backward does the transpose of to gradients (a copy's transpose is a sum, a split's is a
gather). t is the tensor-parallel size; with t = 1 every mapping is the identity and issues
no collective. All collectives run over the tensor-parallel group through
megatron.core.communication, and only along dim 0: a last-dim gather gathers a copy with the
last dim moved to the front.

    mapping                                forward                  backward
    copy_to_tensor_model_parallel_region   identity                 all-reduce
    reduce_from_tensor_model_parallel_region all-reduce             identity
    scatter_to_tensor_model_parallel_region  split last dim         all-gather last dim
    gather_from_tensor_model_parallel_region all-gather last dim    split last dim
    scatter_to_sequence_parallel_region    split dim 0              all-gather dim 0
    gather_from_sequence_parallel_region   all-gather dim 0         reduce-scatter dim 0 (or split)
    reduce_scatter_to_sequence_parallel_region reduce-scatter dim 0 all-gather dim 0
"""

from __future__ import annotations

import torch

from megatron.core import communication, parallel_state
from megatron.core.tensor_parallel.utils import divide, split_tensor_along_last_dim
from megatron.core.utils import apply_function


def _tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def _reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum over the TP ranks, into a new tensor: the input may be shared with other autograd
    branches (a gradient fanned out by an add), so it is never reduced in place."""
    if _tp_size() == 1:
        return input_
    output = input_.clone(memory_format=torch.contiguous_format)
    return communication.all_reduce(output, group=parallel_state.get_tensor_model_parallel_group())


def _split_along_last_dim(input_: torch.Tensor) -> torch.Tensor:
    world_size = _tp_size()
    if world_size == 1:
        return input_
    chunks = split_tensor_along_last_dim(input_, world_size)  # t x [..., n/t]
    return chunks[parallel_state.get_tensor_model_parallel_rank()].contiguous()


def _split_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    world_size = _tp_size()
    if world_size == 1:
        return input_
    local = divide(input_.size(0), world_size)
    start = parallel_state.get_tensor_model_parallel_rank() * local
    return input_[start : start + local].contiguous()  # [s/t, ...]


def _gather_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    world_size = _tp_size()
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    output = input_.new_empty((world_size * input_.size(0),) + tuple(input_.shape[1:]))  # [s, ...]
    communication.all_gather_into_tensor(output, input_, group=parallel_state.get_tensor_model_parallel_group())
    return output


def _gather_along_last_dim(input_: torch.Tensor) -> torch.Tensor:
    if _tp_size() == 1:
        return input_
    moved = input_.movedim(-1, 0)  # [..., n/t] -> [n/t, ...]
    gathered = _gather_along_first_dim(moved)  # [n, ...], rank r's columns at rows [r n/t, (r+1) n/t)
    return gathered.movedim(0, -1).contiguous()  # [n, ...] -> [..., n]


def _reduce_scatter_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    world_size = _tp_size()
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    local = divide(input_.size(0), world_size)
    output = input_.new_empty((local,) + tuple(input_.shape[1:]))  # [s/t, ...]
    communication.reduce_scatter_tensor(output, input_, group=parallel_state.get_tensor_model_parallel_group())
    return output


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_along_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _gather_along_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        # Feeding a TP region, each rank's gradient is a partial sum: reduce, then keep this
        # rank's rows. Feeding replicated computation, every rank already has the whole sum.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output), None
        return _split_along_first_dim(grad_output), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce_scatter_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Entering a TP region with a replicated input: forward identity, backward all-reduce."""
    return apply_function(_CopyToModelParallelRegion, input_)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Leaving a TP region with partial sums: forward all-reduce, backward identity."""
    return apply_function(_ReduceFromModelParallelRegion, input_)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """[..., n] -> this rank's [..., n/t]; backward all-gathers the last dim."""
    return apply_function(_ScatterToModelParallelRegion, input_)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """[..., n/t] -> [..., n] in rank order; backward keeps this rank's slice."""
    return apply_function(_GatherFromModelParallelRegion, input_)


def scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """[s, b, h] -> this rank's [s/t, b, h]; backward all-gathers dim 0."""
    return apply_function(_ScatterToSequenceParallelRegion, input_)


def gather_from_sequence_parallel_region(
    input_: torch.Tensor, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """[s/t, b, h] -> [s, b, h]; backward reduce-scatters dim 0, or only splits it when the
    gathered tensor feeds computation replicated on every TP rank (tensor_parallel_output_grad=False)."""
    return apply_function(_GatherFromSequenceParallelRegion, input_, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Partial sums [s, b, h] -> this rank's rows of the sum [s/t, b, h]; backward all-gathers dim 0."""
    return apply_function(_ReduceScatterToSequenceParallelRegion, input_)
