"""Causal self-attention: fused QKV projection, masked-softmax dot-product attention, output projection.

Notation: s sequence, b batch, h hidden, np attention heads, hn head dim (kv_channels), t the
tensor-parallel size. Each tensor-parallel rank holds np/t whole heads: its rows of linear_qkv
(column parallel) and its columns of linear_proj (row parallel, whose output is summed over the
ranks). Under sequence parallelism the layer's input and output are [s/t, b, h].

Two core attentions compute softmax(q k^T / sqrt(hn) + mask) v:
    DotProductAttention       Megatron's: two matmuls around a scale-mask-softmax, which is
                              fused_kernels.scale_mask_softmax with masked_softmax_fusion (the
                              default), else plain PyTorch ops (the reference)
    FlashDotProductAttention  --use-flash-attn: flash-attn's kernel on CUDA when the package is
                              importable, else torch's scaled_dot_product_attention
With recompute_granularity "selective" the core attention is rerun in backward
(tensor_parallel.checkpoint): its s^2 activations (scores, probabilities, dropout mask) are not kept.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from megatron import fused_kernels
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, divide
from megatron.model.layers import Dropout, fused_impl, tensor_parallel_dropout_context
from megatron.model.module import MegatronModule
from megatron.model.transformer_config import TransformerConfig
from megatron.model.utils import attention_mask_func

try:  # optional: never required, used on CUDA when importable
    from flash_attn import flash_attn_func
except (ImportError, OSError):  # not installed, or built for another CUDA / torch
    flash_attn_func = None


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

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """q, k, v [s, b, np/t, hn] -> context [s, b, np/t * hn]; is_causal: attention_mask is the causal mask."""
        sq, b, np_, hn = query.shape  # [sq, b, np/t, hn]
        if self._fused_cpu_core(query):
            return self._cpu_core(query, key, value, attention_mask, is_causal)
        q = query.permute(1, 2, 0, 3)  # [sq, b, np, hn] -> [b, np, sq, hn]
        k = key.permute(1, 2, 3, 0)  # [sk, b, np, hn] -> [b, np, hn, sk]
        v = value.permute(1, 2, 0, 3)  # [sk, b, np, hn] -> [b, np, sk, hn]
        scores = torch.matmul(q, k) * (1.0 / self.norm_factor)  # [b, np, sq, sk]
        # attention_mask [b or 1, 1, sq, sk] broadcasts over the heads.
        probs = self.scale_mask_softmax(scores, attention_mask, is_causal)  # [b, np, sq, sk]
        with tensor_parallel_dropout_context(partitioned=True):  # this rank's heads only
            probs = self.attention_dropout(probs)
        context = torch.matmul(probs, v)  # [b, np, sq, hn]
        context = context.permute(2, 0, 1, 3)  # [b, np, sq, hn] -> [sq, b, np, hn]
        return context.reshape(sq, b, np_ * hn)  # [sq, b, np * hn]

    def _fused_cpu_core(self, query: torch.Tensor) -> bool:
        """The CPU fast path applies: fused softmax with the "native" CPU implementation, no active dropout."""
        return (self.config.masked_softmax_fusion and fused_impl(self.config, query) == "native"
                and not (self.training and self.attention_dropout.p > 0))

    def _cpu_core(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        """The same function on CPU as one autograd node around ATen's GEMMs and softmax, causal
        attention block by block of queries (fused_kernels.core_attention; measured faster than
        this class's composed path and than SDPA's CPU flash kernel, fp32 and bf16)."""
        sq, b, np_, hn = query.shape
        scale = 1.0 / math.sqrt(hn)  # = softmax_scale / norm_factor: layer scaling cancels
        # [b*np, s, hn], contiguous: as views of mixed_qkv their transposes would be copied inside each bmm
        q, k, v = (x.permute(1, 2, 0, 3).reshape(b * np_, -1, hn).contiguous() for x in (query, key, value))
        context = fused_kernels.core_attention(q, k, v, scale=scale, heads=np_,
                                               mask=None if is_causal else attention_mask, causal=is_causal)
        return context.view(b, np_, sq, hn).permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)  # [sq, b, np * hn]


class FlashDotProductAttention(MegatronModule):
    """DotProductAttention's function through a fused kernel (--use-flash-attn). Has no parameters.

    flash-attn's flash_attn_func when the package imports, the tensors are fp16/bf16 on CUDA and
    the mask is the causal one (is_causal) or none; otherwise torch.nn.functional.
    scaled_dot_product_attention, which takes any mask. Equal to DotProductAttention within
    rounding with attention dropout 0, including rows whose keys are all masked: Megatron's
    -10000 fill makes those average the values, and so does this class (SDPA alone gives 0).

    Attention dropout > 0 is accepted and applied by the kernel, drawing from the device's
    generator in the tensor-parallel rank's own stream, as DotProductAttention does; a seed
    reproduces it and recompute restores it. The mask is the kernel's own: on CUDA (flash-attn,
    SDPA's flash / efficient kernels) not the unfused path's, so the same seed gives the same
    distribution but other numbers; on CPU torch's math backend happens to draw the same mask
    (docs/memory.md).
    """

    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__(config)
        self.layer_number = max(1, layer_number)
        # Query-key layer scaling divides and multiplies back by the same coefficient: no effect here.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels)
        self.attention_dropout_p = config.attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """q, k, v [s, b, np/t, hn] -> [s, b, np/t * hn]; is_causal: attention_mask is the causal mask."""
        sq, b, np_, hn = query.shape  # [sq, b, np/t, hn]
        dropout_p = self.attention_dropout_p if self.training else 0.0
        rng = tensor_parallel_dropout_context(partitioned=True) if dropout_p > 0 else contextlib.nullcontext()
        with rng:  # this rank's heads only
            if _flash_attn_applies(query, attention_mask, is_causal):
                q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [s, b, np, hn] -> [b, s, np, hn]
                context = flash_attn_func(q, k, v, dropout_p, softmax_scale=self.softmax_scale, causal=is_causal)
                context = context.transpose(0, 1)  # [b, sq, np, hn] -> [sq, b, np, hn]
            else:
                context = self._sdpa(query, key, value, attention_mask, is_causal, dropout_p)  # [sq, b, np, hn]
        return context.reshape(sq, b, np_ * hn)  # [sq, b, np * hn]

    def _sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
              is_causal: bool, dropout_p: float) -> torch.Tensor:
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, np, hn] -> [b, np, s, hn]
        keep = None if is_causal or attention_mask is None else ~attention_mask  # SDPA: True = takes part
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal,
                                                 scale=self.softmax_scale)  # [b, np, sq, hn]
        if keep is not None:
            fully_masked = attention_mask.all(dim=-1, keepdim=True)  # [b or 1, 1, sq, 1]
            context = torch.where(fully_masked, v.mean(dim=-2, keepdim=True), context)  # [b, np, sq, hn]
        return context.permute(2, 0, 1, 3)  # [b, np, sq, hn] -> [sq, b, np, hn]


def _flash_attn_applies(query: torch.Tensor, attention_mask: torch.Tensor | None, is_causal: bool) -> bool:
    """flash_attn_func can compute this call: installed, CUDA, half precision, causal or unmasked."""
    return (flash_attn_func is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and (is_causal or attention_mask is None))


class SelfAttention(MegatronModule):
    """[s, b, h] -> ([s, b, h], bias). State-dict keys: linear_qkv.{weight,bias}, linear_proj.{weight,bias}.

    As Megatron's, forward returns linear_proj's (output, bias): with bias_dropout_fusion the
    projection skips its bias add (bias is linear_proj.bias, or None without biases) and the
    layer's fused bias-dropout-add adds it; otherwise the output includes it and bias is None.

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
        core_attention_class = FlashDotProductAttention if config.use_flash_attn else DotProductAttention
        self.core_attention = core_attention_class(config, layer_number)
        self.checkpoint_core_attention = config.recompute_granularity == "selective"
        self.linear_proj = RowParallelLinear(projection_size, config.hidden_size, config=config,
                                             init_method=config.output_layer_init_method, bias=bias,
                                             input_is_parallel=True, skip_bias_add=config.bias_dropout_fusion)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        np_, hn = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        mixed_qkv, _ = self.linear_qkv(hidden_states)  # [s, b, np/t * 3 * hn] (s whole, also under SP)
        s, b, _ = mixed_qkv.shape
        mixed_qkv = mixed_qkv.view(s, b, np_, 3 * hn)  # [s, b, np/t, 3 * hn]
        query, key, value = torch.split(mixed_qkv, hn, dim=-1)  # 3 x [s, b, np/t, hn]
        if self.checkpoint_core_attention and self.training and torch.is_grad_enabled():
            # Selective recompute: keep q, k, v (views of mixed_qkv), rerun the attention in backward.
            context = tensor_parallel.checkpoint(self.core_attention, False, query, key, value, attention_mask,
                                                 is_causal)  # [s, b, np/t * hn]
        else:
            context = self.core_attention(query, key, value, attention_mask, is_causal)  # [s, b, np/t * hn]
        return self.linear_proj(context)  # ([s, b, h] or [s/t, b, h] under SP, bias [h] or None)
