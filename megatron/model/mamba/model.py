"""MambaModel: a GPTModel whose decoder is a hybrid MambaStack (Megatron-Core's MambaModel).

State-dict keys: GPTModel's embedding.* and output_layer.*, decoder.layers.{i}.* by the layer's kind
(hybrid.py: Mamba layers norm.* and mixer.*, attention layers input_layernorm.* and self_attention.*,
MLP layers pre_mlp_layernorm.* and mlp.*), decoder.final_norm.*. Positions default to "none" (the
Mamba layers carry order; attention layers see none, as in Megatron's recipes); rope is allowed.
"""

from __future__ import annotations

from megatron.model.gpt_model import GPTModel
from megatron.model.mamba.hybrid import HybridLayerSubmodules, MambaStack, allocate_layers, hybrid_stack_spec
from megatron.model.transformer_config import TransformerConfig


class MambaModel(GPTModel):
    """GPTModel's forward (logits or per-token losses; pipeline stages; inference context with the
    Mamba layers' conv and SSM states beside the attention layers' key/value cache) over the layers of
    the hybrid pattern: hybrid_override_pattern, or the ratios' allocation (allocate_layers).
    layer_submodules replaces the spec of any kind of layer (HybridLayerSubmodules)."""

    decoder_class = MambaStack

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                 hybrid_attention_ratio: float = 0.0, hybrid_mlp_ratio: float = 0.0,
                 hybrid_override_pattern: str | None = None, position_embedding_type: str = "none",
                 layer_submodules: HybridLayerSubmodules | None = None, **gpt_kwargs) -> None:
        self.hybrid_pattern = allocate_layers(config.num_layers, hybrid_attention_ratio, hybrid_mlp_ratio,
                                              hybrid_override_pattern)
        super().__init__(config, vocab_size, max_sequence_length, position_embedding_type=position_embedding_type,
                         transformer_layer_spec=hybrid_stack_spec(self.hybrid_pattern, layer_submodules),
                         **gpt_kwargs)
