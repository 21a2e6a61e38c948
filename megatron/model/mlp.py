"""The transformer's feed-forward block: h -> ffn_hidden_size -> GeLU -> h.

linear_fc1 is column parallel (each tensor-parallel rank computes ffn/t of the hidden units)
and linear_fc2 row parallel (the partial outputs are summed over the ranks), so the GeLU runs
on the local columns with no communication in between.

With bias_gelu_fusion (Megatron's default) linear_fc1 skips its bias add and
fused_kernels.bias_gelu computes gelu(x + bias) with the tanh approximation (on CPU with the
"native" implementation the bias joins fc1's GEMM and bias_gelu gets the sum) -- whichever GeLU
openai_gelu names, as Megatron does: the erf GeLU (the default activation) runs only with
--no-bias-gelu-fusion. The two GeLUs differ by up to ~5e-4 (docs/fused_kernels.md).
"""

from __future__ import annotations

import torch

from megatron import fused_kernels
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.model.layers import fused_impl
from megatron.model.module import MegatronModule
from megatron.model.transformer_config import TransformerConfig
from megatron.model.utils import erf_gelu, openai_gelu


class MLP(MegatronModule):
    """[s, b, h] -> ([s, b, h], bias). State-dict keys: linear_fc1.{weight,bias}, linear_fc2.{weight,bias}.

    forward returns linear_fc2's (output, bias), as SelfAttention returns linear_proj's: the bias
    is left to the layer's fused bias-dropout-add with bias_dropout_fusion, else added here (None).
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        bias = config.add_bias_linear
        self.bias_gelu_fusion = config.bias_gelu_fusion  # both activations here are GeLU
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, config=config,
                                               init_method=config.init_method, bias=bias, gather_output=False,
                                               skip_bias_add=self.bias_gelu_fusion)
        self.activation_func = openai_gelu if config.openai_gelu else erf_gelu  # the unfused path's
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, config=config,
                                            init_method=config.output_layer_init_method, bias=bias,
                                            input_is_parallel=True, skip_bias_add=config.bias_dropout_fusion)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The CPU fast path adds fc1's bias inside its GEMM and hands bias_gelu the sum (bias None):
        # no separate add forward, no recomputed x + bias in backward (the same function).
        add_bias = True if self.bias_gelu_fusion and fused_impl(self.config, hidden_states) == "native" else None
        intermediate, fc1_bias = self.linear_fc1(hidden_states, add_bias=add_bias)  # [s, b, ffn/t], bias or None
        if self.bias_gelu_fusion:
            intermediate = fused_kernels.bias_gelu(intermediate, fc1_bias, impl=fused_impl(self.config, intermediate))
        else:
            intermediate = self.activation_func(intermediate)  # fc1 added its bias
        return self.linear_fc2(intermediate)  # ([s, b, h] or [s/t, b, h] under SP, bias [h] or None)
