"""Self-attention: fused QKV projection (grouped by query group), core attention, output projection.

Notation: s sequence, b batch, h hidden, np attention heads, ng query groups (num_query_groups:
np for multi-head attention, 1 for multi-query attention), hn head dim (kv_channels), t the
tensor-parallel size. The rows of linear_qkv are Megatron-Core's: per query group its np/ng query
heads, then its key head, then its value head, ng (np/ng + 2) hn rows in all -- with ng = np the
[np, 3, hn] layout of Megatron's checkpoint_version >= 2.0.

Each tensor-parallel rank holds np/t whole query heads: its rows of linear_qkv (column parallel)
and its columns of linear_proj (row parallel, whose output is summed over the ranks). When t
divides ng a rank holds ng/t whole groups, a contiguous block of rows. With fewer groups than
ranks (t = r ng, multi-query attention under TP) each group's key and value heads are replicated
on the r ranks that hold its query heads: a rank's rows are its np/t query heads followed by its
group's K and V (qkv_partition_rows), and the gradients of those replicated rows are summed over
the r ranks before the optimizer step (finalize_model_grads.allreduce_replicated_kv_grads). Under
sequence parallelism the layer's input and output are [s/t, b, h].

The core attention, softmax(q k^T / sqrt(hn) + bias, masked) v, is a slot of the layer spec:
    DotProductAttention       Megatron's: two matmuls around a scale-mask-softmax, which is
                              fused_kernels.scale_mask_softmax with masked_softmax_fusion (the
                              default), else plain PyTorch ops (the reference); on CPU the fast path
                              runs it as one node (fused_kernels.backend.fast_attention_core)
    FlashDotProductAttention  --use-flash-attn: flash-attn on CUDA, else torch's SDPA
With recompute_granularity "selective" the core attention is rerun in backward
(tensor_parallel.checkpoint): its s^2 activations (scores, probabilities, dropout mask) are not kept.
Rotary embeddings rotate q and k after the projection (and after q/k layer norms); ALiBi arrives
as an additive bias of this rank's heads. Under context parallelism (context_parallel_size > 1)
s is this CP rank's s/N tokens and the core attention runs inside
context_parallel_attention.context_parallel_attention, which brings the other ranks' keys and
values by the layer's cp_comm_type (p2p ring, allgather, a2a, a2a+p2p).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch

from megatron import fused_kernels
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, divide
from megatron.fused_kernels import backend
from megatron.model.context_parallel_attention import context_parallel_attention
from megatron.model.layers import Dropout, fused_impl, tensor_parallel_dropout_context
from megatron.model.module import MegatronModule
from megatron.model.positions import apply_rotary_pos_emb
from megatron.model.spec import ModuleSpec, build_module
from megatron.model.transformer_config import TransformerConfig
from megatron.model.utils import attention_mask_func


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v [s, b, ng, hn] -> [s, b, np, hn], each group's head repeated for its np/ng query heads."""
    groups = x.shape[2]
    return x if groups == heads else x.repeat_interleave(heads // groups, dim=2)


class DotProductAttention(MegatronModule):
    """softmax(q k^T / sqrt(hn) + bias, masked) v, with Megatron's query-key layer scaling. No parameters.

    forward(query [sq, b, np/t, hn], key and value [sk, b, ng/t, hn], attention_mask, is_causal,
    attention_bias [1 or b, np/t, sq, sk] or None) -> context [sq, b, np/t * hn].
    With apply_query_key_layer_scaling the scores are divided by coeff = layer_number before
    the softmax (keeping fp16 scores of deep layers in range) and multiplied back by coeff
    inside the fp32 softmax: the same function, different rounding.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attention_scale: float | None = None) -> None:
        """attention_scale: the factor of q k^T, default 1/sqrt(hn); HF T5 uses 1.0 (the 1/sqrt(hn)
        is folded into its query init). A non-default scale skips the CPU fast path (which assumes
        1/sqrt(hn)) and runs the two matmuls."""
        super().__init__(config)
        self.layer_number = max(1, layer_number)
        self.custom_scale = attention_scale is not None
        self.norm_factor = math.sqrt(config.kv_channels) if attention_scale is None else 1.0 / attention_scale
        self.softmax_scale: float | None = None
        if config.apply_query_key_layer_scaling:
            self.softmax_scale = float(self.layer_number)
            self.norm_factor *= self.softmax_scale
        self.attention_dropout = Dropout(config.attention_dropout)

    def scale_mask_softmax(self, scores: torch.Tensor, mask: torch.Tensor | None,
                           is_causal: bool = False) -> torch.Tensor:
        """Softmax over the last dim of scores [b, np, sq, sk]; mask True = masked out.

        With masked_softmax_fusion: fused_kernels.scale_mask_softmax, in fp32 whatever
        attention_softmax_in_fp32 says and with all-zero rows where every key is masked (as
        Megatron's fused kernel); is_causal (mask is the plain causal mask) lets it skip reading
        the mask. Otherwise Megatron's unfused path (fully masked rows: 1/sk).
        """
        if self.config.masked_softmax_fusion:
            scale = self.softmax_scale or 1.0  # the 1/sqrt(hn) is already in the scores
            return fused_kernels.scale_mask_softmax(scores, None if is_causal else mask, scale, causal=is_causal,
                                                    impl=fused_impl(self.config, scores))
        input_dtype = scores.dtype
        if self.config.attention_softmax_in_fp32:
            scores = scores.float()
        if self.softmax_scale is not None:
            scores = scores * self.softmax_scale
        if mask is not None:
            scores = attention_mask_func(scores, mask)
        probs = torch.softmax(scores, dim=-1)
        return probs.to(input_dtype)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, is_causal: bool = False,
                attention_bias: torch.Tensor | None = None) -> torch.Tensor:
        sq, b, np_, hn = query.shape  # [sq, b, np/t, hn]
        if attention_bias is None and self.config.masked_softmax_fusion and not self.custom_scale:
            context = backend.fast_attention_core(  # takes K/V per group: [sk, b, ng/t, hn]
                query, key, value, attention_mask, is_causal, cpu_impl=self.config.fused_kernels_cpu_impl,
                dropout_active=self.training and self.attention_dropout.p > 0)
            if context is not None:
                return context  # [sq, b, np/t * hn]
        key, value = _repeat_kv(key, np_), _repeat_kv(value, np_)  # [sk, b, np/t, hn]
        q = query.permute(1, 2, 0, 3)  # [sq, b, np, hn] -> [b, np, sq, hn]
        k = key.permute(1, 2, 3, 0)  # [sk, b, np, hn] -> [b, np, hn, sk]
        v = value.permute(1, 2, 0, 3)  # [sk, b, np, hn] -> [b, np, sk, hn]
        scores = torch.matmul(q, k) * (1.0 / self.norm_factor)  # [b, np, sq, sk]
        if attention_bias is not None:  # in the scale of the scores (divided by the layer-scaling coeff)
            scale = self.softmax_scale or 1.0
            scores = scores + (attention_bias / scale).to(scores.dtype)
        # attention_mask [b or 1, 1, sq, sk] broadcasts over the heads.
        probs = self.scale_mask_softmax(scores, attention_mask, is_causal)  # [b, np, sq, sk]
        with tensor_parallel_dropout_context(partitioned=True):  # this rank's heads only
            probs = self.attention_dropout(probs)
        context = torch.matmul(probs, v)  # [b, np, sq, hn]
        context = context.permute(2, 0, 1, 3)  # [b, np, sq, hn] -> [sq, b, np, hn]
        return context.reshape(sq, b, np_ * hn)  # [sq, b, np * hn]


class FlashDotProductAttention(MegatronModule):
    """DotProductAttention's function through a fused kernel (--use-flash-attn). No parameters.

    fused_kernels.backend.flash_attention: flash-attn when it applies (CUDA, half precision,
    causal or no mask), else torch's scaled_dot_product_attention, which takes any mask and
    grouped K/V. Equal to DotProductAttention within rounding with attention dropout 0, including
    rows whose keys are all masked (they average the values, as Megatron's -10000 fill makes them).

    Attention dropout > 0 is accepted and applied by the kernel, drawing from the device's
    generator in the tensor-parallel rank's own stream, as DotProductAttention does; a seed
    reproduces it and recompute restores it. The mask is the kernel's own: on CUDA (flash-attn,
    SDPA's flash / efficient kernels) not the unfused path's, so the same seed gives the same
    distribution but other numbers; on CPU torch's math backend happens to draw the same mask
    (docs/memory.md). ALiBi's bias is not supported here (use the default core attention).
    """

    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__(config)
        self.layer_number = max(1, layer_number)
        # Query-key layer scaling divides and multiplies back by the same coefficient: no effect here.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels)
        self.attention_dropout_p = config.attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, is_causal: bool = False,
                attention_bias: torch.Tensor | None = None) -> torch.Tensor:
        """q [s, b, np/t, hn], k, v [s, b, ng/t, hn] -> [s, b, np/t * hn]; is_causal: the mask is the causal one."""
        if attention_bias is not None:
            raise ValueError("--use-flash-attn does not take an attention bias (ALiBi): use the default core attention")
        sq, b, np_, hn = query.shape
        dropout_p = self.attention_dropout_p if self.training else 0.0
        rng = tensor_parallel_dropout_context(partitioned=True) if dropout_p > 0 else contextlib.nullcontext()
        with rng:  # this rank's heads only
            context = backend.flash_attention(query, key, value, attention_mask, is_causal, dropout_p=dropout_p,
                                              softmax_scale=self.softmax_scale)  # [sq, b, np, hn]
        return context.reshape(sq, b, np_ * hn)  # [sq, b, np * hn]


@dataclass
class SelfAttentionSubmodules:
    """The slots of SelfAttention (Megatron-Core's names; a slot's state-dict prefix is its name)."""

    linear_qkv: ModuleSpec | type = ColumnParallelLinear
    core_attention: ModuleSpec | type = DotProductAttention
    linear_proj: ModuleSpec | type = RowParallelLinear
    q_layernorm: ModuleSpec | type | None = None
    k_layernorm: ModuleSpec | type | None = None


def qkv_partition_rows(num_heads: int, num_groups: int, head_dim: int, tp: int, rank: int) -> list[int]:
    """Rows of the full linear_qkv weight held by tensor-parallel rank `rank` of `tp`, in local order.

    t divides ng: the rank's ng/t whole groups, one contiguous block. Fewer groups than ranks:
    the rank's np/t query heads inside its group's block, then that group's K and V rows.
    """
    block = (num_heads // num_groups + 2) * head_dim  # rows of one query group
    if num_groups % tp == 0:
        per_rank = num_groups // tp * block
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    replicas = tp // num_groups
    group, heads = rank // replicas, num_heads // tp
    base = group * block
    first_query = base + (rank % replicas) * heads * head_dim
    kv = base + num_heads // num_groups * head_dim
    return list(range(first_query, first_query + heads * head_dim)) + list(range(kv, kv + 2 * head_dim))


class SelfAttention(MegatronModule):
    """[s, b, h] -> ([s, b, h], bias). Keys: linear_qkv.*, linear_proj.*, q_layernorm.*, k_layernorm.*.

    As Megatron's, forward returns linear_proj's (output, bias): with bias_dropout_fusion the
    projection skips its bias add (bias is linear_proj.bias, or None without biases) and the
    layer's fused bias-dropout-add adds it; otherwise the output includes it and bias is None.
    linear_qkv has a bias with add_bias_linear or add_qkv_bias (Qwen2: the QKV bias only).
    """

    def __init__(self, config: TransformerConfig, submodules: SelfAttentionSubmodules | None = None,
                 layer_number: int = 1) -> None:
        super().__init__(config)
        submodules = submodules or SelfAttentionSubmodules()
        self.layer_number = layer_number
        tp, hn = config.tensor_model_parallel_size, config.kv_channels
        heads, groups = config.num_attention_heads, config.num_query_groups
        rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
        self.num_attention_heads_per_partition = divide(heads, tp)
        self.num_query_groups_per_partition = max(1, groups // tp)
        self.hidden_size_per_attention_head = hn
        rows = None if groups % tp == 0 else qkv_partition_rows(heads, groups, hn, tp, rank)
        self.linear_qkv = build_module(
            submodules.linear_qkv, config.hidden_size, (heads + 2 * groups) * hn, config=config,
            init_method=config.init_method, bias=config.add_bias_linear or config.add_qkv_bias, gather_output=False,
            **({} if rows is None else {"partition_rows": rows}))
        if rows is not None:
            _mark_replicated_kv(self.linear_qkv, self.num_attention_heads_per_partition * hn, 2 * hn,
                                group=rank // (tp // groups), num_groups=groups, first=rank % (tp // groups) == 0)
        self.q_layernorm = build_module(submodules.q_layernorm, hn, config, eps=config.layernorm_epsilon)
        self.k_layernorm = build_module(submodules.k_layernorm, hn, config, eps=config.layernorm_epsilon)
        for norm in (self.q_layernorm, self.k_layernorm):
            for param in (norm.parameters() if norm is not None and tp > 1 else ()):
                param.sequence_parallel = True  # each rank's heads give a partial gradient: summed over TP
        self.core_attention = build_module(submodules.core_attention, config, layer_number)
        self.checkpoint_core_attention = config.recompute_granularity == "selective"
        self.linear_proj = build_module(
            submodules.linear_proj, heads * hn, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=config.bias_dropout_fusion)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, is_causal: bool = False,
                rotary_pos_emb: torch.Tensor | None = None,
                attention_bias: torch.Tensor | None = None,
                inference_context=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """rotary_pos_emb: freqs [s, 1, 1, rot_dim] (RotaryEmbedding), or [s, b, 1, rot_dim] with
        packed sequences (positions per row); attention_bias: ALiBi's, this rank's heads.

        inference_context (InferenceContext): this step's keys and values (after RoPE) join its cache
        and the queries attend over the whole cached prefix, [offset + s] keys. A paged context
        (megatron/inference/kv_cache.PagedContext, the engine's) stores and attends itself."""
        np_, ng, hn = (self.num_attention_heads_per_partition, self.num_query_groups_per_partition,
                       self.hidden_size_per_attention_head)
        mixed_qkv, _ = self.linear_qkv(hidden_states)  # [s, b, ng/t * (np/ng + 2) * hn] (s whole, also under SP)
        s, b, _ = mixed_qkv.shape
        mixed_qkv = mixed_qkv.view(s, b, ng, (np_ // ng + 2) * hn)  # [s, b, ng/t, (np/ng + 2) hn]
        query, key, value = torch.split(mixed_qkv, [np_ // ng * hn, hn, hn], dim=-1)
        # [s, b ng/t, np/ng, hn]: still a view of mixed_qkv (batch and groups merge). The q norm and
        # RoPE work per head, so they take it as it is; their outputs are contiguous, and the reshape
        # to [s, b, np/t, hn] after them is a view rather than a copy of the strided split.
        query = query.reshape(s, b * ng, np_ // ng, hn)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if rotary_pos_emb is not None:
            # Per-row freqs [s, b, 1, rot] (packed sequences) repeat for the query's b ng/t rows.
            query_freqs = rotary_pos_emb if rotary_pos_emb.shape[1] == 1 else rotary_pos_emb.repeat_interleave(ng, dim=1)
            query = apply_rotary_pos_emb(query, query_freqs, self.config)  # freqs [s, 1, 1, rot] or [s, b ng/t, 1, rot]
            key = apply_rotary_pos_emb(key, rotary_pos_emb, self.config)
        query = query.reshape(s, b, np_, hn)  # [s, b, np/t, hn]
        if getattr(inference_context, "paged", False):  # the engine's packed step over its paged cache
            context = inference_context.attention(self.layer_number, query, key, value,
                                                  self.core_attention)  # [T, 1, np/t * hn]
            return self.linear_proj(context)
        if inference_context is not None:
            key, value = inference_context.append_key_value(self.layer_number, key, value)  # [offset + s, b, ng/t, hn]
        core_args = (query, key, value, attention_mask, is_causal, attention_bias)
        core = self.core_attention
        if self.config.context_parallel_size > 1:  # s is this CP rank's s/N tokens: the exchange inside
            if inference_context is not None:
                raise ValueError("generation with --context-parallel-size > 1 is not supported")
            core = functools.partial(context_parallel_attention, self.core_attention, self.config, self.layer_number)
        if self.checkpoint_core_attention and self.training and torch.is_grad_enabled():
            # Selective recompute: keep q, k, v, rerun the attention in backward.
            context = tensor_parallel.checkpoint(core, False, *core_args)  # [s, b, np/t * hn]
        else:
            context = core(*core_args)  # [s, b, np/t * hn]
        return self.linear_proj(context)  # ([s, b, h] or [s/t, b, h] under SP, bias [h] or None)


@dataclass
class CrossAttentionSubmodules:
    """The slots of CrossAttention (Megatron-Core's names)."""

    linear_q: ModuleSpec | type = ColumnParallelLinear
    linear_kv: ModuleSpec | type = ColumnParallelLinear
    core_attention: ModuleSpec | type = DotProductAttention
    linear_proj: ModuleSpec | type = RowParallelLinear


class CrossAttention(MegatronModule):
    """Queries from the decoder's hidden states [sq, b, h], keys and values from the encoder's
    output `context` [sk, b, h] -> ([sq, b, h], bias). Keys: linear_q.*, linear_kv.*, linear_proj.*.

    Multi-head only (Megatron-Core's CrossAttention asserts num_query_groups == num_attention_heads).
    linear_q's rows are np heads of hn; linear_kv's rows are per head its key then its value
    ([np, 2, hn], Megatron-Core's layout), so a tensor-parallel rank's contiguous block of rows
    (column parallel) holds its np/t heads' keys and values, as SelfAttention splits linear_qkv;
    linear_proj is row parallel. attention_mask [b or 1, 1, sq, sk] bool, True = masked out.
    Under sequence parallelism hidden_states is [sq/t, b, h] and context [sk/t, b, h]: linear_q and
    linear_kv all-gather their inputs along the sequence (and reduce-scatter the gradients), and
    linear_proj reduce-scatters the output back to [sq/t, b, h].
    """

    def __init__(self, config: TransformerConfig, submodules: CrossAttentionSubmodules | None = None,
                 layer_number: int = 1) -> None:
        super().__init__(config)
        submodules = submodules or CrossAttentionSubmodules()
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError("CrossAttention is multi-head only (num_query_groups must equal num_attention_heads)")
        self.layer_number = layer_number
        tp, hn, heads = config.tensor_model_parallel_size, config.kv_channels, config.num_attention_heads
        self.num_attention_heads_per_partition = divide(heads, tp)
        self.hidden_size_per_attention_head = hn
        bias = config.add_bias_linear
        self.linear_q = build_module(submodules.linear_q, config.hidden_size, heads * hn, config=config,
                                     init_method=config.init_method, bias=bias, gather_output=False)
        self.linear_kv = build_module(submodules.linear_kv, config.hidden_size, 2 * heads * hn, config=config,
                                      init_method=config.init_method, bias=bias, gather_output=False)
        self.core_attention = build_module(submodules.core_attention, config, layer_number)
        self.linear_proj = build_module(
            submodules.linear_proj, heads * hn, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=bias, input_is_parallel=True,
            skip_bias_add=config.bias_dropout_fusion)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                context: torch.Tensor | None = None,
                attention_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if context is None:
            raise ValueError("CrossAttention needs the encoder output (context)")
        np_, hn = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        query, _ = self.linear_q(hidden_states)  # [sq, b, np/t * hn]
        sq, b, _ = query.shape
        query = query.view(sq, b, np_, hn)  # [sq, b, np/t, hn]
        mixed_kv, _ = self.linear_kv(context)  # [sk, b, np/t * 2 hn]
        sk = mixed_kv.shape[0]
        mixed_kv = mixed_kv.view(sk, b, np_, 2 * hn)  # [sk, b, np/t, 2 hn]
        key, value = torch.split(mixed_kv, [hn, hn], dim=-1)  # [sk, b, np/t, hn] each
        context_layer = self.core_attention(query, key.contiguous(), value.contiguous(), attention_mask, False,
                                            attention_bias)  # [sq, b, np/t * hn]
        return self.linear_proj(context_layer)  # ([sq, b, h], bias [h] or None)


def _mark_replicated_kv(linear: torch.nn.Module, first_row: int, rows: int, *, group: int, num_groups: int,
                        first: bool) -> None:
    """Mark the K/V rows [first_row, first_row + rows) of linear's weight and bias as a replica of
    query group `group` (of num_groups): finalize_model_grads sums their gradients over the ranks
    holding the same group, and the grad norm counts them on the group's first rank only."""
    for param in (linear.weight, getattr(linear, "bias", None)):
        if param is not None:
            param.replicated_kv_rows = (first_row, first_row + rows, group, num_groups)
            if not first:
                param.tensor_parallel_duplicate_rows = (first_row, first_row + rows)
