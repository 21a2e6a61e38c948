"""BlendedMegatronDatasetBuilder: the train/valid/test datasets a GPTDatasetConfig describes.

    mock             -> MockGPTDataset per split (synthetic data, no files)
    blend, 1 prefix  -> GPTDataset per split, over the sequence ranges --split gives
    blend, N prefixes-> per-prefix GPTDatasets (sizes with a 0.5% margin), blended per split
    blend_per_split  -> each split from its own prefix (a GPTDataset) or blend

Sizes, split boundaries and blends are Megatron-Core 0.16's (BlendedMegatronDatasetBuilder),
so the same flags train on the same samples in the same order; tests/unit/
test_blend_megatron_equivalence.py checks them against megatron-core itself.

In a distributed run every dataset is built first on global rank 0 (which writes the index
caches), then, after a barrier, on the other ranks (which only load them).
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from megatron.core import communication
from megatron.data.blended_dataset import BlendedDataset
from megatron.data.dataset_config import GPTDatasetConfig
from megatron.data.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.data.indexed_dataset import IndexedDatasetError
from megatron.data.utils import Split, distributed_rank, get_split_indices, log_warning, normalize

Datasets = List[Optional[torch.utils.data.Dataset]]  # [train, valid, test]


def sizes_per_dataset(weights: Sequence[float], sizes: Sequence[Optional[int]], surplus: float = 0.0
                      ) -> List[List[Optional[int]]]:
    """[dataset][split] samples to take from (surplus 0) or build for each dataset of a weighted
    blend: ceil(ceil(size * w) * (1 + surplus)), as Megatron-Core's _get_size_per_split_per_dataset."""
    return [[s if s is None else int(math.ceil(math.ceil(s * w) * (1 + surplus))) for s in sizes] for w in weights]


class BlendedMegatronDatasetBuilder:
    """Builds [train, valid, test] datasets, with Megatron-Core's sizes and blends.

    Args:
        cls: the dataset class (GPTDataset; MockGPTDataset is used when config.mock).
        sizes: samples wanted per split; 0 means no dataset for that split, None one epoch
            (None needs an unweighted blend, as in Megatron-Core).
        is_built_on_rank: whether this rank needs the datasets (others get None).
        config: the dataset configuration.

    A weighted blend of n samples takes ceil(n * w_d) samples of dataset d (so it holds
    sum_d ceil(n * w_d) >= n samples, as Megatron's) from mid-level datasets built 0.5% larger;
    an unweighted blend takes the datasets' own lengths as weights and min(n, their total)
    samples, or every sample once when n is None.
    """

    def __init__(self, cls: type, sizes: Sequence[Optional[int]], is_built_on_rank: Optional[Callable[[], bool]],
                 config: GPTDatasetConfig) -> None:
        if len(sizes) != len(Split):
            raise ValueError(f"sizes needs one entry per split (train, valid, test), got {list(sizes)}")
        if any(s is not None and s < 0 for s in sizes):
            raise ValueError(f"sizes must be non-negative, got {list(sizes)}")
        self.cls = MockGPTDataset if config.mock and cls is GPTDataset else cls
        self.sizes = list(sizes)
        self.is_built_on_rank = is_built_on_rank or (lambda: True)
        self.config = config
        for split in Split:  # Megatron-Core's rule: a weighted blend needs a number of samples
            blend = config.blend if config.blend_per_split is None else config.blend_per_split[split.value]
            if not config.mock and blend is not None and blend[1] is not None and sizes[split.value] is None:
                raise ValueError(f"the {split.name} split has blend weights but no number of samples (size None); "
                                 "give the number of samples, or no weights to take every sample once")

    def build(self) -> Datasets:
        """[train, valid, test]; None for a split with no data, no samples wanted, or not built here."""
        config = self.config
        if config.mock:
            return self._build_splits(None, config.split_vector, self.sizes)
        if config.blend is not None:
            prefixes, weights = config.blend
            if len(prefixes) == 1 and weights is None:
                return self._build_splits(prefixes[0], config.split_vector, self.sizes)
            return self._build_blend(prefixes, weights, config.split_vector, self.sizes)
        datasets: Datasets = []
        for split in Split:
            blend = config.blend_per_split[split.value]
            if blend is None:
                if self.sizes[split.value]:
                    log_warning(f"no data given for the {split.name} split (blend_per_split[{split.value}] is None)")
                datasets.append(None)
                continue
            only = [0.0] * len(Split)  # the whole of each dataset goes to this split
            only[split.value] = 1.0
            sizes = [0] * len(Split)
            sizes[split.value] = self.sizes[split.value]
            if len(blend[0]) == 1:  # one prefix is never blended here, weighted or not (as Megatron-Core)
                datasets.append(self._build_splits(blend[0][0], only, sizes)[split.value])
            else:
                datasets.append(self._build_blend(blend[0], blend[1], only, sizes)[split.value])
        return datasets

    def _build_splits(self, prefix: Optional[str], split_vector: Sequence[float],
                      sizes: Sequence[Optional[int]]) -> Datasets:
        """One dataset per split of one prefix, over the sequence ranges of `split_vector`."""
        low_level = self.cls.build_low_level_dataset(prefix, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level)
        bounds = get_split_indices(split_vector, num_elements)
        datasets: Datasets = []
        for split in Split:
            i = split.value
            if split_vector[i] == 0 or sizes[i] == 0:
                if split_vector[i] == 0 and sizes[i]:
                    log_warning(f"{sizes[i]} {split.name} samples wanted but --split gives that split no data")
                datasets.append(None)
                continue
            if bounds[i + 1] <= bounds[i]:
                raise self._empty_split_error(prefix, split, num_elements, sizes[i])
            indices = np.arange(bounds[i], bounds[i + 1], dtype=np.int32)  # sequence ids of this split
            datasets.append(self._build_generic(self.cls, self.is_built_on_rank(),
                                                low_level, prefix, indices, sizes[i], split, self.config))
        return datasets

    def _empty_split_error(self, prefix: Optional[str], split: Split, num_elements: int,
                           size: Optional[int]) -> IndexedDatasetError:
        wanted = "one epoch" if size is None else f"{size} samples"
        if self.config.split is None:  # a whole dataset of blend_per_split
            return IndexedDatasetError(f"{prefix}: the {split.name} data has no documents, but the {split.name} "
                                       f"split needs {wanted}")
        return IndexedDatasetError(
            f"{prefix}: --split {self.config.split} leaves the {split.name} split no documents (the dataset has "
            f"{num_elements}), but {wanted} of {split.name} data are needed; give that split a larger share "
            f"or use more data")

    def _build_blend(self, prefixes: Sequence[str], weights: Optional[Sequence[float]],
                     split_vector: Sequence[float], sizes: Sequence[Optional[int]]) -> Datasets:
        """Per-prefix datasets blended per split, with Megatron-Core's sizes."""
        if weights is None:
            # every dataset once ("one epoch"); a split with no samples wanted stays unbuilt
            per_dataset = [[None if s != 0 else 0 for s in sizes] for _ in prefixes]
            targets = None
        else:
            weights = normalize(weights)
            targets = sizes_per_dataset(weights, sizes)
            per_dataset = sizes_per_dataset(weights, sizes, self.config.mid_level_dataset_surplus)
        per_prefix = [self._build_splits(prefix, split_vector, wanted) for prefix, wanted in zip(prefixes, per_dataset)]
        blended: Datasets = []
        for split in Split:
            i = split.value
            parts = [datasets[i] for datasets in per_prefix]
            if split_vector[i] == 0 or sizes[i] == 0:
                blended.append(None)
                continue
            built_here = all(p is not None for p in parts)
            if not built_here:
                blended.append(self._build_generic(BlendedDataset, False))
                continue
            if targets is not None:  # the blend holds every sample it takes from each dataset
                weights_i, size_i = weights, sum(target[i] for target in targets)
            else:
                weights_i = [len(p) for p in parts]
                size_i = None if sizes[i] is None else min(sizes[i], sum(weights_i))
            blended.append(self._build_generic(BlendedDataset, True, parts, weights_i, size_i, self.config))
        return blended

    @staticmethod
    def _build_generic(cls: type, built_here: bool, *args):
        """cls(*args), on global rank 0 first, then (after a barrier) on the other ranks."""
        rank = distributed_rank()
        if rank is None:
            return cls(*args) if built_here else None
        dataset, error = None, None
        if rank == 0 and built_here:
            try:
                dataset = cls(*args)
            except Exception as caught:  # reach the barrier anyway, so the other ranks do not hang
                error = caught
        communication.barrier()
        if error is not None:
            raise error
        if rank != 0 and built_here:
            dataset = cls(*args)
        return dataset
