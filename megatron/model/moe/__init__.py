"""Mixture of experts: router.py, experts.py, token_dispatcher.py, moe_layer.py (docs/moe.md)."""

from megatron.model.moe.moe_layer import MoELayer, MoESubmodules

__all__ = ["MoELayer", "MoESubmodules"]
