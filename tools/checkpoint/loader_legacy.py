"""`--loader legacy`: Megatron-LM checkpoints in the classic naming (`model.language_model.*`).

Any TP / PP / virtual stages, checkpoint_version 0, 1.0, 2.0 and 3.0: each TP shard's fused QKV
rows are put in the current [np, 3, hn] order before the shards are merged (Megatron-LM's
fix_query_key_value_ordering does the same on load), and the keys are renamed to ours
(megatron/convert/legacy.py has the table). Megatron-LM's args become ours; what they do not
tell is refused in one line. The stream is then the megatron loader's.
"""

from __future__ import annotations

import argparse
from typing import Iterator, Tuple

import torch

from megatron.convert.legacy import LegacyDialect
from megatron.convert.megatron_format import Metadata
from tools.checkpoint import loader_megatron


def add_arguments(parser: argparse.ArgumentParser) -> None:
    loader_megatron.add_arguments(parser)  # --true-vocab-size, --vocab-file, --tokenizer-model


def load_checkpoint(args: argparse.Namespace) -> Tuple[Metadata, Iterator[Tuple[str, torch.Tensor]]]:
    """(metadata in our terms, the whole tensors one at a time under our names)."""
    return loader_megatron.load_checkpoint(args, LegacyDialect(getattr(args, "model_type", None) or "GPT"))
