"""GPTDatasetConfig: everything the GPT dataset layer needs, validated up front.

Field names follow Megatron-Core's GPTDatasetConfig; megatron/training/arguments.py translates the flags
(--seed, --seq-length, --data-path, --train/valid/test-data-path, --split, --data-cache-path,
--mock-data, --reset-position-ids, --reset-attention-mask, --eod-mask-loss, ...).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from megatron.data.utils import Split, parse_and_normalize_split, split_matrix

# Megatron's --split default, used for mock data when no split is given.
DEFAULT_MOCK_SPLIT = "969,30,1"


def _check_blend(blend: Any, what: str) -> None:
    if not (isinstance(blend, (tuple, list)) and len(blend) == 2):
        raise ValueError(f"{what} must be a (prefixes, weights or None) pair, got {blend!r}")
    prefixes, weights = blend
    if not prefixes or any(not isinstance(p, str) or not p for p in prefixes):
        raise ValueError(f"{what} needs a non-empty list of dataset path prefixes, got {prefixes!r}")
    if weights is None:
        return
    if len(weights) != len(prefixes):
        raise ValueError(f"{what} has {len(prefixes)} dataset prefixes but {len(weights)} weights")
    for prefix, weight in zip(prefixes, weights):
        if not isinstance(weight, (int, float)) or not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"{what}: the weight of {prefix} must be a positive number, got {weight!r}")


@dataclass(frozen=True)
class GPTDatasetConfig:
    """Configuration of the GPT datasets, their blending and their index caches.

    blend: (prefixes, weights or None), split by `split`. blend_per_split: one blend (or None)
    for each of train/valid/test, instead of blend + split. split: '949,50,1' or '949/50/1',
    normalised into `split_vector`. path_to_cache: where index arrays are cached (default:
    `<dir of dataset prefix>/cache/GPTDataset_indices`). tokenizer: needs `.eod` (and
    `.vocab_size` for mock data).
    """

    random_seed: int
    sequence_length: int
    blend: Optional[Tuple[List[str], Optional[List[float]]]] = None
    blend_per_split: Optional[List[Optional[Tuple[List[str], Optional[List[float]]]]]] = None
    split: Optional[str] = None
    path_to_cache: Optional[str] = None
    mmap_bin_files: bool = True
    mock: bool = False
    tokenizer: Any = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = True
    add_extra_token_to_sequence: bool = True
    # Mid-level datasets of a weighted blend are built this much larger than their share
    # (Megatron's mid_level_dataset_surplus), so that the greedy blend never runs out of samples.
    mid_level_dataset_surplus: float = 0.005
    # [train, valid, test] proportions summing to 1, derived from `split`; None without a split
    split_vector: Optional[List[float]] = field(init=False, default=None)
    # [(begin, end) or None] per split, the running sums of split_vector (Megatron's split_matrix)
    split_matrix: Optional[List[Optional[Tuple[float, float]]]] = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.random_seed, int) or isinstance(self.random_seed, bool):
            raise ValueError(f"random_seed must be an int, got {self.random_seed!r}")
        if not isinstance(self.sequence_length, int) or self.sequence_length < 1:
            raise ValueError(f"sequence_length must be a positive int, got {self.sequence_length!r}")
        self._check_sources()
        split = self.split
        if split is None and self.mock:
            split = DEFAULT_MOCK_SPLIT
        if split is not None:
            object.__setattr__(self, "split_vector", parse_and_normalize_split(split))
            object.__setattr__(self, "split_matrix", split_matrix(self.split_vector))
        if not (isinstance(self.mid_level_dataset_surplus, (int, float)) and self.mid_level_dataset_surplus >= 0):
            raise ValueError(f"mid_level_dataset_surplus must be a non-negative number, "
                             f"got {self.mid_level_dataset_surplus!r}")
        self._check_tokenizer()

    def _check_sources(self) -> None:
        has_per_split = self.blend_per_split is not None and any(b is not None for b in self.blend_per_split)
        if self.blend is not None and has_per_split:
            raise ValueError("blend (--data-path) and blend_per_split (--train/valid/test-data-path) "
                             "are mutually exclusive")
        if has_per_split:
            if len(self.blend_per_split) != len(Split):
                raise ValueError(f"blend_per_split needs one entry per split (train, valid, test), "
                                 f"got {len(self.blend_per_split)}")
            if self.split is not None:
                raise ValueError("split (--split) cannot be used with blend_per_split; "
                                 "each split already has its own data")
            for s, blend in zip(Split, self.blend_per_split):
                if blend is not None:
                    _check_blend(blend, f"blend_per_split[{s.name}]")
        elif self.blend is not None:
            _check_blend(self.blend, "blend (--data-path)")
            if self.split is None:
                raise ValueError("split (--split, e.g. '949,50,1') must be given with blend (--data-path)")
        elif not self.mock:
            raise ValueError("no data: give blend (--data-path), blend_per_split "
                             "(--train/valid/test-data-path) or mock=True (--mock-data)")

    def _check_tokenizer(self) -> None:
        needs_eod = self.mock or self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss
        if needs_eod and (self.tokenizer is None or not hasattr(self.tokenizer, "eod")):
            raise ValueError("a tokenizer with an eod token is needed for mock data, reset_position_ids, "
                             "reset_attention_mask and eod_mask_loss")
        if self.mock and not hasattr(self.tokenizer, "vocab_size"):
            raise ValueError("mock data needs a tokenizer with a vocab_size")

    def replace(self, **changes: Any) -> "GPTDatasetConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)
