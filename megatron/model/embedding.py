"""LanguageModelEmbedding: word + learned absolute position embeddings, then dropout."""

from __future__ import annotations

import torch
from torch import nn

from megatron.model.module import MegatronModule
from megatron.model.transformer_config import TransformerConfig


class LanguageModelEmbedding(MegatronModule):
    """Token ids [b, s] and position ids [b, s] -> embeddings [s, b, h] (Megatron's layout).

    State-dict keys: word_embeddings.weight [vocab, h], position_embeddings.weight [max_s, h].
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int) -> None:
        super().__init__(config)
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        h, dtype = config.hidden_size, config.params_dtype
        self.word_embeddings = nn.Embedding(vocab_size, h, dtype=dtype)
        self.position_embeddings = nn.Embedding(max_sequence_length, h, dtype=dtype)
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.word_embeddings.weight)
                config.init_method(self.position_embeddings.weight)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.max_sequence_length:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} exceeds the model's max_sequence_length "
                f"({self.max_sequence_length}, --max-position-embeddings)"
            )
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)  # [b, s, h]
        embeddings = embeddings.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.config.fp32_residual_connection:
            # The residual stream is kept in fp32 from here on; layer norms hand half back.
            embeddings = embeddings.float()
        return self.embedding_dropout(embeddings)
