"""Masked-LM predictions for WordPiece samples, with Megatron-Core's semantics and random draws.

Given the tokens of one sample ([CLS] A [SEP] B [SEP] for BERT, plain sentences for T5) and the
sample's own numpy RandomState, choose about `masking_probability` of the tokens to predict:

    candidates   every token but [CLS]/[SEP]; with whole-word masking a '##' continuation
                 piece joins the candidate before it, so a word is chosen whole or not at all
    count        min(p * target_length, max(1, round(p * len(tokens)))): p of the WHOLE
                 sequence, [CLS]/[SEP] included, as Megatron counts
    N-grams      each candidate, in a shuffled order, is the start of an N-gram of N candidates,
                 N in 1..max_ngram with P(N) proportional to 1/N (reversed with longer N-grams,
                 or geometric, p = 0.2 as SpanBERT and Megatron), shortened while it would overshoot the count
    replacement  style "bert": per chosen token 80% [MASK], 10% a random vocabulary id, 10%
                 unchanged; style "t5": always [MASK], with no draw (Megatron's masking_style;
                 the T5 dataset then replaces each masked span by one sentinel)

The draws are made from the RandomState in Megatron's order (shuffle, then per N-gram one
choice and per token one or two uniforms and maybe a randint), so a RandomState seeded as
Megatron seeds it gives the same masks as Megatron-Core.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class MaskingOptions:
    """What to mask (Megatron-Core's masking_* config fields)."""

    probability: float = 0.15
    max_ngram: int = 3
    do_full_word: bool = True
    use_longer_ngrams: bool = False
    use_geometric_distribution: bool = False
    style: str = "bert"  # "bert" (80/10/10) or "t5" (always [MASK]), Megatron's masking_style
    geometric_p: float = 0.2  # P(N) = p (1 - p)^(N - 1): SpanBERT's 0.2, Megatron's (mean 1 / p before clipping)

    def __post_init__(self) -> None:
        if self.style not in ("bert", "t5"):
            raise ValueError(f"masking style must be 'bert' or 't5', got {self.style!r}")
        if not 0.0 < self.geometric_p <= 1.0:
            raise ValueError(f"the geometric span-length probability must be in (0, 1], got {self.geometric_p}")


def masking_candidates(token_ids: Sequence[int], special_ids: Sequence[int], is_continuation: np.ndarray,
                       do_full_word: bool) -> List[List[int]]:
    """Position lists that are masked together: single tokens, or whole words with do_full_word.

    is_continuation: bool [vocab], True for '##' pieces. As in Megatron (and Google's BERT), a
    continuation piece joins the last candidate even across a [SEP] (a B segment cut inside a
    word); one with no candidate before it starts its own.
    """
    candidates: List[List[int]] = []
    specials = set(int(s) for s in special_ids)
    for position, token_id in enumerate(token_ids):
        if token_id in specials:
            continue
        if do_full_word and candidates and is_continuation[token_id]:
            candidates[-1].append(position)
        else:
            candidates.append([position])
    return candidates


def _ngram_probabilities(options: MaskingOptions) -> np.ndarray:
    """P(N) for N = 1..max_ngram, proportional to 1/N (reversed with use_longer_ngrams)."""
    probabilities = 1.0 / np.arange(1, options.max_ngram + 1, dtype=np.int64)
    probabilities = probabilities / probabilities.sum(keepdims=True)
    return probabilities[::-1] if options.use_longer_ngrams else probabilities


def _choose_ngram_size(rng: np.random.RandomState, cdf: List[float]) -> int:
    """rng.choice(1..max_ngram, p=probabilities) with the same single draw, without choice's
    per-call checks: legacy choice takes one random_sample() and searches the normalised cdf."""
    return bisect.bisect_right(cdf, rng.random_sample()) + 1


def _replacement(rng: np.random.RandomState, mask_id: int, token_lookup: Sequence[int], style: str) -> Optional[int]:
    """style "bert": 80% [MASK], 10% a random vocabulary id, 10% None (keep the token); "t5": [MASK]."""
    if style == "t5" or rng.random() < 0.8:
        return mask_id
    if rng.random() >= 0.5:
        return int(token_lookup[rng.randint(0, len(token_lookup))])
    return None


def create_masked_lm_predictions(token_ids: Sequence[int], target_length: int, rng: np.random.RandomState,
                                 options: MaskingOptions, special_ids: Sequence[int], is_continuation: np.ndarray,
                                 mask_id: int, token_lookup: Sequence[int]) -> Tuple[List[int], List[int], List[int]]:
    """(masked token ids, masked positions sorted, their original ids) of one sample.

    token_lookup: the ids a random replacement is drawn from (the tokenizer's inv_vocab keys,
    in order, as Megatron draws them).
    """
    masked, spans = create_masked_spans(token_ids, target_length, rng, options, special_ids, is_continuation,
                                        mask_id, token_lookup)
    positions_and_labels = sorted((p, label) for positions, labels in spans for p, label in zip(positions, labels))
    return masked, [p for p, _ in positions_and_labels], [label for _, label in positions_and_labels]


def create_masked_spans(token_ids: Sequence[int], target_length: int, rng: np.random.RandomState,
                        options: MaskingOptions, special_ids: Sequence[int], is_continuation: np.ndarray,
                        mask_id: int, token_lookup: Sequence[int]) -> Tuple[List[int], List[Tuple[List[int], List[int]]]]:
    """(masked token ids, spans): each span one chosen N-gram as (its positions, their original
    ids), the spans sorted by their first position (Megatron-Core's masked_spans). Spans never
    overlap; two may touch (T5 gives each its own sentinel, as Megatron)."""
    candidates = masking_candidates(token_ids, special_ids, is_continuation, options.do_full_word)
    n_maskings = min(options.probability * target_length,
                     max(1, int(round(len(token_ids) * options.probability))))
    cdf = np.cumsum(_ngram_probabilities(options))
    cdf = (cdf / cdf[-1]).tolist()  # as RandomState.choice normalises it
    # per start candidate, the N-grams of sizes 1..max_ngram (shorter at the end: Megatron slices)
    candidate_ngrams = [[candidates[start:start + n] for n in range(1, options.max_ngram + 1)]
                        for start in range(len(candidates))]
    rng.shuffle(candidate_ngrams)

    masked = list(token_ids)
    spans: List[Tuple[List[int], List[int]]] = []
    num_masked = 0
    taken = set()
    for ngrams in candidate_ngrams:
        if num_masked >= n_maskings:
            break
        if options.use_geometric_distribution:
            n = min(int(rng.geometric(options.geometric_p)), options.max_ngram)
        else:
            n = _choose_ngram_size(rng, cdf)
        indices = None
        while n > 0:  # shorten the N-gram until it fits in the count
            ngram = [p for word in ngrams[n - 1] for p in word]
            if n_maskings >= num_masked + len(ngram):
                indices = ngram
                break
            n -= 1
        if indices is None or any(i in taken for i in indices):
            continue
        for index in indices:
            taken.add(index)
            replacement = _replacement(rng, mask_id, token_lookup, options.style)
            masked[index] = token_ids[index] if replacement is None else replacement
        num_masked += len(indices)
        spans.append((indices, [int(token_ids[i]) for i in indices]))
    spans.sort(key=lambda span: span[0][0])
    return masked, spans
