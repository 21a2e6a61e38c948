"""Vectorised numpy builders of the GPT and blending index arrays.

Megatron-Core builds the sample index in a C++ extension; the same arrays come out of these
numpy functions, with no Python loop over samples or tokens. The blending indices (its other
C++ helper) are built by blending_indices.py.

    document_index        int32 [num_epochs * num_docs]   sequence ids, each epoch a shuffled copy
    sample_index          int32/int64 [num_samples+1, 2]  (position in document_index, token offset)
                                                          where each sample starts; row k+1 ends sample k
    shuffle_index         uint32/int64 [num_samples]      permutation of the sample ids
"""

from __future__ import annotations

from typing import Optional

import numpy as np


# Share of an epoch below which the final epoch is shuffled on its own (Megatron's threshold),
# so that the samples drawn from a partial last epoch are not concentrated in the run's end.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def get_num_epochs(tokens_per_epoch: int, sequence_length: int, num_samples: Optional[int],
                   add_extra_token: int) -> int:
    """Smallest e with (e * tokens_per_epoch - add_extra_token) // sequence_length >= num_samples."""
    if num_samples is None:
        return 1
    needed = num_samples * sequence_length + add_extra_token
    return max(1, -(-needed // tokens_per_epoch))


def use_separate_final_epoch(tokens_per_epoch: int, sequence_length: int, num_samples: Optional[int],
                             num_epochs: int, add_extra_token: int) -> bool:
    """Whether the final epoch is shuffled separately (it would give under 80% of an epoch's samples)."""
    if num_epochs == 1 or num_samples is None:
        return False
    samples_sans_final = ((num_epochs - 1) * tokens_per_epoch - add_extra_token) // sequence_length
    samples_from_final = num_samples - samples_sans_final
    samples_per_epoch = (tokens_per_epoch - add_extra_token) // sequence_length
    assert 0 <= samples_from_final <= samples_per_epoch + 1
    return samples_from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)


def build_document_index(sequence_ids: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """int32 [num_epochs * len(sequence_ids)]: the ids repeated num_epochs times and shuffled.

    With a separate final epoch the first num_epochs - 1 copies are shuffled together and the
    last copy on its own (two draws from `rng`, in that order).
    """
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(sequence_ids, num_epochs - 1, rng, False)
        last = build_document_index(sequence_ids, 1, rng, False)
        return np.concatenate((first, last))
    document_index = np.tile(np.asarray(sequence_ids, dtype=np.int32), num_epochs)
    rng.shuffle(document_index)
    return document_index


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, sequence_length: int,
                       add_extra_token: int) -> np.ndarray:
    """[num_samples + 1, 2] (position in document_index, offset in that document) of each sample start.

    Sample k covers tokens [k * sequence_length, k * sequence_length + sequence_length + add_extra_token)
    of the stream made by concatenating the documents in document_index order. As in Megatron's
    loop, a start (k >= 1) is placed in the first document whose end reaches start + add_extra_token:
    with the extra token that is the document holding the start token (never an empty one),
    without it a start on a boundary stays at the end of the earlier document. Row 0 is (0, 0).
    """
    sequence_lengths = np.asarray(sequence_lengths)
    ends = np.cumsum(sequence_lengths[document_index], dtype=np.int64)  # end of each doc position in the stream
    total = int(ends[-1]) if len(ends) else 0
    num_samples = max(0, (total - add_extra_token) // sequence_length)
    dtype = np.int32 if len(document_index) < np.iinfo(np.int32).max else np.int64
    starts = np.arange(1, num_samples + 1, dtype=np.int64) * sequence_length
    positions = np.searchsorted(ends, starts + add_extra_token, side="left")
    sample_index = np.zeros((num_samples + 1, 2), dtype=dtype)
    sample_index[1:, 0] = positions
    sample_index[1:, 1] = starts - ends[positions] + sequence_lengths[document_index[positions]]
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """[total_size] permutation: [0, num_samples) shuffled, then [num_samples, total_size) shuffled."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))

