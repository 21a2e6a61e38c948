"""MLP activations beyond GeLU, as megatron/arguments.py maps them (Megatron's
megatron/training/activations.py): --squared-relu -> squared_relu; --swiglu -> F.silu with
TransformerConfig.gated_linear_unit."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (So et al. 2021, "Primer")."""
    return F.relu(x).square()
