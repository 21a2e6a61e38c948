"""<save>/lora_base.json: the pointer from a LoRA run's adapter-only checkpoints to their base
(format in megatron/training/checkpoint_lora.py). Read and written here, apart from the loading
logic, so that checkpointing.save_checkpoint can write it without importing the loaders."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional

from torch import nn

from megatron.core.atomic_io import atomic_write
from megatron.model.lora import has_lora
from megatron.training.checkpoint_safety import CheckpointError

POINTER_NAME = "lora_base.json"
POINTER_FORMAT = "megatron-lora/1"


def lora_run(model: List[nn.Module]) -> bool:
    return any(has_lora(chunk) for chunk in model)


def lora_settings(args: argparse.Namespace) -> Dict[str, Any]:
    return {"rank": int(args.lora_rank), "alpha": float(args.lora_alpha), "dropout": float(args.lora_dropout),
            "target_modules": list(args.lora_target_modules)}


def read_pointer(directory: str) -> Optional[Dict[str, Any]]:
    """DIR/lora_base.json, checked, or None when DIR has none."""
    path = os.path.join(directory, POINTER_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            pointer = json.load(f)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: not a LoRA base pointer ({error})") from None
    base = pointer.get("base") if isinstance(pointer, dict) else None
    if (pointer.get("format") != POINTER_FORMAT or not isinstance(base, dict)
            or not (("load" in base and isinstance(base.get("iteration"), int)) or "load_hf" in base)):
        raise CheckpointError(f"{path}: not a {POINTER_FORMAT} pointer (format, base.load + base.iteration "
                              "or base.load_hf)")
    return pointer


def write_pointer(save_dir: str, args: argparse.Namespace) -> None:
    """Rank 0 writes <save>/lora_base.json (temp file + rename); the caller saves the adapters after it."""
    base = args.lora_base
    if base is None:
        raise CheckpointError("--lora-rank: this run has no base checkpoint to point to (start it with --load, "
                              "--pretrained-checkpoint or --load-hf): an adapter-only checkpoint would be unusable")
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    os.makedirs(save_dir, exist_ok=True)
    pointer = {"format": POINTER_FORMAT, "base": base, "lora": lora_settings(args)}
    atomic_write(os.path.join(save_dir, POINTER_NAME),
                 lambda f: f.write((json.dumps(pointer, indent=2) + "\n").encode("utf-8")))
