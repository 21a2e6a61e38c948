"""Megatron's tokenizer flags, shared by the training arguments and tools/preprocess_data.py.

They are declared once, as megatron.training.config.TokenizerConfig."""
import argparse

from megatron.training.config import TokenizerConfig, add_group
from megatron.training.config.groups import TOKENIZER_TYPES

__all__ = ["TOKENIZER_TYPES", "add_tokenizer_args"]


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the 'tokenizer' argument group with Megatron's names and defaults; returns parser.

    Parallel sizes and rank are not added here: build_tokenizer reads them from the
    namespace when present (tensor_model_parallel_size defaults to 1, rank to 0).
    """
    add_group(parser, TokenizerConfig)
    return parser
