"""Small helpers shared across megatron.core."""

from __future__ import annotations

import torch
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
