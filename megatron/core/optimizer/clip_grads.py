"""Gradient norm, clipping by total norm and zero counting, in fp32 (Megatron's clip_grads).

The norm is taken over every gradient given; when a model-parallel group is passed, the
partial sums (or maxima, for the inf-norm) are all-reduced over it, so each rank sees the norm
of the whole model. Callers leave out duplicated parameters (tied copies, tensor-parallel
replicas) before calling, as Megatron's optimizer does.
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


def get_grad_norm_fp32(grads_for_norm: TensorOrTensors, norm_type: float = 2,
                       model_parallel_group: dist.ProcessGroup | None = None) -> float:
    """The `norm_type` norm of all the given gradient tensors together, as a Python float.

    An inf or nan norm is returned as it is (the caller decides what an overflow means).
    """
    grads = [g.detach() for g in _as_list(grads_for_norm)]
    norm_type = float(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    if norm_type == math.inf:
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for grad in grads:
            total = torch.maximum(total, grad.abs().max().float().reshape(1))
        _all_reduce(total, dist.ReduceOp.MAX, model_parallel_group)
        return float(total.item())
    total = torch.zeros(1, dtype=torch.float32, device=device)
    # A norm op per tensor: torch._foreach_norm would save about 2 ms a step on the benchmark GPT
    # but sums less accurately, and the distributed optimizer's shards then drift from the plain
    # optimizer's whole tensors by 3e-6 after three Adam steps (tests/unit/test_optimizer_memory.py).
    for grad in grads:
        total += torch.linalg.vector_norm(grad.float(), ord=norm_type) ** norm_type
    _all_reduce(total, dist.ReduceOp.SUM, model_parallel_group)
    return float(total.item()) ** (1.0 / norm_type)


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


def count_zeros_fp32(params_or_grads: TensorOrTensors,
                     model_parallel_group: dist.ProcessGroup | None = None) -> int:
    """Number of exactly-zero gradient entries (summed over the group when one is given)."""
    grads = _grads_of(params_or_grads)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for grad in grads:
        total += grad.numel() - torch.count_nonzero(grad)
    _all_reduce(total, dist.ReduceOp.SUM, model_parallel_group)
    return int(total.item())
