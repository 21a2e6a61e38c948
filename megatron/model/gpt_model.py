"""GPTModel: embedding -> transformer block -> output layer -> per-token cross-entropy.

State-dict keys (Megatron-Core GPT, local spec; FORMATS.md sec. 3):
    embedding.word_embeddings.weight              [vocab, h]
    embedding.position_embeddings.weight          [max_s, h]
    decoder.layers.{i}.input_layernorm.{weight,bias}
    decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}   rows in [np, 3, hn] order
    decoder.layers.{i}.self_attention.linear_proj.{weight,bias}
    decoder.layers.{i}.pre_mlp_layernorm.{weight,bias}
    decoder.layers.{i}.mlp.linear_fc1.{weight,bias}
    decoder.layers.{i}.mlp.linear_fc2.{weight,bias}
    decoder.final_layernorm.{weight,bias}
    output_layer.weight                           only when the output layer is not tied
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.model.embedding import LanguageModelEmbedding
from megatron.model.layers import Linear
from megatron.model.module import MegatronModule
from megatron.model.transformer_config import TransformerConfig
from megatron.model.transformer_layer import TransformerBlock


class GPTModel(MegatronModule):
    """Decoder-only transformer language model.

    forward(input_ids [b, s], position_ids [b, s], attention_mask, labels) returns logits
    [b, s, vocab] when labels is None, else per-token cross-entropy losses [b, s] (fp32 unless
    config.fp16_lm_cross_entropy). attention_mask: bool [b or 1, 1, s, s], True = masked out;
    None means causal. With pre_process=False the input comes from set_input_tensor(); with
    post_process=False forward returns the hidden states [s, b, h] (pipeline stages).
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        share_embeddings_and_output_weights: bool = True,
        position_embedding_type: str = "learned_absolute",
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        super().__init__(config)
        if position_embedding_type != "learned_absolute":
            raise ValueError(
                f"position_embedding_type {position_embedding_type!r} is not supported yet "
                "(only 'learned_absolute')"
            )
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.pre_process = pre_process
        self.post_process = post_process

        self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length) if pre_process else None
        self.decoder = TransformerBlock(config, pre_process=pre_process, post_process=post_process)
        self.output_layer: Linear | None = None
        if post_process and not (share_embeddings_and_output_weights and pre_process):
            self.output_layer = Linear(config.hidden_size, vocab_size, config, config.init_method, bias=False)
            if share_embeddings_and_output_weights:
                # A last pipeline stage without the embedding keeps its own copy of the tied
                # weight; as in Megatron it starts at zero and is overwritten from the first
                # stage's embedding (the `shared_embedding` mark tells the sync step which).
                with torch.no_grad():
                    self.output_layer.weight.zero_()
                self.output_layer.weight.shared_embedding = True

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The weight [vocab, h] the output layer multiplies by (the word embedding when tied)."""
        if self.output_layer is not None:
            return self.output_layer.weight
        if self.embedding is None:
            raise ValueError("this GPTModel stage has neither an embedding nor an output layer")
        return self.embedding.word_embeddings.weight

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """Pipeline hook: activations [s, b, h] from the previous stage (a 1-element list is accepted)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel takes a single input tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        decoder_input = self.embedding(input_ids, position_ids) if self.embedding is not None else None  # [s, b, h]
        hidden_states = self.decoder(decoder_input, attention_mask)  # [s, b, h]
        if not self.post_process:
            return hidden_states
        logits = F.linear(hidden_states, self.shared_embedding_or_output_weight())  # [s, b, vocab]
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, vocab] -> [b, s, vocab]
        return self.compute_language_model_loss(labels, logits)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy: labels [b, s], logits [s, b, vocab] -> losses [b, s]."""
        if not self.config.fp16_lm_cross_entropy:
            logits = logits.float()
        s, b, vocab = logits.shape
        labels = labels.transpose(0, 1)  # [b, s] -> [s, b]
        losses = F.cross_entropy(logits.reshape(s * b, vocab), labels.reshape(s * b), reduction="none")  # [s * b]
        return losses.view(s, b).transpose(0, 1).contiguous()  # [s, b] -> [b, s]
