"""Checkpoints of a LoRA run (--lora-rank): the adapters alone, plus a pointer to the base.

    <save>/
      lora_base.json                  the base the adapters were trained on, written before each save:
                                      {"format": "megatron-lora/1",
                                       "base": {"load": ABS_DIR, "iteration": N}   (a Megatron checkpoint)
                                             | {"load_hf": ABS_DIR},              (a transformers directory)
                                       "lora": {"rank", "alpha", "dropout", "target_modules"}}
      latest_checkpointed_iteration.txt, iter_XXXXXXX/...   the usual layout (--ckpt-format torch or
                                      torch_dist), whose model entries are the adapters' tensors only
                                      (`<layer>.adapter.linear_in.weight` / `.linear_out.weight`); the
                                      optimizer, scheduler, RNG and data-iterator state as in any checkpoint

How a LoRA run starts (setup_model_and_optimizer -> load):
  --load DIR holds a LoRA checkpoint (DIR/lora_base.json)  resume: the base from the pointer (model only;
                                      its tracker must still name the pointer's iteration), then the
                                      adapters, optimizer, scheduler, RNG and iteration from DIR
  --load DIR holds a plain checkpoint start LoRA fine-tuning from it: the base weights only, iteration 0
                                      (Megatron's --finetune), fresh adapters; DIR becomes the pointer
  --pretrained-checkpoint DIR          the same while --load holds no checkpoint yet (Megatron's semantics)
  --load-hf DIR                        the same from a transformers directory
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from megatron.model.lora import state_dict_view
from megatron.training.checkpoint_safety import CheckpointError
from megatron.training.lora_pointer import POINTER_NAME, lora_settings, read_pointer

def _base_iteration(directory: str, flag: str) -> int:
    from megatron.training.checkpointing import get_checkpoint_tracker_filename, read_metadata

    tracker = get_checkpoint_tracker_filename(directory)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"{flag} {directory}: no checkpoint there (no {os.path.basename(tracker)})")
    iteration, release = read_metadata(tracker)
    return 0 if release else iteration


def _load_base(model: List[nn.Module], args: argparse.Namespace, directory: str, flag: str,
               expected_iteration: Optional[int] = None) -> None:
    """The base weights (everything but the adapters) of the checkpoint in `directory`, model only."""
    from megatron.training.checkpointing import load_checkpoint

    iteration = _base_iteration(directory, flag)
    if expected_iteration is not None and iteration != expected_iteration:
        raise CheckpointError(f"{flag} {directory}: its tracker names iteration {iteration}, but the adapters were "
                              f"trained on iteration {expected_iteration} ({POINTER_NAME}); restore that base "
                              "checkpoint")
    saved = {name: getattr(args, name) for name in ("lora_base_dir", "finetune", "pretrained_checkpoint")}
    args.lora_base_dir, args.finetune, args.pretrained_checkpoint = directory, True, None
    try:
        with state_dict_view(model, "base"):
            load_checkpoint(model, None, None, load_arg="lora_base_dir", args=args)
    finally:
        for name, value in saved.items():
            setattr(args, name, value)
    args.lora_base = {"load": os.path.abspath(directory), "iteration": iteration}


def _load_base_from_pointer(model: List[nn.Module], args: argparse.Namespace, pointer: Dict[str, Any],
                            where: str) -> None:
    base = pointer["base"]
    settings = lora_settings(args)
    if pointer.get("lora", settings) != settings:
        raise CheckpointError(f"{where}: the adapters there were trained with LoRA {pointer['lora']}, this run has "
                              f"{settings} (--lora-rank/--lora-alpha/--lora-dropout/--lora-target-modules)")
    if "load_hf" in base:
        _load_hf_base(model, args, base["load_hf"])
    else:
        _load_base(model, args, base["load"], f"the LoRA base of {where}", expected_iteration=base["iteration"])


def _load_hf_base(model: List[nn.Module], args: argparse.Namespace, directory: str) -> None:
    from megatron.training.global_vars import get_tokenizer
    from megatron.training.load_hf import load_hf_weights

    saved = args.load_hf
    args.load_hf = directory
    try:
        with state_dict_view(model, "base"):
            load_hf_weights(model, args, get_tokenizer().vocab_size)
    finally:
        args.load_hf = saved
    args.lora_base = {"load_hf": os.path.abspath(directory)}


def load_lora_run(model: List[nn.Module], optimizer: Any, opt_param_scheduler: Any,
                  args: argparse.Namespace) -> Tuple[int, float]:
    """Load a LoRA run's starting point (see the module docstring); (iteration, flops so far)."""
    from megatron.training.checkpointing import checkpoint_exists, load_checkpoint

    args.lora_base = None
    if checkpoint_exists(args.load):
        pointer = read_pointer(args.load)
        if pointer is None:  # a base checkpoint: LoRA fine-tuning starts from it
            _load_base(model, args, args.load, "--load")
            return 0, 0.0
        _load_base_from_pointer(model, args, pointer, f"--load {args.load}")
        base = args.lora_base
        with state_dict_view(model, "adapters"):
            result = load_checkpoint(model, optimizer, opt_param_scheduler, args=args)
        args.lora_base = base
        return result
    if args.pretrained_checkpoint is not None:
        _load_base(model, args, args.pretrained_checkpoint, "--pretrained-checkpoint")
        return 0, 0.0
    if args.load_hf is not None:
        _load_hf_base(model, args, args.load_hf)
        return 0, 0.0
    if args.save:
        raise CheckpointError("--lora-rank with --save needs a base model to point to (--load, "
                              "--pretrained-checkpoint or --load-hf holding one): its checkpoints hold the "
                              "adapters alone")
    return 0, 0.0
