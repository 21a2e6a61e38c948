"""PostLNTransformerLayer: the original BERT's block, LayerNorm after each residual add.

Read as HF's BertLayer (BertSelfOutput, BertOutput), with activations [s, b, h]:
    x = ln_1(x + dropout(attn(x)))
    x = ln_2(x + dropout(mlp(x)))
The "x + dropout(out + bias)" is TransformerLayer's bias-dropout-add (the same fused kernel, the
same dropout streams). A stack of these layers has no final layer norm: the last layer's ln_2 is
it (BertModel(post_layernorm=True) drops the block's final_layernorm). Under sequence parallelism
the norms run on this rank's s/t tokens, as the pre-LN layer's do.

State-dict keys (slot names, as Megatron-Core's; its local spec has no post-LN layer, so the two
norm slots are named here for where they sit):
    self_attention.{linear_qkv,linear_proj}.*   as the GPT layer's
    post_self_attn_layernorm.{weight,bias}      HF attention.output.LayerNorm
    mlp.{linear_fc1,linear_fc2}.*               as the GPT layer's
    post_mlp_layernorm.{weight,bias}            HF output.LayerNorm
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.model.layers import Dropout, Norm
from megatron.model.module import MegatronModule
from megatron.model.spec import ModuleSpec, build_module
from megatron.model.transformer_config import TransformerConfig
from megatron.model.transformer_layer import TransformerLayer


@dataclass
class PostLNTransformerLayerSubmodules:
    """The slots of a post-LN layer: norms built as slot(hidden_size, config), the attention as
    slot(config, layer_number=...), the MLP as slot(config)."""

    self_attention: ModuleSpec | type | None = None
    post_self_attn_layernorm: ModuleSpec | type | None = Norm
    mlp: ModuleSpec | type | None = None
    post_mlp_layernorm: ModuleSpec | type | None = Norm


class PostLNTransformerLayer(TransformerLayer):
    """[s, b, h] -> [s, b, h], one post-LN block built from its spec (PostLNTransformerLayerSubmodules).

    Takes TransformerLayer's forward arguments (what TransformerBlock passes); it has no
    cross-attention. Its bias_dropout_add is TransformerLayer's.
    """

    def __init__(self, config: TransformerConfig, submodules: PostLNTransformerLayerSubmodules,
                 layer_number: int = 1) -> None:
        # Not TransformerLayer.__init__: that builds the pre-LN slots; this layer has its own.
        MegatronModule.__init__(self, config)
        if config.apply_residual_connection_post_layernorm:
            raise ValueError("apply_residual_connection_post_layernorm has no meaning in a post-LN layer "
                             "(its residual is already the layer norm's output)")
        self.layer_number = layer_number
        h = config.hidden_size
        self.self_attention = build_module(submodules.self_attention, config, layer_number=layer_number)
        self.post_self_attn_layernorm = build_module(submodules.post_self_attn_layernorm, h, config)
        self.mlp = build_module(submodules.mlp, config)
        self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, h, config)
        self.hidden_dropout = Dropout(config.hidden_dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, is_causal: bool = False,
                rotary_pos_emb: torch.Tensor | None = None, attention_bias: torch.Tensor | None = None,
                context: torch.Tensor | None = None, context_mask: torch.Tensor | None = None,
                inference_context=None) -> torch.Tensor:
        if context is not None:
            raise ValueError("PostLNTransformerLayer has no cross-attention (got a context)")
        if self.self_attention is not None:
            kv_cache = {} if inference_context is None else {"inference_context": inference_context}
            output, bias = self.self_attention(hidden_states, attention_mask, is_causal, rotary_pos_emb=rotary_pos_emb,
                                               attention_bias=attention_bias, **kv_cache)  # [s, b, h], [h]
            hidden_states = self._post_norm(self.post_self_attn_layernorm,
                                            self.bias_dropout_add(output, bias, hidden_states))
        if self.mlp is not None:
            output, bias = self.mlp(hidden_states)  # [s, b, h], [h] or None
            hidden_states = self._post_norm(self.post_mlp_layernorm, self.bias_dropout_add(output, bias, hidden_states))
        return hidden_states  # [s, b, h]

    @staticmethod
    def _post_norm(norm, hidden_states: torch.Tensor) -> torch.Tensor:
        return norm(hidden_states) if norm is not None else hidden_states
