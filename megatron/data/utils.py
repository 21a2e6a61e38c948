"""Helpers shared by the dataset classes: --data-path and --split parsing, logging on rank 0,
and the on-disk cache of index arrays.

Cache layout (as Megatron-Core's): one directory holds, per dataset and split,

    <md5 of the JSON description>-<Class>-<split>-description.txt   written LAST: marks the set complete
    <md5 of the JSON description>-<Class>-<split>-<array>.npy       one file per index array

Every file is written to a temporary name and renamed into place, so a reader never sees a
half-written array, and a set without its description.txt is simply rebuilt.
"""

from __future__ import annotations

import enum
import hashlib
import math
import os
import re
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron.core.atomic_io import atomic_write
from megatron.core.utils import print_line


class Split(enum.Enum):
    """The three splits, in the order of --split and of the builder's sizes."""

    train = 0
    valid = 1
    test = 2


Blend = Tuple[List[str], Optional[List[float]]]


def _as_float(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_path(data_path: Optional[Sequence[str]]) -> Optional[Blend]:
    """Parse Megatron's --data-path into (prefixes, weights or None).

    Accepted forms: one prefix; "w1 p1 w2 p2 ..." (a weighted blend); "p1 p2 ..." (a blend
    whose weights are later inferred from the dataset sizes). Items may hold several
    whitespace-separated words, as when the whole blend is passed as one string. None gives
    None; a list with no prefix in it (e.g. `--data-path ""`) and weights that are not positive
    finite numbers are errors (ValueError naming --data-path).
    """
    if data_path is None:
        return None
    words = [word for item in data_path for word in str(item).split()]
    if not words:
        raise ValueError(f"--data-path {' '.join(repr(str(i)) for i in data_path) or '(nothing)'} names no dataset; "
                         "give a dataset prefix (PREFIX for PREFIX.bin/PREFIX.idx) or 'WEIGHT PREFIX ...'")
    if _as_float(words[0]) is None:  # a plain list of prefixes
        numeric = [w for w in words if _as_float(w) is not None]
        if numeric:
            raise ValueError(f"--data-path {' '.join(words)!r} mixes weights ({numeric}) with unweighted prefixes; "
                             "give either 'PREFIX ...' or 'WEIGHT PREFIX WEIGHT PREFIX ...'")
        return words, None
    if len(words) % 2:
        raise ValueError(f"--data-path {' '.join(words)!r} starts with a weight but has an odd number of items; "
                         "a weighted blend is 'WEIGHT PREFIX WEIGHT PREFIX ...'")
    weights = [_as_float(w) for w in words[0::2]]
    prefixes = words[1::2]
    for raw, weight, prefix in zip(words[0::2], weights, prefixes):
        if weight is None:
            raise ValueError(f"--data-path: {raw!r} is not a number but stands where a weight must be "
                             f"(blend {' '.join(words)!r})")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"--data-path: the weight {raw} of {prefix} must be a positive number "
                             "(to leave a dataset out, remove it from the blend)")
    for prefix in prefixes:
        if _as_float(prefix) is not None:
            raise ValueError(f"--data-path: {prefix!r} stands where a dataset prefix must be "
                             f"(blend {' '.join(words)!r})")
    return prefixes, weights


# Megatron's name for the same function.
get_blend_from_list = parse_data_path


def normalize(weights: Sequence[float]) -> List[float]:
    """Weights divided by their sum, computed as Megatron-Core's utils.normalize computes it
    (numpy float64), so that the floats, and the blends built from them, are bit-identical."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def parse_and_normalize_split(split: str) -> List[float]:
    """'949,50,1' or '949/50/1' -> proportions for train/valid/test (missing ones are 0)."""
    parts = [p.strip() for p in re.split(r"[,/]", str(split)) if p.strip()]
    values = [_as_float(p) for p in parts]
    if not parts or any(v is None for v in values):
        raise ValueError(f"--split {split!r} must be up to three numbers separated by ',' or '/', e.g. '949,50,1'")
    if len(values) > len(Split):
        raise ValueError(f"--split {split!r} has {len(values)} parts; at most 3 (train, valid, test)")
    if any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {split!r} must be non-negative numbers with a positive sum")
    values += [0.0] * (len(Split) - len(values))
    return normalize(values)


def split_matrix(split_vector: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """[(begin, end) or None per split]: the running sums of the proportions, as Megatron-Core's
    convert_split_vector_to_split_matrix adds them (0 first, then left to right); None for a
    split with no share. This list goes into the datasets' descriptions (cache names)."""
    ends = [0]
    for proportion in split_vector:
        ends.append(ends[-1] + proportion)
    return [None if hi <= lo else (lo, hi) for lo, hi in zip(ends[:-1], ends[1:])]


def get_split_indices(split_vector: Sequence[float], num_elements: int) -> List[int]:
    """Boundaries [0, b1, b2, n] of the train/valid/test ranges of `num_elements` items.

    As Megatron-Core: each boundary is the running sum of the proportions times n, rounded
    half to even (Python's round), on its own; split i is items [b_i, b_i+1). Rounding the
    running sums, not summing rounded shares, puts a .5 boundary where Megatron puts it.
    """
    ends = [0]
    for proportion in split_vector:
        ends.append(ends[-1] + proportion)
    return [int(round(end * float(num_elements))) for end in ends]


# ---------------------------------------------------------------------------- distributed


def distributed_rank() -> Optional[int]:
    """Global rank, or None when torch.distributed is not initialised."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return None


def may_build_indices() -> bool:
    """Only global rank 0 builds index caches in a distributed run; the others load them."""
    return distributed_rank() in (None, 0)


def log_rank_0(message: str) -> None:
    """Print on global rank 0 only (or always, without torch.distributed)."""
    if distributed_rank() in (None, 0):
        print_line(message)


def log_warning(message: str) -> None:
    """Print a warning on every rank: each rank's own situation may differ."""
    rank = distributed_rank()
    print_line(f"WARNING{'' if rank is None else f' (rank {rank})'}: {message}")


# ---------------------------------------------------------------------------- index cache


def writable_directory(directory: str) -> Optional[OSError]:
    """Create `directory` if needed and check that a file can be written there; the error, if any."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        return error
    return None


class IndexCache:
    """The cached index arrays of one dataset split, named after the md5 of its description."""

    def __init__(self, directory: str, description: str, class_name: str, split: Split) -> None:
        self.directory = directory
        self.description = description
        self.hash = hashlib.md5(description.encode("utf-8"), usedforsecurity=False).hexdigest()
        self._stem = f"{self.hash}-{class_name}-{split.name}-"

    def path(self, name: str) -> str:
        """Path of the cache file `name` ('description.txt' or '<array>.npy')."""
        return os.path.join(self.directory, self._stem + name)

    def complete(self, array_names: Sequence[str]) -> bool:
        """True when the description and every array are present."""
        names = ["description.txt"] + [f"{a}.npy" for a in array_names]
        return all(os.path.isfile(self.path(n)) for n in names)

    def load(self, array_names: Sequence[str]) -> Dict[str, np.ndarray]:
        """Memory-map every cached array."""
        return {a: np.load(self.path(f"{a}.npy"), mmap_mode="r", allow_pickle=False) for a in array_names}

    def save_array(self, name: str, array: np.ndarray) -> None:
        """Write '<name>.npy' atomically."""
        self._write(f"{name}.npy", lambda f: np.save(f, array, allow_pickle=False))

    def save_text(self, name: str, text: str) -> None:
        """Write the text file `name` atomically (creating the directory)."""
        self._write(name, lambda f: f.write(text.encode("utf-8")))

    def finish(self) -> None:
        """Write description.txt, which marks the set complete: call it after every array."""
        self._write("description.txt", lambda f: f.write(self.description.encode("utf-8")))

    def _write(self, name: str, write) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            atomic_write(self.path(name), write)
        except OSError as error:
            raise OSError(f"cannot write dataset indices to the cache directory {self.directory} "
                          f"(path_to_cache / --data-cache-path): {error}") from error

    def missing_error(self) -> RuntimeError:
        """The error of a rank that may not build and finds no complete cache."""
        return RuntimeError(
            f"rank {distributed_rank()} found no complete index cache {self.path('description.txt')}; in a "
            "distributed run only global rank 0 builds the dataset indices and the other ranks load them "
            "(build them on rank 0 first, e.g. with BlendedMegatronDatasetBuilder, and make the cache "
            "directory visible to every rank)")
