"""Causal self-attention: fused QKV projection, masked-softmax dot-product attention, output projection.

Notation: s sequence, b batch, h hidden, np attention heads, hn head dim (kv_channels), t the
tensor-parallel size. Each tensor-parallel rank holds np/t whole heads: its rows of linear_qkv
(column parallel) and its columns of linear_proj (row parallel, whose output is summed over the
ranks). Under sequence parallelism the layer's input and output are [s/t, b, h].
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, divide
from megatron.model.layers import tensor_parallel_dropout_context
from megatron.model.module import MegatronModule
from megatron.model.transformer_config import TransformerConfig
from megatron.model.utils import attention_mask_func


class DotProductAttention(MegatronModule):
    """softmax(q k^T / sqrt(hn) + mask) v, with Megatron's query-key layer scaling.

    With apply_query_key_layer_scaling the scores are divided by coeff = layer_number before
    the softmax (keeping fp16 scores of deep layers in range) and multiplied back by coeff
    inside the fp32 softmax: the same function, different rounding. Has no parameters.
    """

    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__(config)
        self.layer_number = max(1, layer_number)
        self.norm_factor = math.sqrt(config.kv_channels)
        self.softmax_scale: float | None = None
        if config.apply_query_key_layer_scaling:
            self.softmax_scale = float(self.layer_number)
            self.norm_factor *= self.softmax_scale
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def scale_mask_softmax(self, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Softmax over the last dim of scores [b, np, sq, sk]; mask True = masked out."""
        input_dtype = scores.dtype
        if self.config.attention_softmax_in_fp32:
            scores = scores.float()
        if self.softmax_scale is not None:
            scores = scores * self.softmax_scale
        if mask is not None:
            scores = attention_mask_func(scores, mask)
        probs = torch.softmax(scores, dim=-1)
        return probs.to(input_dtype)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        sq, b, np_, hn = query.shape  # [sq, b, np/t, hn]
        q = query.permute(1, 2, 0, 3)  # [sq, b, np, hn] -> [b, np, sq, hn]
        k = key.permute(1, 2, 3, 0)  # [sk, b, np, hn] -> [b, np, hn, sk]
        v = value.permute(1, 2, 0, 3)  # [sk, b, np, hn] -> [b, np, sk, hn]
        scores = torch.matmul(q, k) * (1.0 / self.norm_factor)  # [b, np, sq, sk]
        # attention_mask [b or 1, 1, sq, sk] broadcasts over the heads.
        probs = self.scale_mask_softmax(scores, attention_mask)  # [b, np, sq, sk]
        with tensor_parallel_dropout_context(partitioned=True):  # this rank's heads only
            probs = self.attention_dropout(probs)
        context = torch.matmul(probs, v)  # [b, np, sq, hn]
        context = context.permute(2, 0, 1, 3)  # [b, np, sq, hn] -> [sq, b, np, hn]
        return context.reshape(sq, b, np_ * hn)  # [sq, b, np * hn]


class SelfAttention(MegatronModule):
    """[s, b, h] -> [s, b, h]. State-dict keys: linear_qkv.{weight,bias}, linear_proj.{weight,bias}.

    linear_qkv rows are in [np, 3, hn] order (for each head its q, k and v blocks), Megatron's
    checkpoint_version >= 2.0 layout: a tensor-parallel shard of whole heads is then one
    contiguous block of rows. HF GPT-2 uses [3, np, hn] instead (see FORMATS.md sec. 10).
    """

    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.hidden_size_per_attention_head = config.kv_channels
        projection_size = config.kv_channels * config.num_attention_heads
        bias = config.add_bias_linear
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, 3 * projection_size, config=config,
                                               init_method=config.init_method, bias=bias, gather_output=False)
        self.core_attention = DotProductAttention(config, layer_number)
        self.linear_proj = RowParallelLinear(projection_size, config.hidden_size, config=config,
                                             init_method=config.output_layer_init_method, bias=bias,
                                             input_is_parallel=True)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        np_, hn = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        mixed_qkv, _ = self.linear_qkv(hidden_states)  # [s, b, np/t * 3 * hn] (s whole, also under SP)
        s, b, _ = mixed_qkv.shape
        mixed_qkv = mixed_qkv.view(s, b, np_, 3 * hn)  # [s, b, np/t, 3 * hn]
        query, key, value = torch.split(mixed_qkv, hn, dim=-1)  # 3 x [s, b, np/t, hn]
        context = self.core_attention(query, key, value, attention_mask)  # [s, b, np/t * hn]
        output, _ = self.linear_proj(context)  # [s, b, h], or [s/t, b, h] under SP
        return output
