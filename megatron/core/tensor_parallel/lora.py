"""LoRA adapters on the tensor-parallel linear layers: y = W x + (alpha / r) B A dropout(x).

    base layer            W on one of t ranks   A (linear_in)           B (linear_out)
    ColumnParallelLinear  [out/t, in]           [r, in] replicated      [out/t, r] split by rows (as W)
    RowParallelLinear     [out, in/t]           [r, in/t] split by cols [out, r] replicated

A is drawn as PEFT draws lora_A (kaiming-uniform, a = sqrt(5), over the full [r, in]) and B starts
at zero, so a fresh adapter leaves the model unchanged; scaling alpha / r is PEFT's (no rsLoRA).
The adapter is the base layer's submodule `adapter` (state-dict keys `<layer>.adapter.linear_in.weight`
and `<layer>.adapter.linear_out.weight`, Megatron-Bridge's names); the base layer adds its output.

Gradients of the replicated pieces (why no extra reduction is needed after backward):
  column  h = A x is replicated; it enters the TP region through copy_to_tensor_model_parallel_region,
          whose backward all-reduces dh = sum over ranks of B_local^T g_local ([s, b, r], small). Every
          rank then holds the whole dA, and the same dx, which therefore joins x's gradient outside
          the base layer's own all-reduce (the adapter reads the layer's input before that copy).
          Under sequence parallelism x is all-gathered with a backward that only splits.
  row     h = A_local x_local is a partial sum, summed over the ranks (all-reduce; reduce-scatter to
          [s/t, b, r] under sequence parallelism), then B h. Without SP every rank sees the whole
          replicated output gradient, so dB is whole; under SP each rank's dB covers its s/t tokens,
          so B carries `sequence_parallel = True` and finalize_model_grads sums it over TP, as it
          does for the layer norms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.tensor_parallel.utils import divide

# Megatron-Bridge's target names: the attention's fused QKV and output projections, the MLP's two layers.
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class LoRAConfig:
    """rank r, alpha (scaling alpha / r), dropout on the adapter's input, the targeted module names."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default=LORA_TARGETS)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def draw_lora_a(rank: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """The full A [r, in] in fp32 as PEFT initialises lora_A (nn.Linear's kaiming-uniform, a = sqrt(5))."""
    a = torch.empty(rank, in_features, dtype=torch.float32)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a


class _Adapter(nn.Module):
    def __init__(self, a_shape: tuple[int, int], b_shape: tuple[int, int], config: LoRAConfig,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.rank, self.scaling, self.dropout = config.rank, config.scaling, config.dropout
        self.linear_in = nn.Module()
        self.linear_in.weight = nn.Parameter(torch.empty(*a_shape, dtype=dtype))  # A
        self.linear_out = nn.Module()
        self.linear_out.weight = nn.Parameter(torch.zeros(*b_shape, dtype=dtype))  # B

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scaling={self.scaling}, dropout={self.dropout}"


class ColumnParallelLoRA(_Adapter):
    """The adapter of a ColumnParallelLinear: A [r, in] replicated, B [out/t, r] this rank's rows.

    forward(input_) takes the base layer's input ([s, b, in], or [s/t, b, in] under sequence
    parallelism) and returns this rank's [s, b, out/t], to add to the base layer's partial output.
    """

    def __init__(self, base: nn.Module, config: LoRAConfig, full_a: torch.Tensor) -> None:
        if getattr(base.weight, "partition_rows", None) is not None:
            raise ValueError("LoRA on a linear_qkv whose key/value heads are replicated over the tensor-parallel "
                             "ranks (fewer query groups than ranks) is not supported")
        out_local, in_features = base.weight.shape
        super().__init__((config.rank, in_features), (out_local, config.rank), config, base.weight.dtype)
        self.sequence_parallel = base.sequence_parallel
        with torch.no_grad():
            self.linear_in.weight.copy_(full_a)
        set_tensor_model_parallel_attributes(self.linear_in.weight, False, -1, 1)
        set_tensor_model_parallel_attributes(self.linear_out.weight, True, 0, base.weight.partition_stride)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            # [s/t, b, in] -> [s, b, in]; the adapter's dx is the same on every rank: backward only splits
            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False)
        x = F.dropout(input_, self.dropout, self.training) if self.dropout > 0 else input_  # replicated: one mask
        h = F.linear(x, self.linear_in.weight)  # [s, b, r], the same on every rank
        h = copy_to_tensor_model_parallel_region(h)  # backward: dh summed over the ranks' output rows
        return F.linear(h, self.linear_out.weight) * self.scaling  # [s, b, out/t]


class RowParallelLoRA(_Adapter):
    """The adapter of a RowParallelLinear: A [r, in/t] this rank's columns, B [out, r] replicated.

    forward(input_parallel [s, b, in/t]) returns [s, b, out] ([s/t, b, out] under sequence
    parallelism), to add to the base layer's reduced output.
    """

    def __init__(self, base: nn.Module, config: LoRAConfig, full_a: torch.Tensor) -> None:
        out_features, in_local = base.weight.shape
        super().__init__((config.rank, in_local), (out_features, config.rank), config, base.weight.dtype)
        self.sequence_parallel = base.sequence_parallel
        t = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        width = divide(full_a.shape[1], t)
        with torch.no_grad():
            self.linear_in.weight.copy_(full_a[:, rank * width:(rank + 1) * width])  # [r, in/t]
        set_tensor_model_parallel_attributes(self.linear_in.weight, True, 1, 1)
        set_tensor_model_parallel_attributes(self.linear_out.weight, False, -1, 1)
        self.linear_out.weight.sequence_parallel = self.sequence_parallel

    def forward(self, input_parallel: torch.Tensor) -> torch.Tensor:
        x = input_parallel
        if self.dropout > 0 and self.training:
            if parallel_state.get_tensor_model_parallel_world_size() > 1:
                with get_cuda_rng_tracker().fork():  # each rank's columns get their own mask
                    x = F.dropout(x, self.dropout, True)
            else:
                x = F.dropout(x, self.dropout, True)
        h = F.linear(x, self.linear_in.weight)  # [s, b, r], partial over the ranks
        if self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h)  # [s/t, b, r]
        else:
            h = reduce_from_tensor_model_parallel_region(h)  # [s, b, r]
        return F.linear(h, self.linear_out.weight) * self.scaling  # [s, b, out] or [s/t, b, out]
