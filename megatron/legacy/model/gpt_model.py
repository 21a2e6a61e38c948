"""Megatron-LM's legacy GPTModel: megatron.model.GPTModel sized by the global args.

    GPTModel(config, num_tokentypes=0, parallel_output=True, pre_process=True, post_process=True)
    forward(input_ids [b, s], position_ids [b, s], attention_mask (bool [b or 1, 1, s, s], True = masked
            out; None: causal), labels=None, tokentype_ids=None, inference_context=None)
        -> logits [b, s, v/t], or with labels the per-token loss [b, s]; the hidden states
           [s, b, h] on a stage before the last

The model pretrain_gpt.py's model_provider builds (vocabulary, positions, --untie-embeddings-and-
output-weights, --position-embedding-type and the RoPE flags, --spec), so its keys and numbers are
megatron.model.GPTModel's. Megatron-LM's keyword inference_params is taken as inference_context.
"""

from __future__ import annotations

import torch

from megatron.legacy.global_args import legacy_args, model_vocab_sizes
from megatron.model import gpt_model
from megatron.model.transformer_config import TransformerConfig
from megatron.training.arguments import gpt_model_kwargs


class GPTModel(gpt_model.GPTModel):
    """Megatron-LM's legacy constructor and forward over megatron.model.GPTModel (module docstring)."""

    def __init__(self, config: TransformerConfig, num_tokentypes: int = 0, parallel_output: bool = True,
                 pre_process: bool = True, post_process: bool = True) -> None:
        what = "megatron.legacy.model.GPTModel"
        args = legacy_args(what)
        if num_tokentypes != 0:
            raise ValueError(f"{what}: num_tokentypes={num_tokentypes} is not supported (GPT has no tokentype "
                             "embedding here; give 0, as pretrain_gpt.py does)")
        vocab_size, num_tokens = model_vocab_sizes(args, what)
        super().__init__(config, vocab_size=vocab_size, max_sequence_length=args.max_position_embeddings,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                         num_tokens=num_tokens, **gpt_model_kwargs(args))

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | None, labels: torch.Tensor | None = None,
                tokentype_ids: torch.Tensor | None = None, inference_context=None, *, inference_params=None):
        if tokentype_ids is not None:
            raise ValueError("megatron.legacy.model.GPTModel takes no tokentype_ids (GPT has no tokentype embedding)")
        if inference_params is not None:
            if inference_context is not None:
                raise ValueError("give inference_context or inference_params (its old name), not both")
            inference_context = inference_params
        return super().forward(input_ids, position_ids, attention_mask, labels=labels,
                               inference_context=inference_context)
