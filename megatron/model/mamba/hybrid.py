"""Hybrid stacks: Mamba-2, attention and MLP layers in the order a pattern gives (Megatron-Core's
MambaStack; the Nemotron-H / "An Empirical Study of Mamba-based Language Models" recipe).

    pattern symbol   layer                                            state-dict keys (L. = decoder.layers.{i}.)
    M                MambaLayer: x + mixer(norm(x))                   L.norm.weight, L.mixer.*  (mixer.py)
    *                TransformerLayer, self-attention only            L.input_layernorm.*, L.self_attention.*
    -                TransformerLayer, MLP only                       L.pre_mlp_layernorm.*, L.mlp.*
    E                TransformerLayer, MoE MLP only (--num-experts)   L.pre_mlp_layernorm.*, L.mlp.router.*,
                                                                      L.mlp.experts.*, L.mlp.shared_experts.*

The pattern is --hybrid-override-pattern, or allocate_layers spreads round(L x --hybrid-attention-ratio)
attention layers and then round(L x --hybrid-mlp-ratio) MLP layers evenly among the Mamba layers
(Megatron's allocation, so a ratio gives the same pattern there and here). E layers come only from the
override pattern (as in Megatron, whose ratios place no MoE layer; with a ratio given the override must
have the ratios' counts, so none). An E layer is GPT's MoE MLP (megatron/model/moe/: router, experts,
token dispatcher, the balancing losses recorded under its global layer number); --moe-layer-freq does
not apply, the pattern places the MoE layers. MambaStack is the
TransformerBlock (pipeline split: L / pp consecutive layers per stage, the pattern's slice; recompute;
per-layer init streams) building each layer from its symbol, with Megatron's final_norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.model.attention import (DotProductAttention, FlashDotProductAttention, SelfAttention,
                                      SelfAttentionSubmodules)
from megatron.model.layer_specs import get_moe_spec
from megatron.model.layers import Norm
from megatron.model.mamba.layer import MambaLayer, MambaLayerSubmodules
from megatron.model.mamba.mixer import MambaMixer, MambaMixerSubmodules
from megatron.model.mlp import MLP, MLPSubmodules
from megatron.model.spec import ModuleSpec, build_module
from megatron.model.transformer_block import TransformerBlock
from megatron.model.transformer_config import TransformerConfig
from megatron.model.transformer_layer import TransformerLayer, TransformerLayerSubmodules

MAMBA, ATTENTION, MLP_SYMBOL, MOE = "M", "*", "-", "E"
SYMBOLS = (MAMBA, ATTENTION, MLP_SYMBOL, MOE)


class HybridPatternError(ValueError):
    """A hybrid pattern or ratio that cannot build a model (the message names the flag)."""


def allocate_layers(num_layers: int, attention_ratio: float = 0.0, mlp_ratio: float = 0.0,
                    override_pattern: str | None = None) -> str:
    """The layer pattern of a hybrid model of num_layers layers (Megatron's allocate_layers).

    Without an override: attention layers spaced evenly among the Mamba layers (never first), then MLP
    layers spaced evenly among the remaining Mamba layers. An override must have num_layers symbols, and
    with a ratio given, as many of each kind as the ratios ask for."""
    for name, ratio in (("--hybrid-attention-ratio", attention_ratio), ("--hybrid-mlp-ratio", mlp_ratio)):
        if not 0.0 <= ratio <= 1.0:
            raise HybridPatternError(f"{name} must be in [0, 1], got {ratio}")
    if attention_ratio + mlp_ratio > 1.0:
        raise HybridPatternError(f"--hybrid-attention-ratio + --hybrid-mlp-ratio must be at most 1, "
                                 f"got {attention_ratio + mlp_ratio}")
    layers = [MAMBA] * num_layers
    attention = round(num_layers * attention_ratio)
    _spread(layers, ATTENTION, (num_layers - attention) / (attention + 1))
    mlp = round(num_layers * mlp_ratio)
    if mlp:
        _spread(layers, MLP_SYMBOL, (num_layers - attention - mlp) / mlp)
    auto = "".join(layers)
    if override_pattern is None:
        return auto
    bad = sorted(set(override_pattern) - set(SYMBOLS))
    if any(symbol in bad for symbol in "|/"):
        raise HybridPatternError("--hybrid-override-pattern: pipeline ('|') and MTP ('/') sections are not "
                                 "supported; the pipeline splits the pattern evenly")
    if bad:
        raise HybridPatternError(f"--hybrid-override-pattern: {bad[0]!r} is not a layer symbol (M Mamba, "
                                 "* attention, - MLP, E MoE)")
    if len(override_pattern) != num_layers:
        raise HybridPatternError(f"--hybrid-override-pattern has {len(override_pattern)} layers, --num-layers "
                                 f"is {num_layers}")
    if (attention_ratio or mlp_ratio) and sorted(override_pattern) != sorted(auto):
        raise HybridPatternError(f"--hybrid-override-pattern {override_pattern} does not have the layer counts the "
                                 f"ratios give ({auto})")
    return override_pattern


def _spread(layers: list[str], symbol: str, gap: float) -> None:
    """Turn Mamba layers into `symbol`, one after every `gap` Mamba layers (rounded), left to right."""
    budget = gap
    for i, kind in enumerate(layers):
        if kind != MAMBA:
            continue
        if budget < 0.5:
            layers[i] = symbol
            budget += gap
        else:
            budget -= 1


@dataclass
class HybridLayerSubmodules:
    """The spec of each kind of layer of a hybrid stack."""

    mamba_layer: ModuleSpec = field(default_factory=lambda: ModuleSpec(
        module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=Norm, mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)))))
    attention_layer: ModuleSpec | None = None
    mlp_layer: ModuleSpec = field(default_factory=lambda: ModuleSpec(
        module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=None, pre_mlp_layernorm=Norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)))))
    moe_layer: ModuleSpec = field(default_factory=lambda: ModuleSpec(
        module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=None, pre_mlp_layernorm=Norm, mlp=get_moe_spec())))


def attention_layer_spec(use_flash_attn: bool = False) -> ModuleSpec:
    """The attention-only layer: input_layernorm, self_attention (the GPT layer's), no MLP."""
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=Norm, pre_mlp_layernorm=None,
        self_attention=ModuleSpec(module=SelfAttention, submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=FlashDotProductAttention if use_flash_attn else DotProductAttention,
            linear_proj=RowParallelLinear))))


def build_hybrid_layer(config: TransformerConfig, layer_number: int, pattern: str,
                       submodules: HybridLayerSubmodules) -> nn.Module:
    """Layer `layer_number` (1-based) of the pattern, built from its kind's spec."""
    symbol = pattern[layer_number - 1]
    if symbol == MAMBA:
        spec = submodules.mamba_layer
    elif symbol == ATTENTION:
        spec = submodules.attention_layer or attention_layer_spec(config.use_flash_attn)
    elif symbol == MOE:
        if config.num_moe_experts is None:
            raise HybridPatternError("--hybrid-override-pattern: an E (MoE) layer needs --num-experts")
        spec = submodules.moe_layer
    else:
        spec = submodules.mlp_layer
    return build_module(spec, config, layer_number=layer_number)


def hybrid_stack_spec(pattern: str, submodules: HybridLayerSubmodules | None = None) -> ModuleSpec:
    """The block spec MambaStack builds its layers from: one layer per symbol of `pattern`."""
    return ModuleSpec(module=build_hybrid_layer, params={"pattern": pattern},
                      submodules=submodules or HybridLayerSubmodules())


class MambaStack(TransformerBlock):
    """This pipeline stage's layers of a hybrid pattern, then (post_process) the final norm. Keys:
    layers.{i}.* (i local to the stage, see the table above), final_norm.* (Megatron-Core's name)."""

    def __init__(self, config: TransformerConfig, spec: ModuleSpec, pre_process: bool = True,
                 post_process: bool = True, init_seed: int | None = None,
                 layer_range: tuple[int, int] | None = None) -> None:
        pattern = spec.params.get("pattern", "")
        if len(pattern) != config.num_layers:
            raise HybridPatternError(f"the hybrid pattern has {len(pattern)} layers, --num-layers is "
                                     f"{config.num_layers}")
        super().__init__(config, spec, pre_process, post_process, init_seed, layer_range)
        norm = self._modules.pop("final_layernorm", None)  # registered by TransformerBlock: renamed
        if norm is not None:
            self.final_norm = norm

    @property
    def final_layernorm(self) -> nn.Module | None:
        """TransformerBlock's name of the final norm (its forward applies it)."""
        return self.final_norm

    @final_layernorm.setter
    def final_layernorm(self, value: nn.Module | None) -> None:
        self.final_norm = value
