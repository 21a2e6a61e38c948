"""Megatron-LM's legacy T5Model: megatron.model.T5Model sized by the global args.

    T5Model(config, num_tokentypes=0, parallel_output=True, pre_process=True, post_process=True,
            add_encoder=True, add_decoder=True)
    forward(encoder_input_ids [b, s_enc], decoder_input_ids [b, s_dec], encoder_attn_mask,
            decoder_attn_mask, encoder_decoder_attn_mask, tokentype_ids=None, lm_labels=None)
        -> logits [b, s_dec, v/t], or with lm_labels the per-token loss [b, s_dec]

The masks are Megatron's: bool, True = masked out, [b, sq, sk] as Megatron-LM's legacy T5 takes
them (it adds the head dimension itself) or [b, 1, sq, sk]. The model is the one pretrain_t5.py's
model_provider builds (with a converted HF T5's choices under --use-checkpoint-args), so its keys
and numbers are megatron.model.T5Model's. Pipeline stages are megatron.model.T5Model's: an encoder
stage returns its hidden states, a decoder stage before the last [its hidden states, the encoder
output], which is what this project's schedules pass on (set_input_tensor takes them back).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.convert.t5 import t5_model_kwargs, t5_transformer_config_kwargs
from megatron.legacy.global_args import legacy_args, model_vocab_sizes
from megatron.model import t5_model
from megatron.model.transformer_config import TransformerConfig


class T5Model(t5_model.T5Model):
    """Megatron-LM's legacy constructor and forward over megatron.model.T5Model (module docstring).

    lm_labels may hold -1 (the dataset's decoder padding) or -100 (HF collators): their loss is taken
    at a stand-in id and is removed by the zero loss_mask, as pretrain_t5.py does."""

    def __init__(self, config: TransformerConfig, num_tokentypes: int = 0, parallel_output: bool = True,
                 pre_process: bool = True, post_process: bool = True, add_encoder: bool = True,
                 add_decoder: bool = True) -> None:
        what = "megatron.legacy.model.T5Model"
        args = legacy_args(what)
        if num_tokentypes != 0:
            raise ValueError(f"{what}: T5 has no tokentype embedding, got num_tokentypes={num_tokentypes} (give 0)")
        changes = t5_transformer_config_kwargs(args)  # a converted HF T5's activation; {} for Megatron's T5
        if changes:
            config = dataclasses.replace(config, **changes)
        vocab_size, num_tokens = model_vocab_sizes(args, what)
        super().__init__(config, vocab_size=vocab_size, parallel_output=parallel_output, num_tokens=num_tokens,
                         pre_process=pre_process, post_process=post_process, add_encoder=add_encoder,
                         add_decoder=add_decoder, **t5_model_kwargs(args))

    def forward(self, encoder_input_ids: torch.Tensor | None, decoder_input_ids: torch.Tensor | None,
                encoder_attn_mask: torch.Tensor, decoder_attn_mask: torch.Tensor | None,
                encoder_decoder_attn_mask: torch.Tensor, tokentype_ids: torch.Tensor | None = None,
                lm_labels: torch.Tensor | None = None, enc_hidden_states: torch.Tensor | None = None):
        if tokentype_ids is not None:
            raise ValueError("megatron.legacy.model.T5Model takes no tokentype_ids (T5 has no tokentype embedding)")
        if enc_hidden_states is not None:
            raise ValueError("megatron.legacy.model.T5Model: enc_hidden_states is not supported; a decoder "
                             "pipeline stage takes the encoder output through set_input_tensor()")
        if lm_labels is not None:
            lm_labels = lm_labels.clamp(min=0)  # -1 / -100 on padding: a stand-in id, masked by loss_mask
        return super().forward(encoder_input_ids, decoder_input_ids, encoder_attn_mask, decoder_attn_mask,
                               encoder_decoder_attn_mask, lm_labels=lm_labels)
