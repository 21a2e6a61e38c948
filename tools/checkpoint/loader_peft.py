"""`--loader peft`: an HF PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) over a base.

The base is --lora-base (a transformers directory or one of our checkpoints), else the one recorded beside
an export of ours (megatron_lora_base.json), else adapter_config.json's base_model_name_or_path when it is a
local directory. The adapters are mapped to our names (megatron/convert/lora.py) and merged into the base's
weights for a full-model saver, or written as our adapter-only checkpoint with --saver lora.
"""

from __future__ import annotations

import argparse
import os
from typing import Iterator, Tuple

import torch

from megatron.convert.lora import from_peft, hf_config_of, merged
from megatron.convert.megatron_format import Metadata
from megatron.training.checkpoint_safety import CheckpointError
from tools.checkpoint.lora_common import base_from_pointer, base_of, read_peft


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="PEFT loader (--load-dir: a PEFT LoRA adapter directory)")
    group.add_argument("--lora-base", type=str, default=None,
                       help="The base model the adapter was trained on: a transformers directory or one of our "
                            "checkpoints (default: recorded beside our export, else base_model_name_or_path).")
    group.add_argument("--true-vocab-size", type=int, default=None,
                       help="The tokenizer's vocabulary size (default: from the base checkpoint's args).")


def load_checkpoint(args: argparse.Namespace) -> Tuple[Metadata, Iterator[Tuple[str, torch.Tensor]]]:
    where = f"--load-dir {args.load_dir}"
    config, tensors, recorded = read_peft(args.load_dir)
    if args.lora_base is not None:
        meta, stream, base = base_of(args.lora_base, args.true_vocab_size)
    elif recorded is not None:
        meta, stream = base_from_pointer(recorded, where, args.true_vocab_size)
        base = recorded
    elif os.path.isdir(str(config.get("base_model_name_or_path") or "")):
        meta, stream, base = base_of(config["base_model_name_or_path"], args.true_vocab_size)
    else:
        raise CheckpointError(f"{where}: which base model? pass --lora-base (a transformers directory or one of our "
                              "checkpoints)")
    adapters = from_peft(config, tensors, hf_config_of(meta.args, meta.true_vocab_size), where)
    adapters.base = base
    meta.lora = adapters
    return meta, merged(stream, adapters)
