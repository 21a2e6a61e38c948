"""Bytes per parameter that this rank holds for training, measured on the tensors actually allocated.

Megatron's table (its distributed-optimizer guide), d = data-parallel size:

    params / grads    non-distributed    distributed optimizer
    fp16 / fp16       20                 4 + 16/d    (2 param + 2 grad + (4 main param + 4 main grad + 8 Adam)/d)
    bf16 / fp32       18                 6 + 12/d    (2 param + 4 grad + (4 main param + 8 Adam)/d)
    fp32 / fp32       16                 8 + 8/d     (4 param + 4 grad + 8 Adam/d)

Our optimizers allocate exactly these after a step: Float16OptimizerWithFloat16Params sets
main_param.grad = main_grad.float(), a new fp32 tensor when the grad buffer is fp16 and the
buffer itself when it is fp32 (no copy); the DistributedOptimizer does the same per shard; fp32
main params are the model params themselves (or views of the param buffer).

Counting rules: every distinct storage is counted once, whole, in the first category that
reaches it, in the order model_params, grads, main_params, main_grads, optimizer_state. Whole
storages include the distributed optimizer's bucket padding (at most d - 1 elements per bucket);
a model whose buckets need no padding gives the table exactly. Adam's per-tensor `step`
counters (0-dim, a few bytes per tensor, not per parameter) are left out of optimizer_state, as
in Megatron's table. The state of the inner optimizer only exists after its first step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

CATEGORIES = ("model_params", "grads", "main_params", "main_grads", "optimizer_state")


def _unique_params(model_chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen, params = set(), []
    for chunk in model_chunks:
        for param in chunk.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def _tensors_by_category(model_chunks: Sequence[nn.Module], optimizer: Any) -> dict[str, list[torch.Tensor]]:
    params = _unique_params(model_chunks)
    grads = [t for p in params for t in (getattr(p, "main_grad", None), p.grad) if t is not None]
    # get_parameters(): what the inner optimizer steps -- fp32 main copies, fp32 model params
    # (already counted above) or the distributed optimizer's main shards.
    mains = optimizer.get_parameters()
    main_grads = [m.grad for m in mains if m.grad is not None]
    state = [value for per_param in optimizer.optimizer.state.values() for key, value in per_param.items()
             if isinstance(value, torch.Tensor) and not (key == "step" and value.dim() == 0)]
    return {"model_params": params, "grads": grads, "main_params": mains, "main_grads": main_grads,
            "optimizer_state": state}


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set) -> int:
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.device)
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def optimizer_memory_per_parameter(model_chunks: nn.Module | Sequence[nn.Module], optimizer: Any) -> dict[str, Any]:
    """Bytes per model parameter held on this rank, per category and in total (see the module docstring).

    Returns {"model_params", "grads", "main_params", "main_grads", "optimizer_state", "total":
    bytes / num_parameters (floats), "num_parameters": this rank's unique param elements,
    "bytes": {category: total bytes}}.
    """
    if isinstance(model_chunks, nn.Module):
        model_chunks = [model_chunks]
    num_parameters = sum(p.numel() for p in _unique_params(model_chunks))
    seen: set = set()
    nbytes = {category: _storage_bytes(tensors, seen)
              for category, tensors in _tensors_by_category(model_chunks, optimizer).items()}
    result: dict[str, Any] = {category: nbytes[category] / num_parameters for category in CATEGORIES}
    result["total"] = sum(nbytes.values()) / num_parameters
    result["num_parameters"] = num_parameters
    result["bytes"] = nbytes
    return result


__all__ = ["CATEGORIES", "optimizer_memory_per_parameter"]
