"""MambaLayer: x + dropout(mixer(norm(x))), the Mamba block of a hybrid stack (Megatron-Core's MambaLayer).

State-dict keys: norm.{weight,bias} (the config's normalization; RMSNorm in Megatron's Mamba recipes),
mixer.* (mixer.py). Activations [s, b, h], [s/t, b, h] under sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron import fused_kernels
from megatron.model.layers import Dropout, Norm, fused_impl, tensor_parallel_dropout_context
from megatron.model.module import MegatronModule
from megatron.model.spec import ModuleSpec, build_module
from megatron.model.transformer_config import TransformerConfig


@dataclass
class MambaLayerSubmodules:
    norm: ModuleSpec | type = Norm
    mixer: ModuleSpec | type | None = None


class MambaLayer(MegatronModule):
    """[s, b, h] -> [s, b, h]. Takes TransformerLayer's forward arguments (the mask, rotary angles and
    attention bias are not used: the mixer is causal by construction) so a stack can mix the two."""

    def __init__(self, config: TransformerConfig, submodules: MambaLayerSubmodules, layer_number: int = 1) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        self.norm = build_module(submodules.norm, config.hidden_size, config)
        self.mixer = build_module(submodules.mixer, config, layer_number=layer_number)
        self.hidden_dropout = Dropout(config.hidden_dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, is_causal: bool = False,
                rotary_pos_emb: torch.Tensor | None = None, attention_bias: torch.Tensor | None = None,
                inference_context=None) -> torch.Tensor:
        residual = hidden_states.float() if self.config.fp32_residual_connection else hidden_states
        output, bias = self.mixer(self.norm(hidden_states), inference_context=inference_context)  # [s, b, h]
        with tensor_parallel_dropout_context(partitioned=self.config.sequence_parallel):
            if self.config.bias_dropout_fusion:
                return fused_kernels.bias_dropout_add(output, bias, residual, self.config.hidden_dropout, self.training,
                                                      impl=fused_impl(self.config, output))
            return residual + self.hidden_dropout(output if bias is None else output + bias)
