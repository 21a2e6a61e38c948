"""`--loader lora`: a LoRA run's adapter-only checkpoint (pretrain_gpt.py --lora-rank; --load-dir holds
lora_base.json). The base it points to is read (our checkpoint, or a transformers directory) and each adapter
is merged into its weight, W + (alpha / r) B A: any full-model saver (megatron, hf, core) writes the merged
model. The adapters themselves travel beside the stream (Metadata.lora) for --saver peft and --saver lora.
"""

from __future__ import annotations

import argparse
from typing import Iterator, Tuple

import torch

from megatron.convert.lora import merged
from megatron.convert.megatron_format import Metadata
from tools.checkpoint.lora_common import base_from_pointer, read_adapters


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="LoRA loader (--load-dir: a LoRA run's checkpoint)")
    group.add_argument("--true-vocab-size", type=int, default=None,
                       help="The tokenizer's vocabulary size (default: from the base checkpoint's args).")


def load_checkpoint(args: argparse.Namespace) -> Tuple[Metadata, Iterator[Tuple[str, torch.Tensor]]]:
    adapters = read_adapters(args.load_dir)
    meta, tensors = base_from_pointer(adapters.base, f"--load-dir {args.load_dir}", args.true_vocab_size)
    meta.lora = adapters
    return meta, merged(tensors, adapters)
