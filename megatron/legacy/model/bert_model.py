"""Megatron-LM's legacy BertModel: megatron.model.BertModel sized by the global args.

    BertModel(config, num_tokentypes=2, add_binary_head=True, parallel_output=True, pre_process=True,
              post_process=True)
    forward(bert_model_input [b, s], attention_mask [b, s] (the padding mask, 1 = real token),
            tokentype_ids=None, lm_labels=None) -> (lm_logits [b, s, v/t] or per-token lm loss [b, s],
            binary_logits [b, 2] or None); the hidden states [s, b, h] on a stage before the last.

The model pretrain_bert.py's model_provider builds (vocabulary args.padded_vocab_size, positions
args.max_position_embeddings, --untie-embeddings-and-output-weights, --bert-post-layernorm), so its
state-dict keys and numbers are megatron.model.BertModel's.
"""

from __future__ import annotations

import torch

from megatron.legacy.global_args import legacy_args, model_vocab_sizes
from megatron.model import bert_model
from megatron.model.transformer_config import TransformerConfig


class BertModel(bert_model.BertModel):
    """Megatron-LM's legacy constructor and forward over megatron.model.BertModel (module docstring).

    lm_labels may hold -1 (the dataset's unmasked positions) or -100 (HF collators): their loss is
    taken at a stand-in id and is removed by the zero loss_mask, as in Megatron's loss."""

    def __init__(self, config: TransformerConfig, num_tokentypes: int = 2, add_binary_head: bool = True,
                 parallel_output: bool = True, pre_process: bool = True, post_process: bool = True) -> None:
        args = legacy_args("megatron.legacy.model.BertModel")
        if args.output_bert_embeddings:
            raise ValueError("megatron.legacy.model.BertModel: --output-bert-embeddings is not supported")
        vocab_size, num_tokens = model_vocab_sizes(args, "megatron.legacy.model.BertModel")
        super().__init__(config, vocab_size=vocab_size, max_sequence_length=args.max_position_embeddings,
                         num_tokentypes=num_tokentypes, add_binary_head=add_binary_head,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                         num_tokens=num_tokens, post_layernorm=args.bert_post_layernorm)

    def forward(self, bert_model_input: torch.Tensor | None, attention_mask: torch.Tensor,
                tokentype_ids: torch.Tensor | None = None, lm_labels: torch.Tensor | None = None,
                inference_context=None):
        if inference_context is not None:
            raise ValueError("megatron.legacy.model.BertModel takes no inference_context (BERT has no KV cache)")
        return super().forward(bert_model_input, attention_mask, tokentype_ids=tokentype_ids, lm_labels=lm_labels)
