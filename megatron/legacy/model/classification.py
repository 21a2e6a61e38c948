"""Megatron-LM's legacy Classification: megatron.model.classification.Classification sized by the global args.

    Classification(config, num_classes, num_tokentypes=2, pre_process=True, post_process=True)
    forward(model_input [b, s], attention_mask [b, s] (the padding mask, 1 = real token),
            tokentype_ids=None) -> logits [b, num_classes]; the hidden states [s, b, h] on a stage
            before the last.

The BERT trunk (keys embedding.*, encoder.*, pooler.*) and Megatron's head name
(classification_head.*): a pretraining BertModel's state dict loads into it (its LM and binary
heads are dropped, the new head starts at its initial values with Megatron's warning line).
"""

from __future__ import annotations

import torch

from megatron.legacy.global_args import legacy_args, model_vocab_sizes
from megatron.model import classification
from megatron.model.transformer_config import TransformerConfig


class Classification(classification.Classification):
    """Megatron-LM's legacy constructor and forward over megatron.model's Classification."""

    def __init__(self, config: TransformerConfig, num_classes: int, num_tokentypes: int = 2,
                 pre_process: bool = True, post_process: bool = True) -> None:
        what = "megatron.legacy.model.classification.Classification"
        args = legacy_args(what)
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
            raise ValueError(f"{what}: num_classes must be a positive int, got {num_classes!r}")
        vocab_size, num_tokens = model_vocab_sizes(args, what)
        super().__init__(config, num_classes, vocab_size, args.max_position_embeddings,
                         num_tokentypes=num_tokentypes, pre_process=pre_process, post_process=post_process,
                         num_tokens=num_tokens, post_layernorm=args.bert_post_layernorm)

    def forward(self, model_input: torch.Tensor | None, attention_mask: torch.Tensor,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(model_input, attention_mask, tokentype_ids=tokentype_ids)
