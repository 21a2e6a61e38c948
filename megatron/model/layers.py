"""The model's two parameterised building blocks: Linear and LayerNorm.

Linear is where tensor parallelism will enter: a later issue swaps `linear_qkv` / `linear_fc1`
for ColumnParallelLinear and `linear_proj` / `linear_fc2` for RowParallelLinear; the
transformer code calling them stays the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.transformer_config import TransformerConfig


class Linear(nn.Module):
    """y = x W^T + b with W [output_size, input_size], created in config.params_dtype.

    W is drawn by `init_method` when config.perform_initialization (otherwise left
    uninitialised, to be loaded from a checkpoint); the bias always starts at zero.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], torch.Tensor],
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"input_size={self.input_size}, output_size={self.output_size}, bias={self.bias is not None}"


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that normalises in the input's dtype and returns the parameters' dtype.

    With fp32_residual_connection the residual stream is fp32 while the weights are fp16/bf16:
    the statistics are then taken in fp32 and the output handed to the half-precision layer
    that follows (the mixed-dtype behaviour of apex's MixedFusedLayerNorm in Megatron).
    """

    def __init__(self, hidden_size: int, config: TransformerConfig) -> None:
        super().__init__(hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight.to(x.dtype), self.bias.to(x.dtype)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps).to(self.weight.dtype)
