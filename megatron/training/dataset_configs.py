"""The BERT and T5 dataset configs of validated args, as Megatron's pretrain_bert.py and
pretrain_t5.py build them: the GPT data flags (gpt_dataset_config_from_args) plus the masking
flags. They read argv's Namespace, so they belong to the framework layer; megatron/data takes
the typed configs only."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron.data.bert_dataset import BERTMaskedWordPieceDatasetConfig
from megatron.data.t5_dataset import T5MaskedWordPieceDatasetConfig
from megatron.training.arguments import gpt_dataset_config_from_args


def bert_dataset_config_from_args(args: Any, tokenizer: Any) -> BERTMaskedWordPieceDatasetConfig:
    """The config pretrain_bert.py builds: the GPT data flags plus --mask-prob (0.15),
    --short-seq-prob (0.1) and --bert-binary-head (True; --bert-no-binary-head), with
    whole-word masking of N-grams up to 3, as Megatron's pretrain_bert.py hard-codes."""
    base = gpt_dataset_config_from_args(args, tokenizer)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    return BERTMaskedWordPieceDatasetConfig(
        **fields, masking_probability=args.mask_prob, short_sequence_probability=args.short_seq_prob,
        masking_max_ngram=3, masking_do_full_word=True, classification_head=args.bert_binary_head)


def t5_dataset_config_from_args(args: Any, tokenizer: Any) -> T5MaskedWordPieceDatasetConfig:
    """The config Megatron's pretrain_t5.py builds: the GPT data flags (--seq-length, alias
    --encoder-seq-length, is the encoder's), --decoder-seq-length, --mask-prob (0.15) and
    --short-seq-prob (0.1), with whole-word N-grams up to 10 of geometric lengths (p = 0.2, or
    1 / --mean-noise-span-length, pretrain_t5.py's flag of ours)."""
    base = gpt_dataset_config_from_args(args, tokenizer)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    return T5MaskedWordPieceDatasetConfig(
        **fields, sequence_length_decoder=args.decoder_seq_length, masking_probability=args.mask_prob,
        short_sequence_probability=args.short_seq_prob, masking_max_ngram=10, masking_do_full_word=True,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=True,
        **_geometric_p(args.mean_noise_span_length))


def _geometric_p(mean_span_length: Optional[float]) -> dict:
    if mean_span_length is None:
        return {}  # Megatron's 0.2
    return {"masking_geometric_p": 1.0 / mean_span_length}
