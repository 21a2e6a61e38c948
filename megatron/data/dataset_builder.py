"""BlendedMegatronDatasetBuilder: the train/valid/test datasets a GPTDatasetConfig describes.

    mock             -> MockGPTDataset per split (synthetic data, no files)
    blend, 1 prefix  -> GPTDataset per split, over the sequence ranges --split gives
    blend, N prefixes-> per-prefix GPTDatasets (sizes with a 0.5% margin), blended per split
    blend_per_split  -> each split from its own prefix or blend

In a distributed run every dataset is built first on global rank 0 (which writes the index
caches), then, after a barrier, on the other ranks (which only load them).
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from megatron.data.blended_dataset import BlendedDataset
from megatron.data.dataset_config import GPTDatasetConfig
from megatron.data.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.data.index_helpers import normalize_weights
from megatron.data.utils import Split, distributed_rank, get_split_indices, log_warning

# Mid-level datasets are built this much larger than their share of the blend (Megatron's
# mid_level_dataset_surplus), so that rounding never leaves a blend short of samples.
MID_LEVEL_SURPLUS = 0.005

Datasets = List[Optional[torch.utils.data.Dataset]]  # [train, valid, test]


def _sizes_with_margin(sizes: Sequence[Optional[int]], weight: float) -> List[Optional[int]]:
    """Samples to request from a dataset of the blend: ceil(ceil(size * weight) * 1.005)."""
    return [s if not s else int(math.ceil(math.ceil(s * weight) * (1 + MID_LEVEL_SURPLUS))) for s in sizes]


class BlendedMegatronDatasetBuilder:
    """Builds [train, valid, test] datasets.

    Args:
        cls: the dataset class (GPTDataset; MockGPTDataset is used when config.mock).
        sizes: samples wanted per split; 0 means no dataset for that split, None one epoch.
        is_built_on_rank: whether this rank needs the datasets (others get None).
        config: the dataset configuration.
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

    def build(self) -> Datasets:
        """[train, valid, test]; None for a split with no data, no samples wanted, or not built here."""
        config = self.config
        if config.mock:
            return self._build_splits(None, config.split_vector, self.sizes)
        if config.blend is not None:
            prefixes, weights = config.blend
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
            datasets.append(self._build_blend(blend[0], blend[1], only, sizes)[split.value])
        return datasets

    def _build_splits(self, prefix: Optional[str], split_vector: Sequence[float],
                      sizes: Sequence[Optional[int]]) -> Datasets:
        """One dataset per split of one prefix, over the sequence ranges of `split_vector`."""
        low_level = self.cls.build_low_level_dataset(prefix, self.config)
        bounds = get_split_indices(split_vector, self.cls.numel_low_level_dataset(low_level))
        datasets: Datasets = []
        for split in Split:
            i = split.value
            if split_vector[i] == 0 or sizes[i] == 0:
                if split_vector[i] == 0 and sizes[i]:
                    log_warning(f"{sizes[i]} {split.name} samples wanted but --split gives that split no data")
                datasets.append(None)
                continue
            indices = np.arange(bounds[i], bounds[i + 1], dtype=np.int32)  # sequence ids of this split
            datasets.append(self._build_generic(self.cls, self.is_built_on_rank(),
                                                low_level, prefix, indices, sizes[i], split, self.config))
        return datasets

    def _build_blend(self, prefixes: Sequence[str], weights: Optional[Sequence[float]],
                     split_vector: Sequence[float], sizes: Sequence[Optional[int]]) -> Datasets:
        """Per-prefix datasets blended per split (a lone unweighted prefix is not blended)."""
        if len(prefixes) == 1 and weights is None:
            return self._build_splits(prefixes[0], split_vector, sizes)
        normalized = normalize_weights(weights).tolist() if weights is not None else None
        one_epoch = [None if s else s for s in sizes]  # unweighted: every dataset once (0 stays 0)
        per_prefix = [self._build_splits(prefix, split_vector,
                                         _sizes_with_margin(sizes, w) if normalized else one_epoch)
                      for prefix, w in zip(prefixes, normalized or [None] * len(prefixes))]
        blended: Datasets = []
        for split in Split:
            parts = [datasets[split.value] for datasets in per_prefix]
            if split_vector[split.value] == 0 or sizes[split.value] == 0:
                blended.append(None)
                continue
            built_here = all(p is not None for p in parts)
            weights_i, size_i = self._blend_weights_and_size(parts, normalized, sizes[split.value]) \
                if built_here else (None, None)
            blended.append(self._build_generic(BlendedDataset, built_here, parts, weights_i, size_i, self.config))
        return blended

    @staticmethod
    def _blend_weights_and_size(parts: Sequence[torch.utils.data.Dataset], weights: Optional[List[float]],
                                size: Optional[int]):
        """Given weights: as given, `size` samples (None: as many as no dataset runs out of).
        No weights: the dataset lengths, min(size, total) samples (None: every sample once)."""
        lengths = [len(p) for p in parts]
        if weights is not None:
            if size is None:
                size = min(int(n / w) for n, w in zip(lengths, weights))
            return weights, size
        if size is None:
            return lengths, None
        if size > sum(lengths):
            log_warning(f"{size} samples wanted from an unweighted blend that holds {sum(lengths)} (one epoch of "
                        "each dataset); give weights to draw more epochs")
        return lengths, min(size, sum(lengths))

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
        torch.distributed.barrier()
        if error is not None:
            raise error
        if rank != 0 and built_here:
            dataset = cls(*args)
        return dataset
