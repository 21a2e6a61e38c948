"""MultipleChoice: each choice scored by a BERT trunk, its pooler, dropout and Linear(h, 1); the
choices' scores are the logits of a softmax over choices (Megatron's
megatron/legacy/model/multiple_choice.py), for RACE (tasks/race).

State-dict keys: the BertModel trunk's (embedding.*, encoder.*, pooler.dense.*) and Megatron's
    multichoice_head.{weight,bias}        [1, h], [1]; replicated over TP
loaded from a pretraining checkpoint as Classification is (classification.py).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.model.bert_model import _linear
from megatron.model.classification import _TaskModel
from megatron.model.transformer_config import TransformerConfig


class MultipleChoice(_TaskModel):
    """forward(input_ids [b, c, s], attention_mask [b, c, s], tokentype_ids [b, c, s]) -> logits
    [b, c] on the last pipeline stage: the c choices of a question go through the trunk as b x c
    sequences. Other stages return the hidden states [s, b x c, h]."""

    head_key = "multichoice_head"

    def _build_task_head(self, config: TransformerConfig) -> None:
        self.multichoice_dropout = nn.Dropout(config.hidden_dropout)
        self.multichoice_head = _linear(config.hidden_size, 1, config)

    def forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask.dim() != 3:
            raise ValueError(f"MultipleChoice takes [batch, choices, sequence] inputs, got the attention mask "
                             f"of shape {tuple(attention_mask.shape)}")
        num_choices = attention_mask.shape[1]
        attention_mask = attention_mask.reshape(-1, attention_mask.shape[-1])  # [b, c, s] -> [b*c, s]
        if input_ids is not None:
            input_ids = input_ids.reshape(-1, input_ids.shape[-1])  # [b, c, s] -> [b*c, s]
        if tokentype_ids is not None:
            tokentype_ids = tokentype_ids.reshape(-1, tokentype_ids.shape[-1])  # [b, c, s] -> [b*c, s]
        pooled = self.pooled(input_ids, attention_mask, tokentype_ids)
        if not self.post_process:
            return pooled  # [s, b*c, h] to the next stage
        scores = self.multichoice_head(self.multichoice_dropout(pooled))  # [b*c, 1]
        return scores.view(-1, num_choices)  # [b*c, 1] -> [b, c]
