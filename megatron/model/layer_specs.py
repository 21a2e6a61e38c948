"""The layer specs of the model families (Megatron-Core's gpt_layer_specs, local implementation).

    get_gpt_layer_spec(qk_layernorm)     LayerNorm / RMSNorm as config.normalization says
    get_llama_layer_spec(qk_layernorm)   RMSNorm in every norm slot, whatever config.normalization
    layer_spec_from_config(config)       the GPT spec for the config (what GPTModel builds by default)
    get_t5_encoder_layer_spec / get_t5_decoder_layer_spec   T5's (the decoder adds pre_cross_attn_layernorm
                                         and cross_attention: CrossAttention with linear_q, linear_kv)
    get_bert_post_ln_layer_spec(config)  the original BERT's post-LN layer (post_ln_layer.py): the GPT
                                         layer's attention and MLP, post_self_attn_layernorm, post_mlp_layernorm

Both are one ModuleSpec tree:

    TransformerLayer
      input_layernorm     Norm
      self_attention      SelfAttention
        linear_qkv          ColumnParallelLinear
        core_attention      DotProductAttention (FlashDotProductAttention with use_flash_attn)
        linear_proj         RowParallelLinear
        q_layernorm, k_layernorm   Norm over hn (qk_layernorm), else empty
      pre_mlp_layernorm   Norm
      mlp                 MLP (GeLU, SwiGLU, ... as the config says)
        linear_fc1          ColumnParallelLinear
        linear_fc2          RowParallelLinear
                          or, in the layers config.is_moe_layer names (spec_for_layer), MoELayer:
        router              TopKRouter
        experts             SequentialMLP (local_experts.{i}.linear_fc1 / linear_fc2)
        shared_experts      MLP (with moe_shared_expert_intermediate_size)

The state-dict keys are the slot names: decoder.layers.N.self_attention.linear_qkv.weight, ...
(Megatron-Core's local spec, so a checkpoint maps one-to-one onto its GPTModel). The Llama family
differs from GPT only in what the config asks of these modules (RMSNorm, no biases, SwiGLU, query
groups, RoPE at the model): its spec names RMSNorm outright. A user's spec is another tree of the
same kind (docs/model.md).
"""

from __future__ import annotations

import dataclasses

from megatron.model.attention import (
    CrossAttention,
    CrossAttentionSubmodules,
    DotProductAttention,
    FlashDotProductAttention,
    SelfAttention,
    SelfAttentionSubmodules,
)
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.model.layers import Norm, RMSNorm
from megatron.model.mlp import MLP, MLPSubmodules
from megatron.model.moe.experts import SequentialMLP
from megatron.model.moe.moe_layer import MoELayer, MoESubmodules
from megatron.model.moe.router import TopKRouter
from megatron.model.post_ln_layer import PostLNTransformerLayer, PostLNTransformerLayerSubmodules
from megatron.model.spec import ModuleSpec
from megatron.model.transformer_config import TransformerConfig
from megatron.model.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def get_moe_spec() -> ModuleSpec:
    """The MoE MLP: TopKRouter, SequentialMLP experts, a dense MLP as the shared experts (when the
    config asks for them)."""
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(router=TopKRouter, experts=SequentialMLP,
                                                                shared_experts=MLP))


def spec_for_layer(spec: ModuleSpec, config: TransformerConfig, layer_number: int) -> ModuleSpec:
    """The spec of layer `layer_number`: `spec`, with the MoE MLP in its mlp slot when the config makes
    that layer an MoE layer (num_moe_experts, moe_layer_freq) and the slot holds the dense MLP."""
    submodules = getattr(spec, "submodules", None)
    mlp = getattr(submodules, "mlp", None)
    if not config.is_moe_layer(layer_number) or getattr(mlp, "module", mlp) is not MLP:
        return spec
    return ModuleSpec(module=spec.module, params=spec.params,
                      submodules=dataclasses.replace(submodules, mlp=get_moe_spec()))


def get_gpt_layer_spec(qk_layernorm: bool = False, use_flash_attn: bool = False, norm: type = Norm) -> ModuleSpec:
    """The GPT layer: pre-norm self-attention and MLP, each norm the `norm` slot class."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=FlashDotProductAttention if use_flash_attn else DotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=norm if qk_layernorm else None,
                    k_layernorm=norm if qk_layernorm else None,
                ),
            ),
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)),
        ),
    )


def get_llama_layer_spec(qk_layernorm: bool = False, use_flash_attn: bool = False) -> ModuleSpec:
    """The Llama layer: the GPT layer with RMSNorm in every norm slot."""
    return get_gpt_layer_spec(qk_layernorm, use_flash_attn, norm=RMSNorm)


def layer_spec_from_config(config: TransformerConfig) -> ModuleSpec:
    """The GPT layer spec the config describes (qk_layernorm, use_flash_attn; norms per config.normalization)."""
    return get_gpt_layer_spec(qk_layernorm=config.qk_layernorm, use_flash_attn=config.use_flash_attn)


def get_t5_encoder_layer_spec(norm: type = Norm, attention_scale: float | None = None) -> ModuleSpec:
    """T5's encoder layer: the GPT layer (pre-norm self-attention and MLP). attention_scale: the
    core attention's factor of q k^T (default 1/sqrt(hn); HF T5's is 1.0)."""
    spec = get_gpt_layer_spec(norm=norm)
    if attention_scale is not None:
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            DotProductAttention, params={"attention_scale": attention_scale})
    return spec


def get_t5_decoder_layer_spec(norm: type = Norm, attention_scale: float | None = None) -> ModuleSpec:
    """T5's decoder layer: pre-norm causal self-attention, pre-norm cross-attention over the
    encoder output (pre_cross_attn_layernorm, cross_attention: linear_q, linear_kv, linear_proj), MLP."""
    spec = get_t5_encoder_layer_spec(norm, attention_scale)
    core = spec.submodules.self_attention.submodules.core_attention
    spec.submodules.pre_cross_attn_layernorm = norm
    spec.submodules.cross_attention = ModuleSpec(
        module=CrossAttention,
        submodules=CrossAttentionSubmodules(linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear,
                                            core_attention=core, linear_proj=RowParallelLinear))
    return spec


def get_bert_post_ln_layer_spec(config: TransformerConfig | None = None) -> ModuleSpec:
    """The original BERT's layer (HF BertLayer): x = LN(x + attn(x)), then x = LN(x + mlp(x)), with the
    GPT layer's attention and MLP; the norms as config.normalization says (BERT's: LayerNorm)."""
    gpt = layer_spec_from_config(config).submodules if config is not None else get_gpt_layer_spec().submodules
    return ModuleSpec(
        module=PostLNTransformerLayer,
        submodules=PostLNTransformerLayerSubmodules(self_attention=gpt.self_attention, post_self_attn_layernorm=Norm,
                                                    mlp=gpt.mlp, post_mlp_layernorm=Norm),
    )
