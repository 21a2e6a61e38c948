"""Small helpers shared across megatron.core (and the layers above it): model unwrapping,
the model's config, and rank-aware printing.

Every print helper writes a whole line (text and newline) in one write call. Under torchrun all
ranks share the launcher's stdout and stderr; with PYTHONUNBUFFERED=1 `print(text)` makes two
writes (the text, then the newline), and another rank's line could land between them. A single
write of one line (well under PIPE_BUF, 4096 bytes) reaches a pipe whole.
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO

import torch
import torch.distributed as dist
from torch import nn


def unwrap_model(model: nn.Module | list[nn.Module]) -> nn.Module | list[nn.Module]:
    """Strip wrappers (Float16Module, DDP, anything exposing `.module`) down to the inner model.

    A list of model chunks gives the list of unwrapped chunks.
    """
    if isinstance(model, (list, tuple)):
        return [unwrap_model(chunk) for chunk in model]
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def get_model_config(model: nn.Module | list[nn.Module]):
    """The config of the innermost model (the first chunk of a list), under Megatron-core's name.

    The innermost one, not the first `.config` on the way in: our DistributedDataParallel keeps its
    DistributedDataParallelConfig as `.config`, where Megatron's keeps the TransformerConfig."""
    if isinstance(model, (list, tuple)):
        model = model[0]
    inner = unwrap_model(model)
    if not hasattr(inner, "config"):
        raise AttributeError(f"{type(inner).__name__} has no config (not a megatron model?)")
    return inner.config


class _NoGraphContext:
    """Stands in for an autograd ctx when no graph is recorded: what forward saves is dropped."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass


def apply_function(function: type[torch.autograd.Function], *args):
    """function.apply(*args); with grad mode off (inference), its forward called directly.

    Under torch.no_grad Function.apply records nothing yet still pays for the graph machinery on every
    call -- tens of microseconds, which at decode time (one token per forward, some 80 such calls a
    step) cost more than the matmuls of a small model. The outputs are the same tensors either way."""
    if torch.is_grad_enabled():
        return function.apply(*args)
    return function.forward(_NoGraphContext(), *args)


def get_rank_safe() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size_safe() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_last_rank() -> bool:
    return get_rank_safe() == get_world_size_safe() - 1


def print_line(message: str, stream: Optional[TextIO] = None) -> None:
    """Write message and its newline to stream (stdout by default) in one write, flushed, on this rank."""
    stream = stream or sys.stdout
    stream.write(message + "\n")
    stream.flush()


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only."""
    if get_rank_safe() == 0:
        print_line(message)


def print_rank_last(message: str, stream: Optional[TextIO] = None) -> None:
    """Print on the last global rank (the one that holds the loss under pipeline parallelism)."""
    if is_last_rank():
        print_line(message, stream)
