"""Classification: a BERT trunk, its pooler, dropout and a linear layer to num_classes (Megatron's
megatron/legacy/model/classification.py), for the GLUE tasks (tasks/glue).

State-dict keys: the BertModel trunk's (bert_model.py: embedding.*, encoder.*, pooler.dense.*),
so a pretrain_bert.py checkpoint loads into it directly, plus Megatron's head name:
    classification_head.{weight,bias}     [num_classes, h], [num_classes]; replicated over TP
Loading a pretraining checkpoint (load_state_dict below) drops its LM head, output layer and
binary head, and keeps the new head (and a pooler or tokentype table the checkpoint lacks) at
their initial values with Megatron's warning line.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.model.bert_model import BertModel, _linear
from megatron.model.transformer_config import TransformerConfig
from megatron.model.utils import init_rng
from megatron.core.utils import print_rank_last

# Keys of a pretraining BertModel that a task model has no place for.
PRETRAINING_HEAD_PREFIXES = ("lm_head.", "output_layer.", "binary_head.")
# Keys a task model may start without: its own head, and what a --bert-no-binary-head BERT lacks.
OPTIONAL_TRUNK_PREFIXES = ("pooler.", "embedding.tokentype_embeddings.")


class _TaskModel(BertModel):
    """A BertModel trunk with the pooler and no pretraining heads; a subclass adds one head named
    `head_key` in `_build_task_head`."""

    head_key = ""

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                 num_tokentypes: int = 2, pre_process: bool = True, post_process: bool = True,
                 num_tokens: int | None = None, post_layernorm: bool = False) -> None:
        super().__init__(config, vocab_size, max_sequence_length, num_tokentypes=num_tokentypes,
                         add_binary_head=False, share_embeddings_and_output_weights=False,
                         pre_process=pre_process, post_process=post_process, num_tokens=num_tokens,
                         post_layernorm=post_layernorm, add_lm_head=False, add_pooler=True)
        if post_process:
            with init_rng(self.init_seed, config.num_layers + 3):
                self._build_task_head(config)

    def _build_task_head(self, config: TransformerConfig) -> None:
        raise NotImplementedError

    def pooled(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor,
               tokentype_ids: torch.Tensor | None) -> torch.Tensor:
        """[b, s] inputs -> the pooled first token [b, h] on the last stage, else hidden states [s, b, h]."""
        hidden_states = self.encode(input_ids, attention_mask, tokentype_ids)
        if not self.post_process:
            return hidden_states
        return self.pooler(hidden_states, 0)  # [b, h]

    def fill_new_keys(self, present, names=None) -> list:
        """The names (default: this model's state-dict keys) that start new, given the keys
        `present` in a checkpoint: this head's, and a pooler or tokentype table the checkpoint
        lacks, each announced with Megatron's warning line. Any other absent name is an error."""
        names = list(self.state_dict()) if names is None else list(names)
        new = []
        for prefix in (self.head_key + ".",) + OPTIONAL_TRUNK_PREFIXES:
            wanted = [k for k in names if k.startswith(prefix)]
            if wanted and not any(k in present for k in wanted):
                print_rank_last(f"***WARNING*** could not find {prefix.rstrip('.')} in the checkpoint, "
                                "initializing to random")
                new += wanted
        missing = sorted(k for k in names if k not in present and k not in new and not k.endswith("_extra_state"))
        if missing:
            raise RuntimeError(f"{type(self).__name__}: model keys missing from the checkpoint: {missing[:8]}"
                               + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""))
        return new

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a pretraining BertModel's or a task model's state dict (see the module docstring).

        Whatever the caller's strict, the trunk is loaded strictly: a missing or unexpected
        encoder/embedding key is an error naming it."""
        own = self.state_dict()
        entries = {k: v for k, v in state_dict.items() if not k.startswith(PRETRAINING_HEAD_PREFIXES)}
        entries.update({k: own[k] for k in self.fill_new_keys(set(entries))})
        unexpected = sorted(k for k in entries if k not in own and not k.endswith("_extra_state"))
        if unexpected:
            raise RuntimeError(f"{type(self).__name__}: keys the model does not have: {unexpected[:8]}")
        return super().load_state_dict({k: v for k, v in entries.items() if k in own}, strict=False)


class Classification(_TaskModel):
    """BERT -> pooler -> dropout (hidden_dropout) -> Linear(h, num_classes).

    forward(input_ids [b, s], attention_mask [b, s] (the padding mask, 1 = real), tokentype_ids
    [b, s] or None) -> logits [b, num_classes] on the last pipeline stage, the hidden states
    [s, b, h] on the others (the pipeline hooks are BertModel's)."""

    head_key = "classification_head"

    def __init__(self, config: TransformerConfig, num_classes: int, vocab_size: int, max_sequence_length: int,
                 **kwargs) -> None:
        self.num_classes = num_classes
        super().__init__(config, vocab_size, max_sequence_length, **kwargs)

    def _build_task_head(self, config: TransformerConfig) -> None:
        self.classification_dropout = nn.Dropout(config.hidden_dropout)
        self.classification_head = _linear(config.hidden_size, self.num_classes, config)

    def forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        pooled = self.pooled(input_ids, attention_mask, tokentype_ids)
        if not self.post_process:
            return pooled  # [s, b, h] to the next stage
        logits = self.classification_head(self.classification_dropout(pooled))  # [b, num_classes]
        return logits.view(-1, self.num_classes)
