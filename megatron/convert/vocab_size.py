"""The true (unpadded) vocabulary size of a checkpoint's tokenizer, for padding it again at another TP.

Used by `--loader megatron` (megatron/convert/megatron_format.py re-exports true_vocab_size_of).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from megatron.training.checkpoint_safety import CheckpointError

# Tokenizer types whose vocabulary is a tokenizer model (--tokenizer-model), and what a model file
# of each kind is built as when the checkpoint's args name no such type.
_MODEL_TOKENIZERS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer")


def true_vocab_size_of(args: argparse.Namespace, given: Optional[int], vocab_file: Optional[str] = None,
                       tokenizer_model: Optional[str] = None) -> Optional[int]:
    """The tokenizer's vocabulary size: --true-vocab-size, else the tokenizer the files give, else what
    the args tell (NullTokenizer: --vocab-size + 1 for its eod); None when unknown.

    --vocab-file is a JSON vocabulary (GPT-2's vocab.json: its entries), or a WordPiece vocab.txt when
    the checkpoint was trained with a BertWordPiece tokenizer; --tokenizer-model a SentencePiece model
    or a HuggingFace tokenizer (directory or tokenizer.json), counted by the tokenizer class the
    checkpoint's --tokenizer-type names (their special tokens included, as training counted them).
    All that are given must agree. A checkpoint converted from HuggingFace knows its config's vocab_size.
    """
    sizes = []  # (flag, size)
    if given is not None:
        sizes.append((f"--true-vocab-size {given}", given))
    if vocab_file is not None:
        sizes.append((f"--vocab-file {vocab_file}", _vocab_file_size(args, vocab_file)))
    if tokenizer_model is not None:
        sizes.append((f"--tokenizer-model {tokenizer_model}", _tokenizer_model_size(args, tokenizer_model)))
    for flag, size in sizes[1:]:
        if size != sizes[0][1]:
            raise CheckpointError(f"{sizes[0][0]} but {flag} has {size} entries" if given is not None
                                  else f"{sizes[0][0]} has {sizes[0][1]} entries but {flag} has {size}")
    if sizes:
        return sizes[0][1]
    hf_config = getattr(args, "hf_config", None)  # a checkpoint converted from HuggingFace: its vocabulary
    if isinstance(hf_config, dict) and isinstance(hf_config.get("vocab_size"), int):
        return hf_config["vocab_size"]
    if getattr(args, "tokenizer_type", None) == "NullTokenizer" and getattr(args, "vocab_size", None):
        return int(args.vocab_size) + 1
    return None


def _vocab_file_size(args: argparse.Namespace, vocab_file: str) -> int:
    if not os.path.isfile(vocab_file):
        raise CheckpointError(f"--vocab-file {vocab_file} does not exist")
    tokenizer_type = getattr(args, "tokenizer_type", None)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return _built_size(args, tokenizer_type, vocab_file=vocab_file, flag="--vocab-file")
    try:
        with open(vocab_file, "r", encoding="utf-8") as f:
            return len(json.load(f))
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"--vocab-file {vocab_file} is not a JSON vocabulary ({error}); "
                              "pass --true-vocab-size or --tokenizer-model instead") from None


def _tokenizer_model_size(args: argparse.Namespace, path: str) -> int:
    if not os.path.exists(path):
        raise CheckpointError(f"--tokenizer-model {path} does not exist")
    tokenizer_type = getattr(args, "tokenizer_type", None)
    if tokenizer_type not in _MODEL_TOKENIZERS:  # the checkpoint does not say: go by the file
        is_hf = os.path.isdir(path) or path.endswith(".json")
        tokenizer_type = "HuggingFaceTokenizer" if is_hf else "Llama2Tokenizer"
    if tokenizer_type == "HuggingFaceTokenizer" and os.path.isfile(path):
        path = os.path.dirname(os.path.abspath(path))  # tokenizer.json: its folder is what loads
    return _built_size(args, tokenizer_type, tokenizer_model=path, flag="--tokenizer-model")


def _built_size(args: argparse.Namespace, tokenizer_type: str, flag: str, **files: str) -> int:
    from megatron.training.tokenizer.tokenizer import build_tokenizer

    spec = argparse.Namespace(tokenizer_type=tokenizer_type, vocab_extra_ids=getattr(args, "vocab_extra_ids", 0),
                              padded_vocab_size=0, rank=1, **files)  # rank 1: no "building" line
    try:
        return int(build_tokenizer(spec).vocab_size)
    except Exception as error:  # a file the tokenizer library cannot read: name it
        raise CheckpointError(f"{flag} {next(iter(files.values()))}: cannot be read as a {tokenizer_type} "
                              f"({type(error).__name__}: {error})") from None
