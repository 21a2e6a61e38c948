"""GPTDataset: fixed-length training samples cut from the sequences of an indexed dataset.

The sequences of one split are shuffled (once per epoch) into a document index; the token
stream they make is cut into windows of sequence_length + 1 tokens that overlap by one token
(the next sample's first input is the previous sample's last label), and the windows are
shuffled. The three index arrays are built once, cached as .npy files and memory-mapped.

The cache files are named by the md5 of a JSON description that is Megatron-Core's own
(class, dataset_path, num_samples, index_split, random_seed, sequence_length, split,
split_matrix, tokenizer), so the two find each other's indices when the tokenizer describes
itself the same way (its `unique_identifiers`). Megatron's description does not say which
data it was built from, so loaded indices are checked against the dataset's sizes, and the
token-id range of each split is cached beside them (`...-token_range.json`) so that ids
outside the vocabulary are refused before training without reading the data again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from megatron.data import index_helpers
from megatron.data.dataset_config import GPTDatasetConfig
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError
from megatron.data.utils import (IndexCache, Split, get_split_indices, log_rank_0, log_warning, may_build_indices,
                                 writable_directory)

_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
_TOKEN_RANGE = "token_range.json"  # beside the indices: the split's smallest and largest token id


def tokenizer_identifiers(tokenizer: Any) -> Any:
    """The tokenizer's part of a dataset description: its `unique_identifiers` when it has them
    (Megatron's tokenizers do; a tokenizer reporting Megatron's gives Megatron's cache names),
    else its class name; None without a tokenizer."""
    if tokenizer is None:
        return None
    identifiers = getattr(tokenizer, "unique_identifiers", None)
    if identifiers is not None:
        return identifiers
    return OrderedDict([("class", type(tokenizer).__name__)])


def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod_token: Optional[int], reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool, create_attention_mask: bool
                                    ) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(attention_mask bool [1, s, s] True = masked or None, loss_mask float [s], position_ids long [s]).

    Left-to-right (causal) masks as Megatron's: eod_mask_loss zeroes the loss where the input is
    eod; reset_position_ids restarts positions after each eod; reset_attention_mask stops
    tokens attending across an eod (the eod belongs to the document it ends).
    """
    s = tokens.numel()
    loss_mask = torch.ones(s, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = torch.arange(s, dtype=torch.long)
    reset = reset_position_ids or reset_attention_mask
    # segment of each position: number of eods strictly before it, [s]
    segment = (torch.cumsum((tokens == eod_token).long(), 0) - (tokens == eod_token).long()) if reset else None
    if reset_position_ids:
        is_start = torch.ones(s, dtype=torch.bool)
        is_start[1:] = segment[1:] != segment[:-1]
        segment_start = torch.cummax(torch.where(is_start, position_ids, 0), 0).values  # [s]
        position_ids = position_ids - segment_start
    attention_mask = None
    if create_attention_mask:
        attention_mask = torch.ones(s, s, dtype=torch.bool).triu(1)  # [s, s] True above the diagonal
        if reset_attention_mask:
            attention_mask |= segment[:, None] != segment[None, :]
        attention_mask = attention_mask.unsqueeze(0)  # [1, s, s]
    return attention_mask, loss_mask, position_ids


class GPTDataset(torch.utils.data.Dataset):
    """Samples of one split of an indexed dataset; item i is a dict of tensors.

    Args:
        indexed_dataset: the sequences (a document-level .bin has one sequence per document).
        dataset_path: its path prefix (None for mock data); names the default cache directory.
        indexed_indices: the sequence ids of this split.
        num_samples: samples wanted (more epochs are used when needed); None for one epoch.
        index_split: the split (or its name), used in cache names.
        config: the dataset configuration.
    """

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: Optional[str], indexed_indices: np.ndarray,
                 num_samples: Optional[int], index_split: Split, config: GPTDatasetConfig) -> None:
        super().__init__()
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indices = np.asarray(indexed_indices, dtype=np.int32)
        self.num_samples = num_samples
        self.index_split = Split[index_split] if isinstance(index_split, str) else index_split
        self.config = config
        self._add_extra = int(config.add_extra_token_to_sequence)
        self._eod = getattr(config.tokenizer, "eod", None)
        self.unique_identifiers = self._unique_identifiers()
        self.unique_description = json.dumps(self.unique_identifiers, indent=4,
                                             default=lambda obj: obj.unique_identifiers)
        self.built_anew_on_cache_miss = False
        self._check_token_ids()
        arrays = self._load_or_build_indices()
        self.document_index = arrays["document_index"]  # int32 [num_epochs * num_docs]
        self.sample_index = arrays["sample_index"]  # [num_samples + 1, 2] (doc position, offset)
        self.shuffle_index = arrays["shuffle_index"]  # [num_samples] permutation of sample ids
        self._cached_masks: Optional[Tuple] = None

    # ------------------------------------------------------------------ low-level dataset hooks
    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> IndexedDataset:
        """Open the indexed dataset at `dataset_path`."""
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """Number of sequences, which the split ranges divide."""
        return int(low_level_dataset.sequence_lengths.shape[0])

    # ------------------------------------------------------------------ identity and cache
    def _split_range(self) -> Tuple[int, int]:
        """The sequence range the builder gives this split: [begin, end) of the --split ranges,
        or the whole dataset (blend_per_split)."""
        n = len(self.dataset)
        if self.config.split_vector is None:
            return 0, n
        bounds = get_split_indices(self.config.split_vector, n)
        return bounds[self.index_split.value], bounds[self.index_split.value + 1]

    def _unique_identifiers(self) -> "OrderedDict[str, object]":
        """Megatron-Core's description, plus what it leaves out only where it differs from what
        Megatron-Core would use (other sequences than the split's range, no extra token)."""
        ids: "OrderedDict[str, object]" = OrderedDict()
        ids["class"] = type(self).__name__
        ids["dataset_path"] = self.dataset_path
        ids["num_samples"] = self.num_samples
        ids["index_split"] = self.index_split.name
        ids["random_seed"] = self.config.random_seed
        ids["sequence_length"] = self.config.sequence_length
        ids["split"] = self.config.split
        ids["split_matrix"] = self.config.split_matrix
        ids["tokenizer"] = tokenizer_identifiers(self.config.tokenizer)
        begin, end = self._split_range()
        if not np.array_equal(self.indices, np.arange(begin, end)):
            ids["indexed_indices"] = "md5:" + hashlib.md5(self.indices.tobytes(), usedforsecurity=False).hexdigest()
        if not self.config.add_extra_token_to_sequence:
            ids["add_extra_token_to_sequence"] = False
        return ids

    def _cache(self) -> Optional[IndexCache]:
        """The cache of this dataset's indices (None when there is no directory for it)."""
        directory = self.config.path_to_cache
        if directory is None and self.dataset_path is not None:
            directory = os.path.join(os.path.dirname(os.path.abspath(self.dataset_path)), "cache",
                                     f"{type(self).__name__}_indices")
        if directory is None:
            return None
        return IndexCache(directory, self.unique_description, type(self).__name__, self.index_split)

    def _check_token_ids(self) -> None:
        """Refuse token ids outside the tokenizer's vocabulary (data made with another
        tokenizer), before they crash the embedding; the split's id range is cached."""
        vocab_size = getattr(self.config.tokenizer, "vocab_size", None)
        if vocab_size is None or len(self.indices) == 0:
            return
        begin, end = int(self.indices.min()), int(self.indices.max()) + 1  # the sequences lie in this range
        tokens = int(np.sum(self.dataset.sequence_lengths[begin:end], dtype=np.int64))
        cache = self._cache()
        found = _read_token_range(None if cache is None else cache.path(_TOKEN_RANGE), begin, end, tokens)
        if found is None:
            found = self.dataset.token_range(begin, end)
            if cache is not None and may_build_indices():
                record = {"first_sequence": begin, "end_sequence": end, "tokens": tokens,
                          "min_token_id": found[0], "max_token_id": found[1]}
                try:
                    cache.save_text(_TOKEN_RANGE, json.dumps(record))
                except OSError:
                    pass  # only a shortcut for the next run; building the indices reports an unwritable cache
        low, high = found
        bad = high if high >= vocab_size else (low if low < 0 else None)
        if bad is not None:
            raise IndexedDatasetError(
                f"{self.dataset_path}: token id {bad} in the {self.index_split.name} split is outside the "
                f"vocabulary of the tokenizer ({vocab_size} ids, 0 to {vocab_size - 1}); the dataset was made "
                "with another tokenizer: preprocess it with this run's tokenizer flags, or train with the "
                "tokenizer that made it")

    def _load_or_build_indices(self) -> Dict[str, np.ndarray]:
        name = f"{type(self).__name__} {self.index_split.name} indices"
        cache = self._cache()
        if cache is not None and cache.complete(_INDEX_NAMES):
            log_rank_0(f"Load the {name} from {cache.directory}")
            arrays = self._load_indices(cache)
            stale = self._stale(arrays)
            if stale is None:
                return arrays
            if not may_build_indices():
                raise IndexedDatasetError(f"{cache.path('description.txt')}: the cached indices do not fit "
                                          f"{self.dataset_path} ({stale}); rank 0 should have rebuilt them")
            log_warning(f"the cached {name} in {cache.directory} do not fit {self.dataset_path} ({stale}); "
                        "the data changed since they were built: building them again")
        if cache is not None and self.config.path_to_cache is None:
            error = writable_directory(cache.directory)
            if error is not None:  # the default directory, next to the data, may be read-only
                log_warning(f"cannot write the dataset index cache directory {cache.directory} ({error}); "
                            f"building the {name} in memory. Give path_to_cache (--data-cache-path) to cache "
                            "them elsewhere.")
                cache = None
        if cache is None:
            log_rank_0(f"Build the {name} in memory (no cache directory)")
            return self._build_indices(None)
        if not may_build_indices():
            raise cache.missing_error()
        log_rank_0(f"Build and save the {name}")
        arrays = self._build_indices(cache)
        cache.finish()
        self.built_anew_on_cache_miss = True
        return arrays

    def _expected_lengths(self) -> Tuple[int, int]:
        """(document index length, number of samples) that indices built now would have."""
        tokens_per_epoch = int(np.sum(self.dataset.sequence_lengths[self.indices], dtype=np.int64))
        if tokens_per_epoch == 0:
            return 0, 0
        sequence_length = self.config.sequence_length
        num_epochs = index_helpers.get_num_epochs(tokens_per_epoch, sequence_length, self.num_samples, self._add_extra)
        return num_epochs * len(self.indices), (num_epochs * tokens_per_epoch - self._add_extra) // sequence_length

    def _stale(self, arrays: Dict[str, np.ndarray]) -> Optional[str]:
        """Why cached indices cannot belong to this dataset, or None when their sizes fit it."""
        documents, samples = self._expected_lengths()
        found = (len(arrays["document_index"]), arrays["sample_index"].shape[0] - 1, len(arrays["shuffle_index"]))
        if found != (documents, samples, samples):
            return (f"{found[0]} documents and {found[2]} samples cached, {documents} and {samples} "
                    "expected")
        return None

    def _load_indices(self, cache: IndexCache) -> Dict[str, np.ndarray]:
        arrays = {}
        for array_name in _INDEX_NAMES:
            start = time.time()
            file_name = os.path.basename(cache.path(array_name + ".npy"))
            log_rank_0(f"\tLoad the {array_name.replace('_', ' ')} from {file_name}")
            arrays[array_name] = cache.load([array_name])[array_name]
            log_rank_0(f"\t> time elapsed: {time.time() - start:4f} seconds")
        log_rank_0(f"> total number of samples: {arrays['shuffle_index'].shape[0]}")
        return arrays

    # ------------------------------------------------------------------ building
    def _build_indices(self, cache: Optional[IndexCache]) -> Dict[str, np.ndarray]:
        sequence_length = self.config.sequence_length
        tokens_per_epoch = int(np.sum(self.dataset.sequence_lengths[self.indices], dtype=np.int64))
        if tokens_per_epoch < sequence_length + self._add_extra:
            where = "" if self.config.split is None else f" (--split {self.config.split})"
            raise IndexedDatasetError(
                f"{self.dataset_path or 'mock data'}: the {self.index_split.name} split{where} holds "
                f"{len(self.indices)} of the dataset's {len(self.dataset)} documents, {tokens_per_epoch} tokens, "
                f"too few for one sample of {sequence_length + self._add_extra} tokens (--seq-length "
                f"{sequence_length}{' and the extra label token' if self._add_extra else ''}); give that split a "
                "larger share, use more data or a shorter --seq-length")
        num_epochs = index_helpers.get_num_epochs(tokens_per_epoch, sequence_length, self.num_samples, self._add_extra)
        separate = index_helpers.use_separate_final_epoch(tokens_per_epoch, sequence_length, self.num_samples,
                                                          num_epochs, self._add_extra)
        rng = np.random.RandomState(self.config.random_seed)  # document index first, then shuffle index
        document_index = self._phase(cache, "document_index", lambda: index_helpers.build_document_index(
            self.indices, num_epochs, rng, separate))
        sample_index = self._phase(cache, "sample_index", lambda: index_helpers.build_sample_index(
            self.dataset.sequence_lengths, document_index, sequence_length, self._add_extra))
        total = sample_index.shape[0] - 1
        first = ((num_epochs - 1) * tokens_per_epoch - self._add_extra) // sequence_length if separate else total
        shuffle_index = self._phase(cache, "shuffle_index",
                                    lambda: index_helpers.build_shuffle_index(first, total, rng))
        log_rank_0(f"> total number of samples: {total}")
        log_rank_0(f"> total number of epochs: {num_epochs}")
        return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

    @staticmethod
    def _phase(cache: Optional[IndexCache], array_name: str, build) -> np.ndarray:
        start = time.time()
        what = array_name.replace("_", " ")
        if cache is None:
            log_rank_0(f"\t> Build the {what}")
            array = build()
        else:
            log_rank_0(f"\t> Build and save the {what} to {os.path.basename(cache.path(array_name + '.npy'))}")
            array = build()
            cache.save_array(array_name, array)
        log_rank_0(f"\t> time elapsed: {time.time() - start:4f} seconds")
        return array

    # ------------------------------------------------------------------ samples
    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def _query(self, idx: int) -> np.ndarray:
        """Tokens (int64 [sequence_length + add_extra]) of shuffled sample idx."""
        sample = int(self.shuffle_index[idx])
        begin_pos, begin_offset = (int(x) for x in self.sample_index[sample])
        end_pos, end_offset = (int(x) for x in self.sample_index[sample + 1])
        end_offset += self._add_extra  # the window includes the next sample's first token
        parts = []
        for pos in range(begin_pos, end_pos + 1):
            offset = begin_offset if pos == begin_pos else 0
            length = (end_offset - offset) if pos == end_pos else None
            parts.append(self.dataset.get(int(self.document_index[pos]), offset=offset, length=length))
        text = np.concatenate(parts).astype(np.int64)
        assert text.size == self.config.sequence_length + self._add_extra, "sample index is inconsistent"
        return text

    def __getitem__(self, idx) -> Dict[str, torch.Tensor]:
        """tokens, labels (int64 [s]), loss_mask (float [s]), position_ids (int64 [s]) and, when
        create_attention_mask, attention_mask (bool [1, s, s], True = masked)."""
        idx = int(idx)
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for a dataset of {len(self)} samples")
        text = torch.from_numpy(self._query(idx % len(self)))
        if self._add_extra:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:  # the last label is unknown: 0, with no loss
            tokens, labels = text, torch.roll(text, shifts=-1, dims=0)
            labels[-1] = 0
        attention_mask, loss_mask, position_ids = self._masks(tokens)
        loss_mask = loss_mask.clone()
        if not self._add_extra:
            loss_mask[-1] = 0.0
        sample = {"tokens": tokens, "labels": labels}
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _masks(self, tokens: torch.Tensor):
        cfg = self.config
        cacheable = not (cfg.reset_position_ids or cfg.reset_attention_mask or cfg.eod_mask_loss)
        if cacheable and self._cached_masks is not None:
            return self._cached_masks  # shared between samples; never modified in place
        masks = get_ltor_masks_and_position_ids(tokens, self._eod, cfg.reset_position_ids, cfg.reset_attention_mask,
                                                cfg.eod_mask_loss, cfg.create_attention_mask)
        if cacheable:
            self._cached_masks = masks
        return masks


def _read_token_range(path: Optional[str], begin: int, end: int, tokens: int) -> Optional[Tuple[int, int]]:
    """The cached (min, max) token id of sequences [begin, end), if recorded for the same sizes."""
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        if (record["first_sequence"], record["end_sequence"], record["tokens"]) == (begin, end, tokens):
            return int(record["min_token_id"]), int(record["max_token_id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # unreadable: scan again
    return None


class MockIndexedDataset:
    """Synthetic sequences standing in for an IndexedDataset (deterministic from the seed).

    Sequence i has a random length in [1, 2 * sequence_length) and random token ids in
    [0, vocab_size) other than eod, followed by one eod.
    """

    def __init__(self, config: GPTDatasetConfig, num_sequences: int = 100_000) -> None:
        self.seed = config.random_seed
        self.vocab_size = int(config.tokenizer.vocab_size)
        self.eod = int(config.tokenizer.eod)
        rng = np.random.RandomState(self.seed)
        # int32 [num_sequences]: tokens of each sequence, eod included
        self.sequence_lengths = rng.randint(1, 2 * config.sequence_length, size=num_sequences).astype(np.int32)
        self.document_indices = np.arange(num_sequences + 1, dtype=np.int64)
        self.dtype = np.dtype(np.int64)

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence idx."""
        size = int(self.sequence_lengths[idx])
        rng = np.random.default_rng([self.seed, int(idx)])
        body = rng.integers(0, max(1, self.vocab_size - 1), size=size - 1, dtype=np.int64)
        if 0 <= self.eod < self.vocab_size:
            body[body >= self.eod] += 1  # skip the eod id inside a document
        tokens = np.append(body, self.eod)
        return tokens[offset:size if length is None else offset + length]


class MockGPTDataset(GPTDataset):
    """GPTDataset over MockIndexedDataset: training runs with no data files (config.mock)."""

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> MockIndexedDataset:
        """Synthetic sequences from the config's seed, sequence length and tokenizer."""
        return MockIndexedDataset(config)

    def _unique_identifiers(self) -> "OrderedDict[str, object]":
        ids = super()._unique_identifiers()
        ids["mock_vocab_size"] = self.dataset.vocab_size
        return ids

    def _check_token_ids(self) -> None:
        """Nothing to check: the synthetic ids are drawn below the vocabulary size."""
