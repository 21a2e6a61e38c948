"""Gradient norm, clipping by total norm and zero counting, in fp32 (Megatron's clip_grads).

The norm is taken over every gradient given; when a model-parallel group is passed, the
partial sums (or maxima, for the inf-norm) are all-reduced over it, so each rank sees the norm
of the whole model. Callers leave out duplicated parameters (tied copies, tensor-parallel
replicas) before calling, as Megatron's optimizer does.

A MoE model's gradients come in two kinds reduced over different groups: dense ones over the
model-parallel group, expert ones over the expert tensor-model-pipeline group (the ranks that
hold every expert once). `grad_norm_of_parts` reduces each kind's partial sum over its own group
and adds them (Megatron's result: the norm over all distinct parameters).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron.core import communication

TensorOrTensors = torch.Tensor | Iterable[torch.Tensor]


def _as_list(tensors: TensorOrTensors) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return list(tensors)


def _grads_of(params_or_grads: TensorOrTensors) -> list[torch.Tensor]:
    """Parameters (tensors that require grad) give their `.grad` (skipped when None);
    any other tensor is taken to be a gradient itself."""
    grads = []
    for tensor in _as_list(params_or_grads):
        if isinstance(tensor, torch.nn.Parameter) or tensor.requires_grad:
            if tensor.grad is not None:
                grads.append(tensor.grad.detach())
        else:
            grads.append(tensor.detach())
    return grads


def _all_reduce(value: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        communication.all_reduce(value, group=group, op=op)


def grad_norm_power_fp32(grads_for_norm: TensorOrTensors, norm_type: float = 2,
                         groups: Iterable[dist.ProcessGroup | None] = ()) -> torch.Tensor:
    """[1] fp32: the sum of |g| ** norm_type over the gradients (their max for the inf-norm),
    all-reduced over each of `groups` in turn (None entries skipped)."""
    grads = [g.detach() for g in _as_list(grads_for_norm)]
    norm_type = float(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float32, device=device)
    if norm_type == math.inf:
        for grad in grads:
            total = torch.maximum(total, grad.abs().max().float().reshape(1))
    else:
        # A norm op per tensor: torch._foreach_norm would save about 2 ms a step on the benchmark GPT
        # but sums less accurately, and the distributed optimizer's shards then drift from the plain
        # optimizer's whole tensors by 3e-6 after three Adam steps (tests/unit/test_optimizer_memory.py).
        for grad in grads:
            total += torch.linalg.vector_norm(grad.float(), ord=norm_type) ** norm_type
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    for group in groups:
        _all_reduce(total, op, group)
    return total


def grad_norm_of_parts(parts: Iterable[tuple[TensorOrTensors, Iterable[dist.ProcessGroup | None]]],
                       norm_type: float = 2) -> float:
    """The norm of several kinds of gradients together: each part (grads, groups) is reduced
    over its own groups (grad_norm_power_fp32), then the parts are added (max for the inf-norm)."""
    norm_type = float(norm_type)
    powers = [float(grad_norm_power_fp32(grads, norm_type, groups).item()) for grads, groups in parts]
    if norm_type == math.inf:
        return max(powers, default=0.0)
    return sum(powers) ** (1.0 / norm_type)


def get_grad_norm_fp32(grads_for_norm: TensorOrTensors, norm_type: float = 2,
                       model_parallel_group: dist.ProcessGroup | None = None) -> float:
    """The `norm_type` norm of all the given gradient tensors together, as a Python float.

    An inf or nan norm is returned as it is (the caller decides what an overflow means).
    """
    return grad_norm_of_parts([(grads_for_norm, [model_parallel_group])], norm_type)


def clip_grad_by_total_norm_fp32(params_or_grads: TensorOrTensors, max_norm: float,
                                 total_norm: float) -> None:
    """Scale the gradients in place by max_norm / (total_norm + 1e-6) when that is below 1."""
    clip_coeff = float(max_norm) / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        grads = _grads_of(params_or_grads)
        if grads:
            torch._foreach_mul_(grads, clip_coeff)


def clip_grad_norm_fp32(params_or_grads: TensorOrTensors, max_norm: float, norm_type: float = 2,
                        model_parallel_group: dist.ProcessGroup | None = None) -> float:
    """Clip gradients in place so that their total norm is at most `max_norm`.

    `params_or_grads`: parameters (their `.grad` is used) or gradient tensors. Returns the
    total norm before clipping (inf/nan as is), like torch.nn.utils.clip_grad_norm_.
    """
    grads = _grads_of(params_or_grads)
    total_norm = get_grad_norm_fp32(grads, norm_type, model_parallel_group)
    clip_grad_by_total_norm_fp32(grads, max_norm, total_norm)
    return total_norm


def count_zeros_tensor_fp32(params_or_grads: TensorOrTensors,
                           groups: Iterable[dist.ProcessGroup | None] = ()) -> torch.Tensor:
    """[1] fp32: the number of exactly-zero gradient entries, summed over each of `groups` in turn."""
    grads = _grads_of(params_or_grads)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for grad in grads:
        total += grad.numel() - torch.count_nonzero(grad)
    for group in groups:
        _all_reduce(total, dist.ReduceOp.SUM, group)
    return total


def count_zeros_fp32(params_or_grads: TensorOrTensors,
                     model_parallel_group: dist.ProcessGroup | None = None) -> int:
    """Number of exactly-zero gradient entries (summed over the group when one is given)."""
    return int(count_zeros_tensor_fp32(params_or_grads, [model_parallel_group]).item())
