"""LayerNorm, and the dropout rule of the tensor-parallel model.

The linear layers are megatron.core.tensor_parallel's ColumnParallelLinear / RowParallelLinear.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import parallel_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.model.transformer_config import TransformerConfig


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that normalises in the input's dtype and returns the parameters' dtype.

    With fp32_residual_connection the residual stream is fp32 while the weights are fp16/bf16:
    the statistics are then taken in fp32 and the output handed to the half-precision layer
    that follows (the mixed-dtype behaviour of apex's MixedFusedLayerNorm in Megatron).

    Under sequence parallelism each tensor-parallel rank normalises its own s/t tokens, so the
    weight and bias gradients are partial sums: they carry `sequence_parallel = True` and are
    all-reduced over the tensor-parallel group before the optimizer step (finalize_model_grads).
    """

    def __init__(self, hidden_size: int, config: TransformerConfig) -> None:
        super().__init__(hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel
        self.bias.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight.to(x.dtype), self.bias.to(x.dtype)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps).to(self.weight.dtype)


def tensor_parallel_dropout_context(partitioned: bool) -> contextlib.AbstractContextManager:
    """Where a dropout draws its mask from.

    A tensor split across the tensor-parallel ranks (attention heads, or s/t of the sequence
    under sequence parallelism) needs a different mask on each rank: it draws from the
    "model-parallel-rng" stream, seeded per TP rank. A tensor replicated on every TP rank needs
    the same mask everywhere, so the replicas stay equal: it draws from the default generator,
    which every TP rank seeds alike. With one TP rank there is nothing to tell apart.
    """
    if partitioned and parallel_state.get_tensor_model_parallel_world_size() > 1:
        return get_cuda_rng_tracker().fork()
    return contextlib.nullcontext()
