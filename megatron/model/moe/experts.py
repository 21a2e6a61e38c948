"""The experts of this rank: E/EP feed-forward networks, each split over the expert tensor-parallel group.

Keys (megatron-core's SequentialMLP, local spec): local_experts.{i}.linear_fc1.weight
[(2) ffn/etp, h] and local_experts.{i}.linear_fc2.weight [h, ffn/etp], with add_bias_linear
linear_fc1.bias [(2) ffn/etp] (this rank's rows, as the weight's) and linear_fc2.bias [h] (whole on
every ETP rank, as a RowParallelLinear's); i the local index: global expert ep_rank * E/EP + i.
A gated expert (SwiGLU) holds [gate ; up] of its ffn/etp units in fc1, as the dense MLP does per
TP rank, so the experts are the same functions at every ETP.

Experts do no communication: the token dispatcher hands each rank the tokens of its experts
(gathered over the expert tensor-parallel group) and sums the partial fc2 outputs afterwards.
So that the sum holds the fc2 bias once, only expert-TP rank 0 adds it (the dispatcher then
weights bias and all by the token's router probability, as megatron-core's ETP = 1 experts do);
its gradient, the sum of the output gradient rows, is the same on every ETP rank (they all hold
the gradient of the summed output), so each rank computes it and the copies stay equal.

Every expert is drawn from its own random stream seeded by the layer's stream and its global
index, in full, before this rank keeps its ETP slice: the experts of a model are the same
whatever EP and ETP build them. Their parameters carry allreduce = False (gradients are reduced
over the expert-data-parallel group) and expert_parallel = True, and are marked
tensor_model_parallel over the expert tensor-parallel group, but for the fc2 bias: whole on every
ETP rank, a replica that grad norms and parameter counts take from ETP rank 0 only.

forward(x [N, h] sorted by local expert, counts [E/EP]) -> [N, h]. With moe_grouped_gemm the
local experts run as one grouped matmul (torch's grouped_mm over the stacked weights where the
shapes allow it, else a batched matmul over the experts' token lists padded to the longest);
without it one pair of matmuls per expert. The parameters, and so the checkpoints, are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import parallel_state
from megatron.model.module import MegatronModule
from megatron.model.transformer_config import TransformerConfig


def _expert_tp() -> tuple[int, int]:
    """(rank, size) in the expert tensor-parallel group."""
    return (parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size())


def _mark_expert(param: nn.Parameter, partition_dim: int | None, stride: int = 1) -> None:
    """partition_dim None: the param is whole on every ETP rank (a row-parallel bias)."""
    param.allreduce = False
    param.expert_parallel = True
    param.tensor_model_parallel = partition_dim is not None
    if partition_dim is not None:
        param.partition_dim = partition_dim
        param.partition_stride = stride


class _AddOnFirstRank(torch.autograd.Function):
    """x + bias on expert-TP rank 0, x elsewhere; the backward gives every rank bias's whole
    gradient (see the module docstring: every ETP rank holds the same gradient of x)."""

    @staticmethod
    def forward(ctx, x, bias, first):
        ctx.bias_shape = bias.shape
        return x + bias if first else x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.sum_to_size(ctx.bias_shape), None


def add_row_parallel_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x (an ETP partial sum) + bias (broadcast), counted once in the sum over the ETP group."""
    rank, size = _expert_tp()
    if size == 1:
        return x + bias
    return _AddOnFirstRank.apply(x, bias, rank == 0)


class ExpertLinear(nn.Module):
    """One expert linear: weight [out_local, in] (this ETP rank's rows or columns of the full one).
    A column-parallel one (partition_dim 0) holds its bias's rows; a row-parallel one (partition_dim
    1) the whole bias, added once over the ETP group (add_row_parallel_bias)."""

    def __init__(self, weight: torch.Tensor, partition_dim: int, stride: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        _mark_expert(self.weight, partition_dim, stride)
        self.row_parallel = partition_dim == 1
        if bias is not None:
            self.bias = nn.Parameter(bias)
            _mark_expert(self.bias, None if self.row_parallel else 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None and self.row_parallel and _expert_tp()[1] > 1:
            return add_row_parallel_bias(F.linear(x, self.weight), self.bias)
        return F.linear(x, self.weight, self.bias)


def _slice(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """This rank's part of `full` along dim: blocks rank, rank + size, ... of size * stride blocks."""
    blocks = torch.chunk(full, size * stride, dim=dim)
    return torch.cat(blocks[rank::size], dim=dim).contiguous()


class ExpertMLP(MegatronModule):
    """One expert: h -> (2) ffn/etp -> activation -> h (a partial sum over the ETP ranks)."""

    def __init__(self, config: TransformerConfig, ffn_hidden_size: int, seed: int | None) -> None:
        super().__init__(config)
        h, gated = config.hidden_size, config.gated_linear_unit
        rank, size = _expert_tp()
        stride = 2 if gated else 1
        fc1 = torch.empty((2 if gated else 1) * ffn_hidden_size, h, dtype=torch.float32)
        fc2 = torch.empty(h, ffn_hidden_size, dtype=torch.float32)
        if config.perform_initialization:
            with torch.random.fork_rng(devices=[]):
                if seed is not None:
                    torch.manual_seed(seed)
                config.init_method(fc1)
                config.output_layer_init_method(fc2)
        dtype, bias = config.params_dtype, config.add_bias_linear
        self.linear_fc1 = ExpertLinear(_slice(fc1, 0, stride, rank, size).to(dtype), 0, stride,
                                       torch.zeros(fc1.shape[0] // size, dtype=dtype) if bias else None)
        self.linear_fc2 = ExpertLinear(_slice(fc2, 1, 1, rank, size).to(dtype), 1, 1,
                                       torch.zeros(h, dtype=dtype) if bias else None)

    def activation(self, intermediate: torch.Tensor) -> torch.Tensor:
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(intermediate, 2, dim=-1)
            return self.config.activation_func(gate) * up
        return self.config.activation_func(intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(x)))


class SequentialMLP(MegatronModule):
    """This rank's local experts (keys local_experts.{i}.*); see the module docstring."""

    def __init__(self, config: TransformerConfig, num_local_experts: int, first_expert: int,
                 seed: int | None = None) -> None:
        super().__init__(config)
        self.num_local_experts = num_local_experts
        self.local_experts = nn.ModuleList([
            ExpertMLP(config, config.moe_ffn_hidden_size,
                      None if seed is None else (seed * 1_000_003 + first_expert + i) % (2**63))
            for i in range(num_local_experts)])

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [N, h] grouped by local expert (counts[i] rows of expert i, in order) -> [N, h]."""
        if self.config.moe_grouped_gemm and self.num_local_experts > 1:
            return self._grouped(x, counts)
        # Every expert runs, also on zero tokens: its parameters then get a zero gradient, never None.
        outputs = [expert(part) for expert, part in zip(self.local_experts, torch.split(x, counts))]
        return torch.cat(outputs) if outputs else x

    def _grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [n, (2) f, h]
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [n, h, f]
        bias1 = bias2 = None
        if self.config.add_bias_linear:
            bias1 = torch.stack([e.linear_fc1.bias for e in self.local_experts])
            bias2 = torch.stack([e.linear_fc2.bias for e in self.local_experts])
        expert = self.local_experts[0]
        if _grouped_mm_applies(x, fc1, fc2):
            offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
            index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
            hidden = _grouped_mm(x, fc1.transpose(1, 2), offsets)  # [N, (2) f]
            if bias1 is not None:
                hidden = hidden + bias1[index]
            out = _grouped_mm(expert.activation(hidden), fc2.transpose(1, 2), offsets)  # [N, h]
            return add_row_parallel_bias(out, bias2[index]) if bias2 is not None else out
        # Batched: [n, longest, h] with each expert's rows first and zeros after them.
        longest = max(counts) if counts else 0
        padded = x.new_zeros(len(counts), longest, x.shape[-1])
        mask = torch.arange(longest).unsqueeze(0) < torch.tensor(counts).unsqueeze(1)  # [n, longest]
        padded = padded.masked_scatter(mask.unsqueeze(-1), x)
        hidden = torch.bmm(padded, fc1.transpose(1, 2))
        if bias1 is not None:
            hidden = hidden + bias1.unsqueeze(1)
        out = torch.bmm(expert.activation(hidden), fc2.transpose(1, 2))
        if bias2 is not None:
            out = add_row_parallel_bias(out, bias2.unsqueeze(1))
        return out[mask]


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient: grouped_mm's backward refuses the
    expanded (stride 0) gradient a .sum() produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_mm(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(F.grouped_mm(x, weights, offs=offsets))


def _grouped_mm_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """torch's grouped_mm wants 16-byte aligned rows (and on CPU fp32/bf16 tensors)."""
    if not hasattr(F, "grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    step = 16 // x.element_size()
    return all(dim % step == 0 for w in weights for dim in w.shape[1:])
