"""What the LoRA plugins share (loader_lora, loader_peft, saver_peft, saver_lora): the base model's stream
from a pointer, our adapter-only checkpoints read and written, PEFT files read and written.
Formats: megatron/convert/lora.py (PEFT names) and megatron/training/checkpoint_lora.py (lora_base.json)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from megatron.convert.lora import Adapters, check_complete
from megatron.convert.megatron_format import Metadata, open_source, read_tensors, target_args
from megatron.core.atomic_io import atomic_write
from megatron.training.checkpoint_safety import CheckpointError
from megatron.training.lora_pointer import POINTER_FORMAT, POINTER_NAME, read_pointer

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_BASE = "megatron_lora_base.json"  # beside a PEFT export: the base it was trained on (for import)
_CHECKPOINT_VERSION = 3.0


def base_of(directory: str, true_vocab_size: Optional[int] = None) -> Tuple[Metadata, Iterator, Dict[str, Any]]:
    """(metadata, whole tensors, pointer "base" entry) of a base model: a transformers directory (config.json)
    or one of our checkpoints."""
    directory = os.path.abspath(directory)
    if os.path.isfile(os.path.join(directory, "config.json")):
        from tools.checkpoint import loader_hf

        meta, tensors = loader_hf.load_checkpoint(argparse.Namespace(load_dir=directory))
        return meta, tensors, {"load_hf": directory}
    from tools.checkpoint import loader_megatron

    meta, tensors = loader_megatron.load_checkpoint(argparse.Namespace(
        load_dir=directory, true_vocab_size=true_vocab_size, vocab_file=None, tokenizer_model=None))
    return meta, tensors, {"load": directory, "iteration": 0 if meta.release else meta.iteration}


def base_from_pointer(base: Dict[str, Any], where: str,
                      true_vocab_size: Optional[int] = None) -> Tuple[Metadata, Iterator]:
    """The base a pointer names; a Megatron base must still be at the pointer's iteration."""
    directory = base.get("load_hf") or base.get("load")
    if not directory or not os.path.isdir(directory):
        raise CheckpointError(f"{where}: the base {directory} is not a directory")
    meta, tensors, found = base_of(directory, true_vocab_size)
    if "load" in base and found.get("iteration") != base.get("iteration"):
        raise CheckpointError(f"{where}: the base {directory} is at iteration {found.get('iteration')}, the adapters "
                              f"were trained on iteration {base.get('iteration')}")
    return meta, tensors


def read_adapters(lora_dir: str) -> Adapters:
    """Our adapter-only checkpoint (any TP / PP, torch or torch_dist) as whole tensors, with its pointer."""
    pointer = read_pointer(lora_dir)
    if pointer is None:
        raise CheckpointError(f"--load-dir {lora_dir} has no {POINTER_NAME}: not a LoRA run's checkpoint "
                              "(pretrain_gpt.py --lora-rank writes one)")
    source = open_source(lora_dir)
    adapters = Adapters(dict(pointer["lora"]), {name: t for name, t in read_tensors(source)}, dict(pointer["base"]))
    check_complete(adapters)
    return adapters


def write_adapters(save_dir: str, meta: Metadata, adapters: Adapters, tp: int) -> None:
    """An adapter-only checkpoint of ours, release/mp_rank_XX/model_optim_rng.pt at TP = tp (PP = 1), plus
    lora_base.json. A release checkpoint: pretrain_gpt.py --load starts LoRA training from these adapters at
    iteration 0 with a fresh optimizer."""
    from megatron.convert.layout_rules import tensor_layout
    from megatron.core.tensor_parallel.layout import shard_for_rank
    from megatron.training.checkpoint_manifest import write_manifest
    from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename

    args = target_args(meta, tp, 1)
    args.lora_rank, args.lora_alpha = int(adapters.settings["rank"]), float(adapters.settings["alpha"])
    args.lora_dropout = float(adapters.settings.get("dropout", 0.0))
    args.lora_target_modules = list(adapters.settings["target_modules"])
    files = {}
    for rank in range(tp):
        model = {name: shard_for_rank(whole, tensor_layout(name, args, tp, rank), tp, rank).clone()
                 for name, whole in adapters.tensors.items()}
        name = get_checkpoint_name(save_dir, 0, release=True, pipeline_parallel=False, tensor_rank=rank,
                                   pipeline_rank=0, expert_parallel=False)
        os.makedirs(os.path.dirname(name), exist_ok=True)
        state = {"args": args, "checkpoint_version": _CHECKPOINT_VERSION, "iteration": 0, "model": model}
        checksum = atomic_write(name, lambda f, state=state: torch.save(state, f), checksum=True)
        base_dir = get_checkpoint_name(save_dir, 0, release=True, return_base_dir=True)
        files[os.path.relpath(name, base_dir)] = checksum
    write_manifest(base_dir, 0, files)
    pointer = {"format": POINTER_FORMAT, "base": adapters.base, "lora": adapters.settings}
    write_json(os.path.join(save_dir, POINTER_NAME), pointer)
    atomic_write(get_checkpoint_tracker_filename(save_dir), lambda f: f.write(b"release"))


def write_json(path: str, document: Any) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(document, indent=2) + "\n").encode("utf-8")))


def read_peft(peft_dir: str) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
    """(adapter_config.json, adapter_model.safetensors tensors, megatron_lora_base.json or None)."""
    from safetensors.torch import load_file

    config_path, weights_path = os.path.join(peft_dir, PEFT_CONFIG), os.path.join(peft_dir, PEFT_WEIGHTS)
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise CheckpointError(f"--load-dir {peft_dir}: no {os.path.basename(path)} (not a PEFT adapter)")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as error:
        raise CheckpointError(f"{config_path}: not JSON ({error})") from None
    base = None
    if os.path.isfile(os.path.join(peft_dir, PEFT_BASE)):
        with open(os.path.join(peft_dir, PEFT_BASE), encoding="utf-8") as f:
            base = json.load(f).get("base")
    return config, load_file(weights_path), base
