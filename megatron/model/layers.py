"""Normalisations (LayerNorm, RMSNorm and the `Norm` the config names), Dropout, the dropout rule
of the tensor-parallel model, and the fused-op implementation the model asks for.

The linear layers are megatron.core.tensor_parallel's ColumnParallelLinear / RowParallelLinear.
Which kernel runs for a tensor on which device is megatron.fused_kernels.backend's choice.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megatron import fused_kernels
from megatron.core import parallel_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.fused_kernels import backend
from megatron.model.transformer_config import TransformerConfig


def fused_impl(config: TransformerConfig, tensor: torch.Tensor) -> str | None:
    """The impl= the model passes to a fused op on `tensor` (fused_kernels.backend.implementation
    of config.fused_kernels_cpu_impl)."""
    return backend.implementation(config.fused_kernels_cpu_impl, tensor)


class _Norm(nn.Module):
    """Shared by LayerNorm and RMSNorm: the config, the weight (and bias), their SP marks.

    With layernorm_zero_centered_gamma (--apply-layernorm-1p) the stored weight is gamma - 1: it
    starts at zero and the norm multiplies by 1 + weight (Megatron's LayerNorm1P). Under
    sequence parallelism each tensor-parallel rank normalises its own s/t tokens, so the weight
    and bias gradients are partial sums: they carry `sequence_parallel = True` and are
    all-reduced over the tensor-parallel group before the optimizer step (finalize_model_grads).
    """

    def __init__(self, hidden_size: int, config: TransformerConfig, eps: float | None = None,
                 bias: bool = True) -> None:
        super().__init__()
        self.config = config
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        start = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(start(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
            self.bias.sequence_parallel = config.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered_gamma else self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """LayerNorm through fused_kernels.layer_norm: statistics in fp32, output in the parameters' dtype.

    State-dict keys weight, bias (nn.LayerNorm's). With fp32_residual_connection the residual
    stream is fp32 while the weights are fp16/bf16: the input is normalised in fp32 and the output
    handed to the half-precision layer that follows (the mixed-dtype behaviour of apex's
    MixedFusedLayerNorm in Megatron). The CPU reference is F.layer_norm's own kernel in fp32.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fused_kernels.layer_norm(x, self.gamma(), self.bias, self.eps, impl=fused_impl(self.config, x))
        return y.to(self.weight.dtype)  # [..., h], x's dtype -> the parameters'


class RMSNorm(_Norm):
    """x / sqrt(mean(x^2) + eps) * weight through fused_kernels.rms_norm (Llama's norm). Key: weight."""

    def __init__(self, hidden_size: int, config: TransformerConfig, eps: float | None = None) -> None:
        super().__init__(hidden_size, config, eps, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fused_kernels.rms_norm(x, self.gamma(), self.eps, impl=fused_impl(self.config, x))
        return y.to(self.weight.dtype)


def Norm(hidden_size: int, config: TransformerConfig, eps: float | None = None) -> _Norm:  # noqa: N802 (a class-like factory)
    """The normalisation config.normalization names ("LayerNorm" or "RMSNorm"), Megatron-Core's LNImpl."""
    norm_class = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return norm_class(hidden_size, config, eps)


class Dropout(nn.Dropout):
    """nn.Dropout whose backward keeps a bool mask (1 byte per element) on every device: the
    1-byte mask the activation-memory formulas assume (docs/memory.md; fused_kernels.backend.dropout)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return super().forward(input)
        return backend.dropout(input, self.p, self.training)


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
