"""The transformer's feed-forward block: h -> ffn_hidden_size -> activation -> h, optionally gated.

linear_fc1 is column parallel (each tensor-parallel rank computes ffn/t of the hidden units)
and linear_fc2 row parallel (the partial outputs are summed over the ranks), so the activation
runs on the local columns with no communication in between.

Activations (config.activation_func, config.gated_linear_unit; Megatron's flags):
    GeLU     the default. With bias_gelu_fusion (Megatron's default) linear_fc1 skips its bias add
             and fused_kernels.bias_gelu computes gelu(x + bias) with the tanh approximation (on
             CPU with the "native" implementation the bias joins fc1's GEMM and bias_gelu gets the
             sum) -- whichever GeLU openai_gelu names, as Megatron does: the erf GeLU runs only
             with --no-bias-gelu-fusion. The two GeLUs differ by up to ~5e-4 (docs/fused_kernels.md).
    SwiGLU   --swiglu: gated_linear_unit with F.silu. linear_fc1 has 2 ffn rows, on each TP rank
             [gate ; up] of its ffn/t units (drawn from the full [2 ffn, h] weight with stride 2,
             so the model is the same at every t); y = silu(gate) * up, with bias_swiglu_fusion
             through fused_kernels.bias_swiglu.
    other    any activation_func (squared ReLU: --squared-relu), gated or not, in PyTorch ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron import fused_kernels
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.model.layers import fused_impl
from megatron.model.module import MegatronModule
from megatron.model.spec import ModuleSpec, build_module
from megatron.model.transformer_config import TransformerConfig
from megatron.model.utils import openai_gelu


@dataclass
class MLPSubmodules:
    linear_fc1: ModuleSpec | type = ColumnParallelLinear
    linear_fc2: ModuleSpec | type = RowParallelLinear


def _is_gelu(activation) -> bool:
    return activation is F.gelu or activation is openai_gelu


class MLP(MegatronModule):
    """[s, b, h] -> ([s, b, h], bias). State-dict keys: linear_fc1.{weight,bias}, linear_fc2.{weight,bias}.

    forward returns linear_fc2's (output, bias), as SelfAttention returns linear_proj's: the bias
    is left to the layer's fused bias-dropout-add with bias_dropout_fusion, else added here (None).
    ffn_hidden_size overrides the config's (e.g. for an expert or a shared expert).
    """

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules | None = None,
                 ffn_hidden_size: int | None = None) -> None:
        super().__init__(config)
        submodules = submodules or MLPSubmodules()
        ffn = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        bias, gated, activation = config.add_bias_linear, config.gated_linear_unit, config.activation_func
        self.gated = gated
        self.activation_func = activation
        if gated:
            self.fused_activation = "swiglu" if activation is F.silu and config.bias_swiglu_fusion else None
        else:
            self.fused_activation = "gelu" if _is_gelu(activation) and config.bias_gelu_fusion else None
        self.linear_fc1 = build_module(submodules.linear_fc1, config.hidden_size, 2 * ffn if gated else ffn,
                                       config=config, init_method=config.init_method, bias=bias, gather_output=False,
                                       skip_bias_add=self.fused_activation is not None, stride=2 if gated else 1)
        self.linear_fc2 = build_module(submodules.linear_fc2, ffn, config.hidden_size, config=config,
                                       init_method=config.output_layer_init_method, bias=bias,
                                       input_is_parallel=True, skip_bias_add=config.bias_dropout_fusion)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        impl = fused_impl(self.config, hidden_states)
        # The CPU fast path adds fc1's bias inside its GEMM and hands the fused activation the sum
        # (bias None): no separate add forward, no recomputed x + bias in backward (the same function).
        add_bias = True if self.fused_activation is not None and impl == "native" else None
        intermediate, fc1_bias = self.linear_fc1(hidden_states, add_bias=add_bias)  # [s, b, (2) ffn/t], bias or None
        if self.fused_activation == "gelu":
            intermediate = fused_kernels.bias_gelu(intermediate, fc1_bias, impl=impl)
        elif self.fused_activation == "swiglu":
            intermediate = fused_kernels.bias_swiglu(intermediate, fc1_bias, impl=impl)
        elif self.gated:
            gate, up = torch.chunk(intermediate, 2, dim=-1)  # [s, b, ffn/t] each: this rank's [gate ; up]
            intermediate = self.activation_func(gate) * up
        else:
            intermediate = self.activation_func(intermediate)  # fc1 added its bias
        return self.linear_fc2(intermediate)  # ([s, b, h] or [s/t, b, h] under SP, bias [h] or None)
