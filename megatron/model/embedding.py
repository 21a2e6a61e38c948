"""LanguageModelEmbedding: word (+ learned absolute position, + tokentype) embeddings (+ a LayerNorm), then dropout."""

from __future__ import annotations

import torch
from torch import nn

from megatron.core.tensor_parallel import VocabParallelEmbedding, scatter_to_sequence_parallel_region
from megatron.model.layers import Norm, tensor_parallel_dropout_context
from megatron.model.module import MegatronModule
from megatron.model.transformer_config import TransformerConfig


class LanguageModelEmbedding(MegatronModule):
    """Token ids [b, s] and position ids [b, s] -> embeddings [s, b, h] (Megatron's layout).

    State-dict keys: word_embeddings.weight [vocab/t, h] (this tensor-parallel rank's rows of
    the padded vocabulary), position_embeddings.weight [max_s, h] (replicated; only with
    position_embedding_type "learned_absolute": RoPE and ALiBi act inside the attention),
    tokentype_embeddings.weight [num_tokentypes, h] (replicated; only with num_tokentypes > 0, BERT's
    segment A / B: forward's tokentype_ids [b, s], None meaning type 0 everywhere as in HF).
    layernorm.{weight,bias} [h] (only with layernorm=True: the original BERT's LayerNorm of the summed
    embeddings, before the dropout; HF's embeddings.LayerNorm).

    vocab_size is the padded size; num_tokens (the tokenizer's vocabulary, default vocab_size)
    is how many rows are drawn at initialisation -- the padding rows start at zero, so the
    initial model, and the random stream after it, are the same for every padding. With
    config.include_padded_vocab_in_loss the whole padded [vocab, h] table is drawn by
    init_method, as Megatron draws its master weight (use_cpu_initialization) before splitting
    it: the padding rows then take part in the softmax as Megatron's do.
    Under sequence parallelism the output is this rank's [s/t, b, h] chunk.
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                 num_tokens: int | None = None, position_embedding_type: str = "learned_absolute",
                 num_tokentypes: int = 0, layernorm: bool = False) -> None:
        super().__init__(config)
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        h, dtype = config.hidden_size, config.params_dtype
        drawn_rows = vocab_size if config.include_padded_vocab_in_loss else num_tokens
        self.word_embeddings = VocabParallelEmbedding(vocab_size, h, init_method=config.init_method, config=config,
                                                      num_initialized_embeddings=drawn_rows)
        self.position_embeddings = None  # rope, alibi, none: no table (and no state-dict key)
        if position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(max_sequence_length, h, dtype=dtype)
            if config.perform_initialization:
                with torch.no_grad():
                    config.init_method(self.position_embeddings.weight)
        self.tokentype_embeddings = None  # no table (and no state-dict key) without token types
        if num_tokentypes > 0:  # drawn after the position table, so a GPT model's init is unchanged
            self.tokentype_embeddings = nn.Embedding(num_tokentypes, h, dtype=dtype)
            if config.perform_initialization:
                with torch.no_grad():
                    config.init_method(self.tokentype_embeddings.weight)
        self.layernorm = Norm(h, config) if layernorm else None  # no key without it
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                tokentype_ids: torch.Tensor | None = None, packed: bool = False) -> torch.Tensor:
        """packed: input_ids [1, T] are several sequences' tokens (the inference engine's step, whose
        position_ids stay below max_sequence_length): T itself may be longer."""
        if self.position_embeddings is not None and input_ids.shape[1] > self.max_sequence_length and not packed:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} exceeds the model's max_sequence_length "
                f"({self.max_sequence_length}, --max-position-embeddings)"
            )
        tp = self.config.tensor_model_parallel_size
        if self.config.sequence_parallel and input_ids.shape[1] % tp:
            raise ValueError(f"sequence length {input_ids.shape[1]} is not divisible by the tensor-parallel size "
                             f"({tp}), as --sequence-parallel needs")
        embeddings = self.word_embeddings(input_ids)  # [b, s, h], summed over the TP ranks' vocab slices
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids)  # [b, s, h]
        if self.tokentype_embeddings is not None:
            if tokentype_ids is None:
                embeddings = embeddings + self.tokentype_embeddings.weight[0]  # [b, s, h] + [h]
            else:
                embeddings = embeddings + self.tokentype_embeddings(tokentype_ids)  # [b, s, h]
        elif tokentype_ids is not None:
            raise ValueError("tokentype_ids given but the embedding has no tokentype table (num_tokentypes=0)")
        embeddings = embeddings.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.config.fp32_residual_connection:
            # The residual stream is kept in fp32 from here on; layer norms hand half back.
            embeddings = embeddings.float()
        if self.config.sequence_parallel:
            # Split after the position embeddings are added: their gradient then comes back
            # whole (the split's backward gathers the sequence), so it needs no TP reduction.
            embeddings = scatter_to_sequence_parallel_region(embeddings)  # [s/t, b, h]
        if self.layernorm is not None:  # per token: on this rank's s/t tokens under SP
            embeddings = self.layernorm(embeddings)  # [s, b, h]
        with tensor_parallel_dropout_context(partitioned=self.config.sequence_parallel):
            return self.embedding_dropout(embeddings)
