"""Autograd-aware moves of activations into and out of the tensor-parallel region.

Each mapping is a pair of conjugate operations: what the forward does to activations, the
backward does the transpose of to gradients (a copy's transpose is a sum, a split's is a
gather). t is the tensor-parallel size; with t = 1 every mapping is the identity and issues
no collective. All collectives run over the tensor-parallel group (or the `group=` a caller
gives, Megatron-core's optional argument) through megatron.core.communication, and only along
dim 0: a last-dim gather gathers a copy with the last dim moved to the front.

    mapping                                forward                  backward
    copy_to_tensor_model_parallel_region   identity                 all-reduce
    reduce_from_tensor_model_parallel_region all-reduce             identity
    scatter_to_tensor_model_parallel_region  split last dim         all-gather last dim
    gather_from_tensor_model_parallel_region all-gather last dim    split last dim
    scatter_to_sequence_parallel_region    split dim 0              all-gather dim 0
    gather_from_sequence_parallel_region   all-gather dim 0         reduce-scatter dim 0 (or split)
    reduce_scatter_to_sequence_parallel_region reduce-scatter dim 0 all-gather dim 0
    all_to_all                             all-to-all dim 0         all-to-all back

The dim-0 gather and reduce-scatter also take unequal row counts (Megatron-core's
`output_split_sizes` / `input_split_sizes`: rank r holds sizes[r] rows), padded to the longest
so that every backend (gloo included) moves equal pieces. The MoE token dispatchers run on these
mappings over the expert groups.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron.core import communication, parallel_state
from megatron.core.tensor_parallel.utils import divide, split_tensor_along_last_dim
from megatron.core.utils import apply_function


class _Group(NamedTuple):
    """The group a mapping runs over: its size, this rank's place in it, the process group."""

    size: int
    rank: int
    handle: Optional[ProcessGroup]


def _resolve(group: Optional[ProcessGroup]) -> _Group:
    """`group` (Megatron's optional argument), or parallel_state's tensor-parallel group when None.

    The TP group is only looked up when it has more than one rank: a TP size of 1 needs no
    collective and may have no process group at all (a single process without torch.distributed).
    """
    if group is not None:
        return _Group(dist.get_world_size(group), dist.get_rank(group), group)
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return _Group(1, 0, None)
    return _Group(size, parallel_state.get_tensor_model_parallel_rank(),
                  parallel_state.get_tensor_model_parallel_group())


def _reduce(input_: torch.Tensor, group: Optional[_Group] = None) -> torch.Tensor:
    """Sum over the group's ranks, into a new tensor: the input may be shared with other autograd
    branches (a gradient fanned out by an add), so it is never reduced in place."""
    group = group if group is not None else _resolve(None)
    if group.size == 1:
        return input_
    output = input_.clone(memory_format=torch.contiguous_format)
    return communication.all_reduce(output, group=group.handle)


def _split_along_last_dim(input_: torch.Tensor, group: Optional[_Group] = None) -> torch.Tensor:
    group = group if group is not None else _resolve(None)
    if group.size == 1:
        return input_
    chunks = split_tensor_along_last_dim(input_, group.size)  # t x [..., n/t]
    return chunks[group.rank].contiguous()


def _split_along_first_dim(input_: torch.Tensor, group: Optional[_Group] = None,
                           split_sizes: Optional[list[int]] = None) -> torch.Tensor:
    group = group if group is not None else _resolve(None)
    if group.size == 1:
        return input_
    if split_sizes is not None:
        start = sum(split_sizes[:group.rank])
        return input_[start : start + split_sizes[group.rank]].contiguous()
    local = divide(input_.size(0), group.size)
    start = group.rank * local
    return input_[start : start + local].contiguous()  # [s/t, ...]


def _gather_along_first_dim(input_: torch.Tensor, group: Optional[_Group] = None,
                            output_split_sizes: Optional[list[int]] = None) -> torch.Tensor:
    group = group if group is not None else _resolve(None)
    if group.size == 1:
        return input_
    input_ = input_.contiguous()
    if output_split_sizes is not None:  # rank r's sizes[r] rows, each padded to the longest
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest,) + tuple(input_.shape[1:]))
        padded[:input_.size(0)] = input_
        gathered = _gather_along_first_dim(padded, group)
        return torch.cat([gathered[r * longest : r * longest + n] for r, n in enumerate(output_split_sizes)])
    output = input_.new_empty((group.size * input_.size(0),) + tuple(input_.shape[1:]))  # [s, ...]
    communication.all_gather_into_tensor(output, input_, group=group.handle)
    return output


def _gather_along_last_dim(input_: torch.Tensor, group: Optional[_Group] = None) -> torch.Tensor:
    group = group if group is not None else _resolve(None)
    if group.size == 1:
        return input_
    moved = input_.movedim(-1, 0)  # [..., n/t] -> [n/t, ...]
    gathered = _gather_along_first_dim(moved, group)  # [n, ...], rank r's columns at rows [r n/t, (r+1) n/t)
    return gathered.movedim(0, -1).contiguous()  # [n, ...] -> [..., n]


def _reduce_scatter_along_first_dim(input_: torch.Tensor, group: Optional[_Group] = None,
                                    input_split_sizes: Optional[list[int]] = None) -> torch.Tensor:
    group = group if group is not None else _resolve(None)
    if group.size == 1:
        return input_
    input_ = input_.contiguous()
    if input_split_sizes is not None:  # sizes[r] rows for each rank r in turn, each padded to the longest
        longest = max(input_split_sizes)
        padded = input_.new_zeros((group.size * longest,) + tuple(input_.shape[1:]))
        for r, piece in enumerate(torch.split(input_, input_split_sizes)):
            padded[r * longest : r * longest + piece.size(0)] = piece
        return _reduce_scatter_along_first_dim(padded, group)[:input_split_sizes[group.rank]]
    local = divide(input_.size(0), group.size)
    output = input_.new_empty((local,) + tuple(input_.shape[1:]))  # [s/t, ...]
    communication.reduce_scatter_tensor(output, input_, group=group.handle)
    return output


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad, group, output_split_sizes):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.group, ctx.split_sizes = group, output_split_sizes
        return _gather_along_first_dim(input_, group, output_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        # Feeding a TP region, each rank's gradient is a partial sum: reduce, then keep this
        # rank's rows. Feeding replicated computation, every rank already has the whole sum.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output, ctx.group, ctx.split_sizes), None, None, None
        return _split_along_first_dim(grad_output, ctx.group, ctx.split_sizes), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group, input_split_sizes):
        ctx.group, ctx.split_sizes = group, input_split_sizes
        return _reduce_scatter_along_first_dim(input_, group, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group, ctx.split_sizes), None, None


def _all_to_all(input_: torch.Tensor, group: _Group, output_split_sizes: Optional[list[int]],
                input_split_sizes: Optional[list[int]]) -> torch.Tensor:
    input_ = input_.contiguous()
    if output_split_sizes is None:  # equal pieces
        output_split_sizes = input_split_sizes = [divide(input_.size(0), group.size)] * group.size
    output = input_.new_empty((sum(output_split_sizes),) + tuple(input_.shape[1:]))
    return communication.all_to_all_single(output, input_, output_split_sizes, input_split_sizes, group=group.handle)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group, ctx.splits = group, (output_split_sizes, input_split_sizes)
        if group.size == 1:
            return input_
        return _all_to_all(input_, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.group.size == 1:
            return None, grad_output, None, None
        output_split_sizes, input_split_sizes = ctx.splits  # the gradients go back along the same routes
        return None, _all_to_all(grad_output, ctx.group, input_split_sizes, output_split_sizes), None, None


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Entering a TP region with a replicated input: forward identity, backward all-reduce."""
    return apply_function(_CopyToModelParallelRegion, input_, _resolve(group))


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor,
                                             group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Leaving a TP region with partial sums: forward all-reduce, backward identity."""
    return apply_function(_ReduceFromModelParallelRegion, input_, _resolve(group))


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """[..., n] -> this rank's [..., n/t]; backward all-gathers the last dim."""
    return apply_function(_ScatterToModelParallelRegion, input_, _resolve(group))


def gather_from_tensor_model_parallel_region(input_: torch.Tensor,
                                             group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """[..., n/t] -> [..., n] in rank order; backward keeps this rank's slice."""
    return apply_function(_GatherFromModelParallelRegion, input_, _resolve(group))


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """[s, b, h] -> this rank's [s/t, b, h]; backward all-gathers dim 0."""
    return apply_function(_ScatterToSequenceParallelRegion, input_, _resolve(group))


def gather_from_sequence_parallel_region(
    input_: torch.Tensor, tensor_parallel_output_grad: bool = True, group: Optional[ProcessGroup] = None,
    output_split_sizes: Optional[list[int]] = None,
) -> torch.Tensor:
    """[s/t, b, h] -> [s, b, h]; backward reduce-scatters dim 0, or only splits it when the
    gathered tensor feeds computation replicated on every TP rank (tensor_parallel_output_grad=False).
    With output_split_sizes, rank r contributes output_split_sizes[r] rows (any number, zero too)."""
    return apply_function(_GatherFromSequenceParallelRegion, input_, tensor_parallel_output_grad,
                          _resolve(group), output_split_sizes)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group: Optional[ProcessGroup] = None,
                                               input_split_sizes: Optional[list[int]] = None) -> torch.Tensor:
    """Partial sums [s, b, h] -> this rank's rows of the sum [s/t, b, h]; backward all-gathers dim 0.
    With input_split_sizes, input_ holds input_split_sizes[r] rows for each rank r in turn."""
    return apply_function(_ReduceScatterToSequenceParallelRegion, input_, _resolve(group), input_split_sizes)


def all_to_all(group: Optional[ProcessGroup], input_: torch.Tensor, output_split_sizes_: Optional[list[int]] = None,
               input_split_sizes: Optional[list[int]] = None) -> torch.Tensor:
    """Rows input_split_sizes[r] go to rank r and output_split_sizes_[r] rows come from it (equal
    pieces when both are None); backward sends the gradients back along the same routes
    (Megatron-core's signature, group first)."""
    return apply_function(_AllToAll, _resolve(group), input_, output_split_sizes_, input_split_sizes)
