"""BlendedDataset: samples drawn from several datasets in proportion to their weights.

Item i is sample dataset_sample_index[i] of dataset dataset_index[i]. The two arrays are
Megatron-Core's, bit for bit (its greedy C++ helpers redone in numpy: blending_indices.py),
built once and cached beside the GPT indices under path_to_cache as
`<md5>-BlendedDataset-<split>-{description.txt,dataset_index.npy,dataset_sample_index.npy}`,
the md5 of the same JSON description Megatron-Core writes.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron.data import blending_indices
from megatron.data.dataset_config import GPTDatasetConfig
from megatron.data.utils import IndexCache, log_rank_0, log_warning, may_build_indices, normalize

_INDEX_NAMES = ("dataset_index", "dataset_sample_index")


class BlendedDataset(torch.utils.data.Dataset):
    """A weighted interleaving of datasets of the same split.

    Args:
        datasets: the datasets to blend (e.g. GPTDatasets), all of one split.
        weights: their relative weights, normalised here when size is given.
        size: the number of samples; None takes every sample of every dataset once, and then
            the weights must be the whole numbers of samples to take (the dataset lengths).
        config: the dataset configuration (its path_to_cache holds the cache).
    """

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float],
                 size: Optional[int], config: GPTDatasetConfig) -> None:
        super().__init__()
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if not 0 < len(datasets) < np.iinfo(np.int16).max:
            raise ValueError(f"a blend needs between 1 and 32766 datasets, got {len(datasets)}")
        if len({d.index_split for d in datasets}) != 1:
            raise ValueError("every dataset of a blend must belong to the same split")
        self._check_weights(datasets, weights, size)
        if len(datasets) == 1:
            log_warning("building a BlendedDataset of a single dataset")
        self.datasets = list(datasets)
        self.split = self.datasets[0].index_split
        # Megatron-Core normalises only for a sized blend; an exhaustive one keeps the counts
        self.weights: List = normalize(weights) if size is not None else [int(w) for w in weights]
        self.size = None if size is None else int(size)
        self.config = config
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__),
             ("datasets", [d.unique_identifiers for d in self.datasets]),
             ("split", self.split.name), ("weights", self.weights), ("size", self.size)])
        self.unique_description = json.dumps(self.unique_identifiers, indent=4,
                                             default=lambda obj: obj.unique_identifiers)
        self.built_anew_on_cache_miss = False
        arrays = self._load_or_build_indices()
        self.dataset_index = arrays["dataset_index"]  # int16 [len]: dataset of each sample
        self.dataset_sample_index = arrays["dataset_sample_index"]  # int64 [len]: sample in that dataset
        self._check_indices()

    def _check_weights(self, datasets, weights: Sequence[float], size: Optional[int]) -> None:
        for dataset, weight in zip(datasets, weights):
            if not (isinstance(weight, (int, float, np.integer, np.floating)) and weight > 0
                    and np.isfinite(weight)):
                what = getattr(dataset, "dataset_path", None) or type(dataset).__name__
                detail = " (it has no samples in this split)" if size is None and weight == 0 else ""
                raise ValueError(f"blend weight of {what} must be a positive number, got {weight!r}{detail}")
            if size is None and weight != int(weight):
                raise ValueError(f"a blend of every sample (size None) needs whole sample counts as "
                                 f"weights, got {list(weights)}")

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, idx) -> Dict[str, torch.Tensor]:
        """The sample of the chosen dataset, plus "dataset_id" (as Megatron's)."""
        idx = int(idx)
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for a blend of {len(self)} samples")
        dataset_id = int(self.dataset_index[idx])
        sample = self.datasets[dataset_id][int(self.dataset_sample_index[idx])]
        return {"dataset_id": dataset_id, **sample}

    def _load_or_build_indices(self) -> Dict[str, np.ndarray]:
        name = f"{type(self).__name__} {self.split.name} indices"
        if self.config.path_to_cache is None:
            log_rank_0(f"Build the {name} in memory (no path_to_cache)")
            return self._build_indices()
        cache = IndexCache(self.config.path_to_cache, self.unique_description, type(self).__name__, self.split)
        if cache.complete(_INDEX_NAMES):
            log_rank_0(f"Load the {name} from {cache.directory}")
            return cache.load(_INDEX_NAMES)
        if not may_build_indices():
            raise cache.missing_error()
        log_rank_0(f"Build and save the {name} to {cache.directory}")
        arrays = self._build_indices()
        for array_name in _INDEX_NAMES:
            cache.save_array(array_name, arrays[array_name])
        cache.finish()
        self.built_anew_on_cache_miss = True
        return arrays

    def _build_indices(self) -> Dict[str, np.ndarray]:
        start = time.time()
        if self.size is not None:
            dataset_index, dataset_sample_index = blending_indices.build_blending_indices(self.weights, self.size)
        else:
            dataset_index, dataset_sample_index = blending_indices.build_exhaustive_blending_indices(self.weights)
        log_rank_0(f"\t> time elapsed: {time.time() - start:4f} seconds")
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    def _check_indices(self) -> None:
        expected = sum(self.weights) if self.size is None else self.size
        if self.dataset_index.shape[0] != expected:
            raise RuntimeError(f"blend indices hold {self.dataset_index.shape[0]} samples, expected {expected}")
        lengths = np.array([len(d) for d in self.datasets], dtype=np.int64)
        over = np.flatnonzero(self.dataset_sample_index >= lengths[self.dataset_index])
        if len(over):
            d = int(self.dataset_index[over[0]])
            raise IndexError(f"the {self.split.name} blend oversamples dataset {d} "
                             f"({getattr(self.datasets[d], 'dataset_path', None)}): sample "
                             f"{int(self.dataset_sample_index[over[0]])} requested but it has {lengths[d]}; "
                             f"a larger mid_level_dataset_surplus (now {self.config.mid_level_dataset_surplus}) "
                             "gives the blend more room")
