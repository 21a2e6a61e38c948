"""The transformer's feed-forward block: h -> ffn_hidden_size -> GeLU -> h."""

from __future__ import annotations

import torch

from megatron.model.layers import Linear
from megatron.model.module import MegatronModule
from megatron.model.transformer_config import TransformerConfig
from megatron.model.utils import erf_gelu, openai_gelu


class MLP(MegatronModule):
    """[s, b, h] -> [s, b, h]. State-dict keys: linear_fc1.{weight,bias}, linear_fc2.{weight,bias}."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        bias = config.add_bias_linear
        self.linear_fc1 = Linear(config.hidden_size, config.ffn_hidden_size, config, config.init_method, bias=bias)
        self.activation_func = openai_gelu if config.openai_gelu else erf_gelu
        self.linear_fc2 = Linear(
            config.ffn_hidden_size, config.hidden_size, config, config.output_layer_init_method, bias=bias
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        intermediate = self.activation_func(self.linear_fc1(hidden_states))  # [s, b, ffn]
        return self.linear_fc2(intermediate)  # [s, b, h]
