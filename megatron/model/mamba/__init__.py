"""Mamba-2 layers and hybrid Mamba / attention / MLP models (docs/model.md, "Mamba and hybrid models")."""

from megatron.model.mamba.hybrid import MambaStack, allocate_layers, hybrid_stack_spec
from megatron.model.mamba.layer import MambaLayer
from megatron.model.mamba.mixer import MambaMixer, mamba_dims
from megatron.model.mamba.model import MambaModel

__all__ = ["MambaLayer", "MambaMixer", "MambaModel", "MambaStack", "allocate_layers", "hybrid_stack_spec",
           "mamba_dims"]
