"""BERTMaskedWordPieceDataset: masked-LM (+ sentence order) samples from sentence-split data.

The data, the --split of documents and the sample index (runs of consecutive sentences of one
document, up to seq_length - 3 tokens) are masked_dataset.py's. Item i is made with
RandomState(seed + i):

    [CLS] A [SEP] B [SEP] [PAD] ...     A, B: the sentences cut at a random sentence boundary
    types         0 ... 0   1 ... 1   0 ...   (binary head: A and B swapped with p = 0.5, is_random)
    padding_mask  1 .................. 0 ...   the longer segment loses a token at a random end
                                              until A + B fit the target length (truncated)

and masked by bert_masking.create_masked_lm_predictions. Every field is numpy int64.

A training script builds the splits as Megatron's pretrain_bert.py does:

    config = bert_dataset_config_from_args(args, tokenizer)   # megatron.training.dataset_configs
    train, valid, test = BlendedMegatronDatasetBuilder(
        BERTMaskedWordPieceDataset, train_valid_test_num_samples, is_built_on_rank, config).build()
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Tuple, Union

import numpy as np

from megatron.data.bert_masking import create_masked_lm_predictions
from megatron.data.indexed_dataset import IndexedDatasetError
from megatron.data.masked_dataset import (LONG_SENTENCE_LEN, MT19937_64, MaskedWordPieceDataset,  # noqa: F401
                                          MaskedWordPieceDatasetConfig, _TargetLengths, build_sample_index)

# [CLS] A [SEP] B [SEP]: three special tokens in every sample.
NUM_SPECIAL_TOKENS = 3


@dataclass(frozen=True)
class BERTMaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """The masking fields plus classification_head (the binary sentence-order head,
    --bert-binary-head). The tokenizer also needs cls and sep."""

    classification_head: bool = True

    model_name: ClassVar[str] = "BERT"
    tokenizer_needs: ClassVar[Tuple[str, ...]] = ("cls", "sep", "mask", "pad", "inv_vocab")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sequence_length < NUM_SPECIAL_TOKENS + 2:
            raise ValueError(
                f"--seq-length {self.sequence_length} is too small for a BERT sample: [CLS] A [SEP] B [SEP] "
                f"takes {NUM_SPECIAL_TOKENS} special tokens, and at least 2 tokens of text are needed "
                f"(--seq-length >= {NUM_SPECIAL_TOKENS + 2})")


# ---------------------------------------------------------------------------- the dataset


class BERTMaskedWordPieceDataset(MaskedWordPieceDataset):
    """BERT samples of one split of a sentence-level indexed dataset; item i is a dict of numpy
    int64: text, types, labels (-1 where not masked), is_random, padding_mask, loss_mask,
    truncated (Megatron-Core's fields). Args: MaskedWordPieceDataset's, with a
    BERTMaskedWordPieceDatasetConfig."""

    def sample_target_length(self) -> int:
        return self.config.sequence_length - NUM_SPECIAL_TOKENS  # [CLS] A [SEP] B [SEP]

    def min_sentences(self) -> int:
        return 2 if self.config.classification_head else 1

    def min_sentences_reason(self) -> str:
        return "the binary head (--bert-binary-head) needs two per sample"

    def extra_identifiers(self) -> "OrderedDict[str, object]":
        return OrderedDict(classification_head=self.config.classification_head)

    # ------------------------------------------------------------------ samples
    def __getitem__(self, idx: int) -> Dict[str, Union[int, np.ndarray]]:
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for a dataset of {len(self)} samples")
        first, end, target = (int(x) for x in self.sample_index[idx])
        sentences = [self.dataset.get(i).tolist() for i in range(first, end)]
        rng = np.random.RandomState(seed=(self.config.random_seed + idx) % 2**32)  # Megatron's per-sample seed
        segment_a, segment_b, is_random = self._split_pair(sentences, rng)
        truncated = _truncate_pair(segment_a, segment_b, target, rng)
        cls, sep = self.config.tokenizer.cls, self.config.tokenizer.sep
        tokens = [cls, *segment_a, sep] + ([*segment_b, sep] if segment_b else [])
        num_a = len(segment_a) + 2
        tokens, positions, labels = create_masked_lm_predictions(
            tokens, target, rng, self._masking, self._specials, self._is_continuation, self.config.tokenizer.mask,
            self._token_lookup)
        return self._pad(tokens, num_a, positions, labels, is_random, truncated)

    def _split_pair(self, sentences: List[List[int]], rng: np.random.RandomState):
        """(A, B, is_random): A the sentences before a random boundary, B the rest (B empty and
        no draw without the binary head); with the head, swapped with p = 0.5."""
        pivot, is_random = len(sentences), False
        if self.config.classification_head:
            if len(sentences) < 2:
                raise IndexedDatasetError(f"{self.dataset_path}: a BERT sample with the binary head needs two "
                                          f"sentences, got {len(sentences)}")
            pivot = int(rng.randint(low=1, high=len(sentences))) if len(sentences) >= 3 else 1
            is_random = rng.random() < 0.5
        segment_a = [t for sentence in sentences[:pivot] for t in sentence]
        segment_b = [t for sentence in sentences[pivot:] for t in sentence]
        if is_random:
            segment_a, segment_b = segment_b, segment_a
        return segment_a, segment_b, is_random

    def _pad(self, tokens: List[int], num_a: int, positions: List[int], labels: List[int], is_random: bool,
             truncated: bool) -> Dict[str, Union[int, np.ndarray]]:
        s, n = self.config.sequence_length, len(tokens)
        assert n <= s, "a BERT sample is longer than the sequence length"
        text = np.full(s, self.config.tokenizer.pad, dtype=np.int64)
        text[:n] = tokens
        types = np.zeros(s, dtype=np.int64)  # 0: [CLS] A [SEP] and padding, 1: B [SEP]
        types[num_a:n] = 1
        padding_mask = np.zeros(s, dtype=np.int64)
        padding_mask[:n] = 1
        label_ids = np.full(s, -1, dtype=np.int64)
        label_ids[positions] = labels
        loss_mask = np.zeros(s, dtype=np.int64)
        loss_mask[positions] = 1
        return {"text": text, "types": types, "labels": label_ids, "is_random": int(is_random),
                "padding_mask": padding_mask, "loss_mask": loss_mask, "truncated": int(truncated)}


def _truncate_pair(segment_a: List[int], segment_b: List[int], target: int, rng: np.random.RandomState) -> bool:
    """Drop tokens (in place) from a random end of the longer segment (B on a tie) until
    len(A) + len(B) <= target; whether any were dropped."""
    if len(segment_a) + len(segment_b) <= target:
        return False
    while len(segment_a) + len(segment_b) > target:
        segment = segment_a if len(segment_a) > len(segment_b) else segment_b
        if rng.random() < 0.5:
            del segment[0]
        else:
            del segment[-1]
    return True
