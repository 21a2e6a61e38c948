"""`--loader megatron`: this framework's checkpoints (`--ckpt-format torch`, any TP / PP / virtual stages).

The TP shards of each pipeline stage are merged into whole tensors with layout rules derived from
the saved args (megatron/convert/layout_rules.py) and the layers renumbered globally.
"""

from __future__ import annotations

import argparse
from typing import Iterator, Tuple

import torch

from megatron.convert.megatron_format import OURS, Dialect, Metadata, open_source, read_tensors, true_vocab_size_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="Megatron loader")
    group.add_argument("--true-vocab-size", type=int, default=None,
                       help="The tokenizer's vocabulary size, to pad the vocabulary again for the target TP "
                            "(default: from --vocab-file, else the saved args where they tell it, e.g. "
                            "NullTokenizer's --vocab-size).")
    group.add_argument("--vocab-file", type=str, default=None,
                       help="A JSON vocabulary (GPT-2's vocab.json) whose entries count the true vocabulary size "
                            "(a WordPiece vocab.txt for BERT tokenizers).")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="A SentencePiece model or a HuggingFace tokenizer (folder or tokenizer.json): the "
                            "true vocabulary size is its size as the checkpoint's --tokenizer-type counts it.")


def load_checkpoint(args: argparse.Namespace,
                    dialect: Dialect = OURS) -> Tuple[Metadata, Iterator[Tuple[str, torch.Tensor]]]:
    """(metadata, the whole tensors one at a time) of the checkpoint under args.load_dir; `dialect`:
    the files' naming (loader_legacy, loader_core)."""
    source = open_source(args.load_dir, dialect)
    meta = Metadata(source.args, source.iteration, source.release,
                    true_vocab_size_of(source.args, getattr(args, "true_vocab_size", None),
                                       getattr(args, "vocab_file", None), getattr(args, "tokenizer_model", None)))
    return meta, read_tensors(source)
