"""The transformer's feed-forward block: h -> ffn_hidden_size -> GeLU -> h.

linear_fc1 is column parallel (each tensor-parallel rank computes ffn/t of the hidden units)
and linear_fc2 row parallel (the partial outputs are summed over the ranks), so the GeLU runs
on the local columns with no communication in between.
"""

from __future__ import annotations

import torch

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.model.module import MegatronModule
from megatron.model.transformer_config import TransformerConfig
from megatron.model.utils import erf_gelu, openai_gelu


class MLP(MegatronModule):
    """[s, b, h] -> [s, b, h]. State-dict keys: linear_fc1.{weight,bias}, linear_fc2.{weight,bias}."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        bias = config.add_bias_linear
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, config=config,
                                               init_method=config.init_method, bias=bias, gather_output=False)
        self.activation_func = openai_gelu if config.openai_gelu else erf_gelu
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, config=config,
                                            init_method=config.output_layer_init_method, bias=bias,
                                            input_is_parallel=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        intermediate, _ = self.linear_fc1(hidden_states)  # [s, b, ffn/t]
        output, _ = self.linear_fc2(self.activation_func(intermediate))  # [s, b, h] ([s/t, b, h] under SP)
        return output
