"""Merge every `.bin/.idx` dataset in a folder into one dataset, in sorted name order.

    python tools/merge_datasets.py --input shards/ --output-prefix merged_text_document

All inputs must share one token dtype. Documents keep their order and boundaries: the merged
dataset holds the first dataset's documents, then the second's, and so on. The output is
written under temporary names and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.cli import run_cli
from megatron.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    get_bin_path,
    get_idx_path,
)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True,
                       help="Folder holding the .bin/.idx pairs to merge")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="Path prefix of the merged output, without .bin/.idx")
    group = parser.add_argument_group(title="miscellaneous")
    group.add_argument("--multimodal", action="store_true", help="The inputs are multimodal datasets")
    return parser.parse_args(argv)


def find_prefixes(folder: str) -> List[str]:
    """Sorted path prefixes of the datasets in `folder`; a lone .bin or .idx is an error."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--input {folder}: no such folder")
    stems = {}
    for name in os.listdir(folder):
        stem, ext = os.path.splitext(name)
        if ext in (".bin", ".idx") and not name.startswith("."):
            stems.setdefault(stem, set()).add(ext)
    for stem, exts in stems.items():
        if exts != {".bin", ".idx"}:
            missing = ({".bin", ".idx"} - exts).pop()
            raise IndexedDatasetError(f"{os.path.join(folder, stem)} has no {missing} file")
    if not stems:
        raise IndexedDatasetError(f"--input {folder} holds no .bin/.idx datasets")
    return [os.path.join(folder, stem) for stem in sorted(stems)]


def merge(prefixes: List[str], output_prefix: str, multimodal: bool = False) -> None:
    """Merge the datasets at `prefixes` into `output_prefix`."""
    first = IndexedDataset(prefixes[0], multimodal=multimodal)
    output = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == output for p in prefixes):
        raise IndexedDatasetError(f"--output-prefix {output_prefix} is one of the inputs")
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=first.dtype, multimodal=multimodal) as builder:
        for prefix in prefixes:
            IndexedDataset(prefix, multimodal=multimodal)  # validates the pair (sizes, magic) first
            builder.add_index(prefix)
        builder.finalize(get_idx_path(output_prefix))


def main(argv: Optional[List[str]] = None) -> None:
    args = get_args(argv)
    prefixes = find_prefixes(args.input)
    merge(prefixes, args.output_prefix, args.multimodal)
    merged = IndexedDataset(args.output_prefix, multimodal=args.multimodal)
    print(f"Merged {len(prefixes)} datasets into {args.output_prefix}: "
          f"{merged.num_documents} documents, {len(merged)} sequences, "
          f"{int(merged.sequence_lengths.sum(dtype='int64'))} tokens", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main, "merge_datasets.py")
