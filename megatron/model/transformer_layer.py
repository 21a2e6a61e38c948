"""TransformerLayer: one pre-LN block (the stack of them is transformer_block.TransformerBlock).

Read as nanoGPT's Block, with activations [s, b, h]:
    x = x + dropout(attn(ln_1(x)))
    x = x + dropout(mlp(ln_2(x)))
The "x + dropout(out + bias)" of each branch is Megatron's bias-dropout-add: with
bias_dropout_fusion (the default) one fused_kernels.bias_dropout_add, given the branch's output
and the bias its last linear skipped; otherwise PyTorch ops. Both draw the dropout mask from the
same stream (tensor_parallel_dropout_context), and on CPU the same mask: the same bits either way.
apply_residual_connection_post_layernorm takes the residual from ln(x) instead of x (as in
BERT-era Megatron); fp32_residual_connection keeps x in fp32 while the layers run in half.

Under sequence parallelism (config.sequence_parallel) everything outside the attention and MLP
linears -- layer norms, dropout, residual adds -- runs on this rank's s/t tokens: the block's
input and output are [s/t, b, h], and the column-parallel linears gather the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron import fused_kernels
from megatron.core import parallel_state
from megatron.model.layers import Dropout, Norm, fused_impl, tensor_parallel_dropout_context
from megatron.model.module import MegatronModule
from megatron.model.spec import ModuleSpec, build_module
from megatron.model.transformer_config import TransformerConfig


@dataclass
class TransformerLayerSubmodules:
    """The slots of a transformer layer (Megatron-Core's names: each is its state-dict prefix).

    A slot holds a ModuleSpec, a class, or None (empty). The norms are built as
    slot(hidden_size, config), the attentions as slot(config, layer_number=...), the MLP as
    slot(config); cross-attention (and its norm) run only when the layer is given a `context`.
    """

    input_layernorm: ModuleSpec | type | None = Norm
    self_attention: ModuleSpec | type | None = None
    pre_cross_attn_layernorm: ModuleSpec | type | None = None
    cross_attention: ModuleSpec | type | None = None
    pre_mlp_layernorm: ModuleSpec | type | None = Norm
    mlp: ModuleSpec | type | None = None


class TransformerLayer(MegatronModule):
    """[s, b, h] -> [s, b, h], one pre-LN block built from its spec (TransformerLayerSubmodules).

    layer_number is 1-based (it is the query-key layer-scaling coefficient). forward keywords:
    rotary_pos_emb (RoPE angles), attention_bias (ALiBi), context / context_mask (the encoder
    output the cross-attention reads); a slot that is None is skipped (an empty norm is the identity).
    """

    def __init__(self, config: TransformerConfig, submodules: TransformerLayerSubmodules,
                 layer_number: int = 1) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        h = config.hidden_size
        self.input_layernorm = build_module(submodules.input_layernorm, h, config)
        self.self_attention = build_module(submodules.self_attention, config, layer_number=layer_number)
        self.pre_cross_attn_layernorm = build_module(submodules.pre_cross_attn_layernorm, h, config)
        self.cross_attention = build_module(submodules.cross_attention, config, layer_number=layer_number)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, h, config)
        self.mlp = build_module(submodules.mlp, config)
        if hasattr(self.mlp, "set_layer_number"):  # an MoE layer records its balancing losses by layer
            self.mlp.set_layer_number(layer_number)
        # Applied to each branch's output before the residual add (Megatron's bias-dropout-add).
        self.hidden_dropout = Dropout(config.hidden_dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, is_causal: bool = False,
                rotary_pos_emb: torch.Tensor | None = None, attention_bias: torch.Tensor | None = None,
                context: torch.Tensor | None = None, context_mask: torch.Tensor | None = None,
                inference_context=None) -> torch.Tensor:
        """is_causal: attention_mask is the causal mask (a hint for the fused attention);
        inference_context: the key/value cache the self-attention appends to (InferenceContext)."""
        if self.self_attention is not None:
            kv_cache = {} if inference_context is None else {"inference_context": inference_context}
            hidden_states = self._residual_branch(
                self.input_layernorm, hidden_states,
                lambda x: self.self_attention(x, attention_mask, is_causal, rotary_pos_emb=rotary_pos_emb,
                                              attention_bias=attention_bias, **kv_cache))
        if self.cross_attention is not None and context is not None:
            hidden_states = self._residual_branch(
                self.pre_cross_attn_layernorm, hidden_states,
                lambda x: self.cross_attention(x, context_mask, context=context))
        if self.mlp is not None:
            hidden_states = self._residual_branch(self.pre_mlp_layernorm, hidden_states, self.mlp)
        return hidden_states  # [s, b, h]

    def _residual_branch(self, norm, hidden_states: torch.Tensor, branch) -> torch.Tensor:
        """residual + dropout(branch(norm(x))); the residual is x, or norm(x) with
        apply_residual_connection_post_layernorm (as in BERT-era Megatron)."""
        normed = norm(hidden_states) if norm is not None else hidden_states  # [s, b, h]
        output, bias = branch(normed)  # [s, b, h], bias [h] or None
        residual = normed if self.config.apply_residual_connection_post_layernorm else hidden_states
        return self.bias_dropout_add(output, bias, residual)

    def bias_dropout_add(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        """residual + dropout(x + bias), [s, b, h] ([s/t, b, h] under SP: each rank's own mask)."""
        with tensor_parallel_dropout_context(partitioned=self.config.sequence_parallel):
            if self.config.bias_dropout_fusion:
                return fused_kernels.bias_dropout_add(x, bias, residual, self.config.hidden_dropout, self.training,
                                                      impl=fused_impl(self.config, x))
            return residual + self.hidden_dropout(x if bias is None else x + bias)


def get_num_layers_to_build(config: TransformerConfig) -> int:
    """Layers of this pipeline stage (of this model chunk, with virtual stages): L / (pp x vp)."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if config.num_layers % (pp * vp):
        raise ValueError(f"num_layers ({config.num_layers}) is not divisible by the pipeline-parallel size ({pp})"
                         + (f" x virtual stages ({vp})" if vp > 1 else ""))
    return config.num_layers // (pp * vp)


def get_layer_offset(config: TransformerConfig) -> int:
    """Global index of this stage's (chunk's) first layer.

    Model chunks are dealt round-robin over the pipeline ranks: chunk v of rank p is chunk
    v * pp + p of the model, so its first layer is v * L / vp + p * L / (pp * vp).
    """
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp_rank = parallel_state.get_virtual_pipeline_model_parallel_rank() or 0
    return (vp_rank * pp + pp_rank) * get_num_layers_to_build(config)
