"""T5MaskedWordPieceDataset: span-corruption samples from sentence-split data (Megatron-Core's T5).

The data, the --split of documents and the sample index (runs of consecutive sentences of one
document, up to encoder_seq_length - 2 tokens, shorter with --short-seq-prob) are
masked_dataset.py's. Item i draws from RandomState(seed + i): its sentences are joined and cut
to the target length, and bert_masking chooses the spans (Megatron's pretrain_t5.py settings:
--mask-prob of the tokens, whole words, N-grams of N ~ min(Geometric(0.2), 10) words, each
shortened while it would overshoot the count; masking style "t5"). With s1, s2, ... the
tokenizer's sentinels <extra_id_0>, <extra_id_1>, ... (--vocab-extra-ids), one per span in order:

    text_enc   a b s1 e f s2 i [PAD] ...          the text, each masked span replaced by its sentinel
    text_dec   [BOS] s1 c d s2 g h [PAD] ...      the decoder input: BOS, then sentinel + span per span
    labels     s1 c d s2 g h [EOS] -1 ...         the decoder input shifted left, EOS last
    loss_mask  1 1 1 1 1 1 1 0 ...                1 on the labels that are not padding
    enc_mask   1 on the real encoder tokens, dec_mask 1 on the real decoder tokens
    truncated  1 when the sentences were cut to the target length

(original text "a b c d e f g h i"), every field numpy int64, text_enc [encoder_seq_length], the
others [decoder_seq_length] (Megatron-Core 0.13's keys; pretrain_t5.py turns enc_mask and dec_mask
into the model's three bool attention masks). Filling each sentinel of text_enc with the tokens
that follow it in labels gives back the cut text.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Tuple, Union

import numpy as np

from megatron.data.bert_masking import create_masked_spans
from megatron.data.indexed_dataset import IndexedDatasetError
from megatron.data.masked_dataset import MaskedWordPieceDataset, MaskedWordPieceDatasetConfig

# The decoder's [BOS] and the labels' [EOS]: Megatron keeps the encoder's target 2 shorter for them.
NUM_SPECIAL_TOKENS = 2


def t5_max_spans(masking_probability: float, encoder_length: int) -> int:
    """The most masked spans (so sentinels) a sample can have: each span is at least one of the at
    most masking_probability x (encoder_length - 2) masked tokens."""
    return math.floor(masking_probability * (encoder_length - NUM_SPECIAL_TOKENS))


def t5_min_decoder_length(masking_probability: float, encoder_length: int) -> int:
    """BOS, the about round(p x target) tokens a full-length sample masks, and one sentinel: below
    this nearly every full sample overflows the decoder (1 + 2 x t5_max_spans always fits)."""
    return 1 + round(masking_probability * (encoder_length - NUM_SPECIAL_TOKENS)) + 1


@dataclass(frozen=True)
class T5MaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """The masking fields (with Megatron's pretrain_t5.py values as defaults: N-grams up to 10 whole
    words, geometric lengths) plus sequence_length_decoder; sequence_length is the encoder's. The
    tokenizer needs bos, eos, pad, mask, inv_vocab and sentinels (additional_special_tokens_ids)."""

    sequence_length_decoder: Optional[int] = None
    masking_max_ngram: int = 10
    masking_use_geometric_distribution: bool = True

    model_name: ClassVar[str] = "T5"
    tokenizer_needs: ClassVar[Tuple[str, ...]] = ("bos", "eos", "pad", "mask", "inv_vocab")
    masking_style: ClassVar[str] = "t5"

    def __post_init__(self) -> None:
        super().__post_init__()
        encoder, decoder = self.sequence_length, self.sequence_length_decoder
        if encoder < NUM_SPECIAL_TOKENS + 1:
            raise ValueError(f"--encoder-seq-length {encoder} is too small for a T5 sample: the target leaves "
                             f"{NUM_SPECIAL_TOKENS} tokens for BOS and EOS (--encoder-seq-length >= 3)")
        if decoder is None:
            raise ValueError("the T5 dataset needs --decoder-seq-length (the decoder input and labels length)")
        needed = t5_min_decoder_length(self.masking_probability, encoder)
        if decoder < needed:
            raise ValueError(
                f"--decoder-seq-length {decoder} is too short: a full-length sample (--encoder-seq-length "
                f"{encoder}, --mask-prob {self.masking_probability}) masks about "
                f"{needed - 2} tokens, and the decoder holds BOS, a sentinel per span and those tokens "
                f"(give --decoder-seq-length >= {needed}, and room for the sentinels: Megatron uses 512 / 128)")
        sentinels = len(self.tokenizer.additional_special_tokens_ids)
        if sentinels < self.max_spans:
            raise ValueError(
                f"the T5 dataset needs a sentinel per masked span, up to {self.max_spans} (--mask-prob "
                f"{self.masking_probability} of {self.sample_target_length} tokens), but the tokenizer has "
                f"{sentinels}: give --vocab-extra-ids {max(100, self.max_spans)} (the <extra_id_i> tokens)")

    @property
    def sequence_length_encoder(self) -> int:
        """Megatron-Core's other name of sequence_length."""
        return self.sequence_length

    @property
    def sample_target_length(self) -> int:
        """The most tokens of text a sample holds (Megatron: the encoder length less BOS and EOS)."""
        return self.sequence_length - NUM_SPECIAL_TOKENS

    @property
    def max_spans(self) -> int:
        """The most spans a sample can have: each span is at least one of the at most
        masking_probability x target tokens masked."""
        return t5_max_spans(self.masking_probability, self.sequence_length)


class T5MaskedWordPieceDataset(MaskedWordPieceDataset):
    """T5 samples of one split of a sentence-level indexed dataset (see the module docstring).
    Args: MaskedWordPieceDataset's, with a T5MaskedWordPieceDatasetConfig."""

    def sample_target_length(self) -> int:
        return self.config.sample_target_length

    def extra_identifiers(self) -> "OrderedDict[str, object]":
        return OrderedDict(sequence_length_decoder=self.config.sequence_length_decoder)

    def __getitem__(self, idx: int) -> Dict[str, Union[int, np.ndarray]]:
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for a dataset of {len(self)} samples")
        first, end, target = (int(x) for x in self.sample_index[idx])
        tokens = [t for i in range(first, end) for t in self.dataset.get(i).tolist()]
        rng = np.random.RandomState(seed=(self.config.random_seed + idx) % 2**32)  # Megatron's per-sample seed
        truncated = len(tokens) > target
        tokens = tokens[:target]
        _, spans = create_masked_spans(tokens, target, rng, self._masking, self._specials, self._is_continuation,
                                       self.config.tokenizer.mask, self._token_lookup)
        encoder, decoder, labels = self._corrupt(idx, tokens, spans)
        return self._pad(encoder, decoder, labels, truncated)

    def _corrupt(self, idx: int, tokens: List[int], spans: List[Tuple[List[int], List[int]]]):
        """(encoder input, decoder input, labels) before padding: each span becomes a sentinel in
        the encoder input, and sentinel + span in the decoder input ([BOS] first) and labels ([EOS] last)."""
        tokenizer = self.config.tokenizer
        sentinels = tokenizer.additional_special_tokens_ids
        if len(spans) > len(sentinels):  # the config's bound makes this unreachable; kept as a guard
            raise ValueError(f"T5 sample {idx} has {len(spans)} masked spans but the tokenizer has "
                             f"{len(sentinels)} sentinels; give a larger --vocab-extra-ids")
        encoder: List[int] = []
        targets: List[int] = []
        start = 0
        for sentinel, (positions, original) in zip(sentinels, spans):
            encoder += tokens[start:positions[0]] + [sentinel]
            targets += [sentinel] + original
            start = positions[-1] + 1
        encoder += tokens[start:]
        decoder, labels = [tokenizer.bos] + targets, targets + [tokenizer.eos]
        limit = self.config.sequence_length_decoder
        if len(decoder) > limit:
            raise IndexedDatasetError(
                f"{self.dataset_path}: T5 sample {idx} needs {len(decoder)} decoder tokens (BOS, {len(spans)} sentinels and "
                f"{len(targets) - len(spans)} masked tokens) but --decoder-seq-length is {limit}; raise it (at "
                f"most 1 + 2 x {self.config.max_spans} = {1 + 2 * self.config.max_spans} can be needed)")
        return encoder, decoder, labels

    def _pad(self, encoder: List[int], decoder: List[int], labels: List[int],
             truncated: bool) -> Dict[str, Union[int, np.ndarray]]:
        s_enc, s_dec, pad = self.config.sequence_length, self.config.sequence_length_decoder, self.config.tokenizer.pad
        assert len(encoder) <= s_enc, "a T5 encoder input is longer than --encoder-seq-length"

        def padded(values: List[int], length: int, fill: int) -> np.ndarray:
            out = np.full(length, fill, dtype=np.int64)
            out[:len(values)] = values
            return out

        def real(count: int, length: int) -> np.ndarray:
            return padded([1] * count, length, 0)

        return {"text_enc": padded(encoder, s_enc, pad), "text_dec": padded(decoder, s_dec, pad),
                "labels": padded(labels, s_dec, -1), "loss_mask": real(len(decoder), s_dec),
                "truncated": int(truncated), "enc_mask": real(len(encoder), s_enc),
                "dec_mask": real(len(decoder), s_dec)}
