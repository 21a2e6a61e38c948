"""The masked-WordPiece datasets' common part (Megatron-Core's masked_dataset.py): the config of
the masking, the sample index over sentence-level data, its cache, and the masking tables.
BERTMaskedWordPieceDataset (bert_dataset.py) and T5MaskedWordPieceDataset (t5_dataset.py) add
their sample layouts.

The data is a `_text_sentence` indexed dataset (tools/preprocess_data.py --split-sentences):
one sequence per sentence, document_indices marking the documents. The --split ranges divide
DOCUMENTS here (GPT's divide sequences). A sample is a run of consecutive sentences of one
document; its row in the sample index is

    sample_index   uint32 [num_samples, 3]   (first sentence, end sentence, target length)

built as Megatron's C++ helper build_mapping builds it (same std::mt19937 draws of the short
target lengths, same std::mt19937_64 shuffle), cached as `<md5>-<class>-<split>-sample_index.npy`.
The target length is the subclass's (`sample_target_length`: BERT's sequence length less its 3
special tokens, T5's less its BOS and EOS), as is the least number of sentences per sample.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar, List, Optional, Tuple, Union

import numpy as np
import torch

from megatron.data.bert_masking import MaskingOptions
from megatron.data.dataset_config import GPTDatasetConfig
from megatron.data.gpt_dataset import tokenizer_identifiers
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError
from megatron.data.utils import (IndexCache, Split, log_rank_0, log_warning, may_build_indices,
                                 writable_directory)

# Documents holding a sentence longer than this are skipped (Megatron's LONG_SENTENCE_LEN).
LONG_SENTENCE_LEN = 512


def missing_tokenizer_ids(tokenizer: Any, names: Tuple[str, ...]) -> List[str]:
    """The names of `names` the tokenizer lacks (absent, or a property that raises: no such token)."""
    missing = []
    for name in names:
        try:
            getattr(tokenizer, name)
        except Exception:  # AttributeError, or UnsupportedSpecialToken from a tokenizer without it
            missing.append(name)
    return missing


@dataclass(frozen=True)
class MaskedWordPieceDatasetConfig(GPTDatasetConfig):
    """GPTDatasetConfig plus Megatron-Core's masking fields (its MaskedWordPieceDatasetConfig),
    shared by the BERT and T5 datasets. The tokenizer needs pad, mask and inv_vocab (a WordPiece
    vocabulary: '##' continuation pieces join the word before) and what `tokenizer_needs` lists."""

    masking_probability: float = 0.15
    short_sequence_probability: float = 0.1
    masking_max_ngram: int = 3
    masking_do_full_word: bool = True
    masking_use_longer_ngrams: bool = False
    masking_use_geometric_distribution: bool = False
    # Ours: the geometric distribution's p (Megatron fixes SpanBERT's 0.2; 1 / 3 gives T5's mean span 3).
    masking_geometric_p: float = 0.2

    model_name: ClassVar[str] = "masked-LM"
    tokenizer_needs: ClassVar[Tuple[str, ...]] = ("pad", "mask", "inv_vocab")
    masking_style: ClassVar[str] = "bert"

    def __post_init__(self) -> None:
        if self.mock:
            raise ValueError(f"the {self.model_name} dataset has no mock data; give --data-path "
                             "(a _text_sentence dataset)")
        super().__post_init__()
        if not 0.0 < self.masking_probability < 1.0:
            raise ValueError(f"--mask-prob must be in (0, 1), got {self.masking_probability}")
        if not 0.0 <= self.short_sequence_probability <= 1.0:
            raise ValueError(f"--short-seq-prob must be in [0, 1], got {self.short_sequence_probability}")
        if not (isinstance(self.masking_max_ngram, int) and self.masking_max_ngram >= 1):
            raise ValueError(f"masking_max_ngram must be a positive int, got {self.masking_max_ngram!r}")
        if not 0.0 < self.masking_geometric_p <= 1.0:
            raise ValueError(f"masking_geometric_p must be in (0, 1], got {self.masking_geometric_p}")
        missing = missing_tokenizer_ids(self.tokenizer, self.tokenizer_needs)
        if missing:
            raise ValueError(f"the {self.model_name} dataset needs a WordPiece tokenizer (BertWordPieceLowerCase/"
                             f"Case); {type(self.tokenizer).__name__} has no {', '.join(missing)}")

    @property
    def masking(self) -> MaskingOptions:
        """The masking fields, for bert_masking."""
        return MaskingOptions(self.masking_probability, self.masking_max_ngram, self.masking_do_full_word,
                              self.masking_use_longer_ngrams, self.masking_use_geometric_distribution,
                              self.masking_style, self.masking_geometric_p)


# ---------------------------------------------------------------------------- random streams


class MT19937_64:
    """std::mt19937_64 (Megatron shuffles the sample index with it; numpy has no 64-bit MT)."""

    _N, _M = 312, 156
    _MATRIX_A = np.uint64(0xB5026F5AA96619E9)
    _UPPER, _LOWER = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF)

    def __init__(self, seed: int) -> None:
        state = [seed % 2**64]
        for i in range(1, self._N):
            previous = state[-1]
            state.append((6364136223846793005 * (previous ^ (previous >> 62)) + i) % 2**64)
        self._state = np.array(state, dtype=np.uint64)

    def _mix(self, upper: np.ndarray, lower: np.ndarray, far: np.ndarray) -> np.ndarray:
        x = (upper & self._UPPER) | (lower & self._LOWER)
        return far ^ (x >> np.uint64(1)) ^ np.where(x & np.uint64(1), self._MATRIX_A, np.uint64(0))

    def _twist(self) -> None:
        mt, n, m = self._state, self._N, self._M
        mt[:n - m] = self._mix(mt[:n - m], mt[1:n - m + 1], mt[m:])  # reads old words only
        mt[n - m:n - 1] = self._mix(mt[n - m:n - 1], mt[n - m + 1:], mt[:m - 1])  # reads the new first half
        mt[n - 1] = self._mix(mt[n - 1:], mt[:1], mt[m - 1:m])[0]

    def outputs(self, count: int) -> np.ndarray:
        """uint64 [count]: the next outputs (call once per generator: each call twists anew)."""
        blocks = []
        for _ in range(-(-count // self._N)):
            self._twist()
            y = self._state.copy()
            y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
            y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
            y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
            y ^= y >> np.uint64(43)
            blocks.append(y)
        return np.concatenate(blocks)[:count] if blocks else np.zeros(0, dtype=np.uint64)


# ---------------------------------------------------------------------------- sample index


def build_sample_index(document_starts: np.ndarray, document_ends: np.ndarray, sentence_lengths: np.ndarray,
                       num_samples: Optional[int], max_length: int, short_sequence_probability: float, seed: int,
                       min_sentences: int) -> np.ndarray:
    """[n, 3] rows (first sentence, end sentence, target length), shuffled; Megatron's build_mapping.

    Documents are walked in order, epoch after epoch, until at least num_samples rows exist (one
    epoch when None). A document is used when it has min_sentences sentences and, if it has more
    than one, none longer than LONG_SENTENCE_LEN. A sample closes once it holds >= target tokens
    and >= min_sentences sentences, unless only one sentence of the document would remain; the
    last one closes at the document's end. Target lengths are max_length, or with probability
    ~short_sequence_probability a length in [2, max_length], from std::mt19937(seed).
    """
    starts, ends = np.asarray(document_starts, np.int64), np.asarray(document_ends, np.int64)
    counts = ends - starts
    long_sentences = np.concatenate(([0], np.cumsum(np.asarray(sentence_lengths) > LONG_SENTENCE_LEN)))
    has_long = long_sentences[ends] - long_sentences[starts] > 0
    usable = np.flatnonzero((counts >= min_sentences) & ~((counts > 1) & has_long))
    sentence_lengths = np.asarray(sentence_lengths)
    targets = _TargetLengths(seed, short_sequence_probability, max_length)
    rows: List[tuple] = []
    for epoch in range(1 if num_samples is None else np.iinfo(np.int32).max - 1):
        if num_samples is not None and len(rows) >= num_samples or (epoch == 1 and not rows):
            break  # enough samples (checked once per epoch, as Megatron), or none at all
        for doc in usable.tolist():
            first, last = int(starts[doc]), int(ends[doc])
            begin, tokens, sentences, goal = first, 0, 0, targets.next()
            for sentence, length in enumerate(sentence_lengths[first:last].tolist(), start=first):
                tokens += length
                sentences += 1
                remaining = last - sentence - 1
                if (tokens >= goal and remaining > 1 and sentences >= min_sentences) or remaining == 0:
                    rows.append((begin, sentence + 1, goal))
                    begin, tokens, sentences, goal = sentence + 1, 0, 0, targets.next()
    dtype = np.uint32 if len(sentence_lengths) <= np.iinfo(np.uint32).max else np.uint64
    sample_index = np.array(rows, dtype=dtype).reshape(-1, 3)
    return sample_index[_shuffled_order(len(rows), seed + 1)]


class _TargetLengths:
    """Megatron's get_target_sample_len: max_length, or when an mt19937 draw is divisible by
    round(1 / short_sequence_probability), 2 + draw % (max_length - 1)."""

    def __init__(self, seed: int, short_sequence_probability: float, max_length: int) -> None:
        # C++ round(): halves away from zero (Python's round() would take 2.5 to 2)
        self.ratio = math.floor(1.0 / short_sequence_probability + 0.5) if short_sequence_probability > 0 else 0
        self.max_length = max_length
        self.generator = np.random.MT19937()
        self.generator.state = np.random.RandomState(seed % 2**32).get_state(legacy=False)
        self.buffer: List[int] = []
        self.position = 0

    def next(self) -> int:
        if not self.ratio:
            return self.max_length  # no draw at all, as Megatron
        if self.position == len(self.buffer):
            self.buffer, self.position = self.generator.random_raw(1 << 16).tolist(), 0
        value = self.buffer[self.position]
        self.position += 1
        return 2 + value % (self.max_length - 1) if value % self.ratio == 0 else self.max_length


def _shuffled_order(n: int, seed: int) -> np.ndarray:
    """int64 [n]: the order Megatron's Fisher-Yates with std::mt19937_64(seed) leaves rows in."""
    order = list(range(n))
    if n < 2:
        return np.array(order, dtype=np.int64)
    steps = np.arange(n - 1, 0, -1, dtype=np.uint64)  # i = n-1 .. 1
    partners = (MT19937_64(seed).outputs(n - 1) % (steps + np.uint64(1))).tolist()
    for i, j in zip(range(n - 1, 0, -1), partners):
        order[i], order[j] = order[j], order[i]
    return np.array(order, dtype=np.int64)


# ---------------------------------------------------------------------------- the dataset


class MaskedWordPieceDataset(torch.utils.data.Dataset):
    """The samples of one split of a sentence-level indexed dataset (Megatron-Core's
    MaskedWordPieceDataset); subclasses set sample_target_length / min_sentences and write
    __getitem__ (item i draws from RandomState(seed + i), as Megatron).

    Args (those of GPTDataset, which BlendedMegatronDatasetBuilder passes):
        indexed_dataset: the sentences (one sequence each) and their documents.
        dataset_path: its path prefix; names the default cache directory.
        indexed_indices: the DOCUMENT ids of this split.
        num_samples: samples wanted (more epochs are walked when needed); None for one epoch.
        index_split: the split (or its name), used in cache names.
        config: a MaskedWordPieceDatasetConfig (of the subclass).
    """

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: Optional[str], indexed_indices: np.ndarray,
                 num_samples: Optional[int], index_split: Union[Split, str],
                 config: MaskedWordPieceDatasetConfig) -> None:
        super().__init__()
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indices = np.asarray(indexed_indices, dtype=np.int64)
        self.num_samples = num_samples
        self.index_split = Split[index_split] if isinstance(index_split, str) else index_split
        self.config = config
        self.unique_identifiers = self._unique_identifiers()
        self.unique_description = json.dumps(self.unique_identifiers, indent=4,
                                             default=lambda obj: obj.unique_identifiers)
        tokenizer = config.tokenizer
        self._token_lookup = list(tokenizer.inv_vocab.keys())  # random replacements, as Megatron draws them
        self._is_continuation = np.zeros(max(self._token_lookup) + 1, dtype=bool)  # [vocab] '##' pieces
        for token_id, token in tokenizer.inv_vocab.items():
            self._is_continuation[token_id] = token.startswith("##")
        # Megatron's candidates skip [CLS] and [SEP] (T5 samples have none; a tokenizer may lack them)
        self._specials = tuple(getattr(tokenizer, name) for name in ("cls", "sep")
                               if not missing_tokenizer_ids(tokenizer, (name,)))
        self._masking = config.masking
        self.sample_index = self._load_or_build_sample_index()  # [n, 3] (first, end sentence, target)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: MaskedWordPieceDatasetConfig) -> IndexedDataset:
        """Open the sentence-level indexed dataset at `dataset_path`."""
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """Number of documents, which the split ranges divide (sentences stay with their document)."""
        return int(low_level_dataset.document_indices.shape[0]) - 1

    def sample_target_length(self) -> int:
        """The longest run of sentence tokens a sample holds (its special tokens excluded)."""
        raise NotImplementedError

    def min_sentences(self) -> int:
        """The least number of sentences per sample."""
        return 1

    def min_sentences_reason(self) -> str:
        """Why a sample needs min_sentences() sentences (for the error on unsplit data)."""
        return f"a {self.config.model_name} sample needs {self.min_sentences()} sentences"

    def extra_identifiers(self) -> "OrderedDict[str, object]":
        """The subclass's config fields that change its samples (cache names)."""
        return OrderedDict()

    def __len__(self) -> int:
        return int(self.sample_index.shape[0])

    # ------------------------------------------------------------------ sample index
    def _unique_identifiers(self) -> "OrderedDict[str, object]":
        """Megatron-Core's description of the dataset (cache names)."""
        ids: "OrderedDict[str, object]" = OrderedDict()
        ids["class"] = type(self).__name__
        ids["dataset_path"] = self.dataset_path
        ids["num_samples"] = self.num_samples
        ids["index_split"] = self.index_split.name
        cfg = self.config
        for name in ("random_seed", "sequence_length", "split", "split_matrix"):
            ids[name] = getattr(cfg, name)
        ids["tokenizer"] = tokenizer_identifiers(cfg.tokenizer)
        for name in ("masking_probability", "short_sequence_probability", "masking_max_ngram",
                     "masking_do_full_word"):
            ids[name] = getattr(cfg, name)
        ids["masking_do_permutation"] = False
        ids["masking_use_longer_ngrams"] = cfg.masking_use_longer_ngrams
        ids["masking_use_geometric_distribution"] = cfg.masking_use_geometric_distribution
        if cfg.masking_geometric_p != 0.2:  # ours: named only when it differs from Megatron's fixed 0.2
            ids["masking_geometric_p"] = cfg.masking_geometric_p
        ids.update(self.extra_identifiers())
        if len(self.indices) and not np.array_equal(self.indices, np.arange(self.indices[0], self.indices[-1] + 1)):
            ids["indexed_indices"] = "md5:" + hashlib.md5(self.indices.tobytes(), usedforsecurity=False).hexdigest()
        return ids

    def _cache(self) -> Optional[IndexCache]:
        directory = self.config.path_to_cache
        if directory is None and self.dataset_path is not None:
            directory = os.path.join(os.path.dirname(os.path.abspath(self.dataset_path)), "cache",
                                     f"{type(self).__name__}_indices")
            if writable_directory(directory) is not None:
                log_warning(f"cannot write the index cache directory {directory}; building the "
                            f"{self.config.model_name} sample index in memory (give --data-cache-path to cache it elsewhere)")
                return None
        return None if directory is None else IndexCache(directory, self.unique_description, type(self).__name__,
                                                         self.index_split)

    def _load_or_build_sample_index(self) -> np.ndarray:
        name = f"{type(self).__name__} {self.index_split.name} indices"
        cache = self._cache()
        if cache is not None and cache.complete(["sample_index"]):
            log_rank_0(f"Load the {name} from {cache.directory}")
            sample_index = cache.load(["sample_index"])["sample_index"]
            if sample_index.size == 0 or int(sample_index[:, 1].max()) <= len(self.dataset):
                return sample_index
            log_warning(f"the cached {name} in {cache.directory} name sentences past the end of "
                        f"{self.dataset_path}: the data changed since they were built; building them again")
        if cache is not None and not may_build_indices():
            raise cache.missing_error()
        start = time.time()
        sample_index = self._build_sample_index()
        if cache is not None:
            cache.save_array("sample_index", sample_index)
            cache.finish()
        log_rank_0(f"> built the {name} in {time.time() - start:4f} seconds: {sample_index.shape[0]} samples")
        return sample_index

    def _build_sample_index(self) -> np.ndarray:
        documents = self.dataset.document_indices
        starts, ends = documents[self.indices], documents[self.indices + 1]  # sentences of each document
        min_sentences = self.min_sentences()
        counts = ends - starts
        if len(counts) and int(counts.max()) < 2:
            message = (f"{self.dataset_path}: every document of the {self.index_split.name} split has at most one "
                       "sentence: the data was not split into sentences. Preprocess it with "
                       "tools/preprocess_data.py --split-sentences (a _text_sentence dataset)")
            if min_sentences > 1:
                raise IndexedDatasetError(f"{message}; {self.min_sentences_reason()}")
            log_warning(message)
        sample_index = build_sample_index(starts, ends, self.dataset.sequence_lengths, self.num_samples,
                                          self.sample_target_length(),
                                          self.config.short_sequence_probability, self.config.random_seed,
                                          min_sentences)
        if sample_index.shape[0] == 0:
            raise IndexedDatasetError(
                f"{self.dataset_path}: the {self.index_split.name} split ({len(self.indices)} documents) gives no "
                f"{self.config.model_name} sample: a sample needs a document of at least {min_sentences} sentence(s), none longer "
                f"than {LONG_SENTENCE_LEN} tokens; use more data or give that split a larger share")
        return sample_index

