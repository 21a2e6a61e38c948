"""Small helpers shared across megatron.core."""

from __future__ import annotations

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
