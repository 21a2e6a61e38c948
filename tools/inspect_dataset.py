"""Print what an indexed dataset holds, and check it against a tokenizer.

    python tools/inspect_dataset.py --data-path my-gpt2_text_document \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt

Reads and validates the `.bin/.idx` pair, prints document/sequence/token counts and length
statistics, and with tokenizer flags checks that every token id is inside the vocabulary
(a dataset preprocessed with another tokenizer is a common, silent mistake) and shows the
start of the first documents as text.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.cli import run_cli
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError, get_bin_path
from megatron.training.tokenizer import add_tokenizer_args, build_tokenizer


def describe(dataset: IndexedDataset) -> str:
    doc_lengths = dataset.document_lengths()
    tokens = int(doc_lengths.sum())
    lines = [
        f"dataset {dataset.path_prefix}: dtype {dataset.dtype}, {dataset.num_documents} documents, "
        f"{len(dataset)} sequences, {tokens} tokens",
    ]
    if len(doc_lengths):
        lines.append(
            f"document length: min {int(doc_lengths.min())}, mean {doc_lengths.mean():.1f}, "
            f"median {int(np.median(doc_lengths))}, max {int(doc_lengths.max())}, "
            f"empty {int((doc_lengths == 0).sum())}"
        )
    return "\n".join(lines)


def check_vocabulary(dataset: IndexedDataset, vocab_size: int) -> int:
    """Largest token id in the dataset; raises if it does not fit the vocabulary."""
    largest = -1
    if os.path.getsize(get_bin_path(dataset.path_prefix)):
        tokens = np.memmap(get_bin_path(dataset.path_prefix), dtype=dataset.dtype, mode="r")
        chunk = 1 << 26
        for start in range(0, len(tokens), chunk):
            largest = max(largest, int(tokens[start:start + chunk].max()))
    if largest >= vocab_size:
        raise IndexedDatasetError(
            f"{dataset.path_prefix} holds token id {largest}, outside the tokenizer's vocabulary of {vocab_size}: "
            "it was preprocessed with another tokenizer"
        )
    return largest


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-path", required=True, help="Dataset path prefix, without .bin/.idx")
    parser.add_argument("--show-documents", type=int, default=2, help="Documents to print as text")
    parser.add_argument("--show-tokens", type=int, default=48, help="Tokens of each document to print")
    add_tokenizer_args(parser)
    args = parser.parse_args(argv)
    dataset = IndexedDataset(args.data_path)
    print(describe(dataset))
    if args.tokenizer_type is None:
        return
    args.rank, args.tensor_model_parallel_size = 1, 1
    tokenizer = build_tokenizer(args)
    largest = check_vocabulary(dataset, tokenizer.vocab_size)
    print(f"largest token id {largest} fits the {args.tokenizer_type} vocabulary of {tokenizer.vocab_size}")
    for d in range(min(args.show_documents, dataset.num_documents)):
        first, last = dataset.document_indices[d], dataset.document_indices[d + 1]
        ids = np.concatenate([dataset[i] for i in range(first, last)] or [np.zeros(0, dataset.dtype)])
        print(f"document {d} ({len(ids)} tokens): {tokenizer.detokenize(ids[: args.show_tokens].tolist())!r}")


if __name__ == "__main__":
    run_cli(main, "inspect_dataset.py")
