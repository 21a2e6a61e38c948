"""LayerNorm, Dropout, the dropout rule of the tensor-parallel model, and which fused-op
implementation the model asks for.

The linear layers are megatron.core.tensor_parallel's ColumnParallelLinear / RowParallelLinear.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron import fused_kernels
from megatron.core import parallel_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.model.transformer_config import TransformerConfig


def fused_impl(config: TransformerConfig, tensor: torch.Tensor) -> str | None:
    """The impl= the model passes to a fused op on `tensor`: config.fused_kernels_cpu_impl on CPU
    (so tests and tiny runs skip torch.compile's start-up unless asked for it), None elsewhere:
    the package's own choice (Triton on CUDA), which force_implementation / MEGATRON_FUSED_IMPL
    can still override."""
    return config.fused_kernels_cpu_impl if tensor.device.type == "cpu" else None


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm through fused_kernels.layer_norm: statistics in fp32, output in the parameters' dtype.

    With fp32_residual_connection the residual stream is fp32 while the weights are fp16/bf16:
    the input is normalised in fp32 and the output handed to the half-precision layer that
    follows (the mixed-dtype behaviour of apex's MixedFusedLayerNorm in Megatron). The CPU
    reference is F.layer_norm's own kernel in fp32 (the same bits as F.layer_norm for fp32
    inputs); Megatron's --no-persist-layer-norm picks between two apex kernels and changes
    nothing here.

    Under sequence parallelism each tensor-parallel rank normalises its own s/t tokens, so the
    weight and bias gradients are partial sums: they carry `sequence_parallel = True` and are
    all-reduced over the tensor-parallel group before the optimizer step (finalize_model_grads).
    """

    def __init__(self, hidden_size: int, config: TransformerConfig) -> None:
        super().__init__(hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel
        self.bias.sequence_parallel = config.sequence_parallel
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fused_kernels.layer_norm(x, self.weight, self.bias, self.eps, impl=fused_impl(self.config, x))
        return y.to(self.weight.dtype)  # [..., h], x's dtype -> the parameters'


class _DropoutKeepingBoolMask(torch.autograd.Function):
    """F.dropout as it runs on CPU -- noise = empty_like(x).bernoulli_(1 - p) / (1 - p), out = x * noise,
    the same draws and the same bits -- but saving a 1-byte mask for backward, not the noise."""

    @staticmethod
    def forward(ctx, x, p):
        noise = torch.empty_like(x).bernoulli_(1.0 - p)
        mask = noise.bool()
        ctx.p = p
        ctx.save_for_backward(mask)
        return x * noise.div_(1.0 - p)

    @staticmethod
    def backward(ctx, grad_output):
        (mask,) = ctx.saved_tensors
        return grad_output * mask.to(grad_output.dtype).div_(1.0 - ctx.p), None  # the forward's noise, rebuilt


class Dropout(nn.Dropout):
    """nn.Dropout whose backward keeps a bool mask (1 byte per element) on CPU too.

    On CUDA torch's fused dropout already saves a bool mask; on CPU F.dropout saves its noise
    in the input's dtype (2 bytes in bf16, 4 in fp32). Same masks and outputs as nn.Dropout
    (it draws exactly as F.dropout does), only the memory held for backward differs; that is
    the 1-byte mask the activation-memory formulas assume (docs/memory.md).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        p = self.p
        if (not self.training or p in (0.0, 1.0) or self.inplace or input.device.type != "cpu"
                or not (torch.is_grad_enabled() and input.requires_grad)):
            return F.dropout(input, p, self.training, self.inplace)
        return _DropoutKeepingBoolMask.apply(input, p)


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
