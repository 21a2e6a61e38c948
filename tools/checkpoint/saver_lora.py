"""`--saver lora` (with --loader lora or peft): our adapter-only checkpoint, release/mp_rank_XX/model_optim_rng.pt
at --target-tensor-parallel-size (PP = 1) plus lora_base.json pointing to the base. `pretrain_gpt.py --load DIR
--lora-rank R ...` starts LoRA training from these adapters (iteration 0, fresh optimizer: a release
checkpoint). The verification reads it back and merges it into the base again.
"""

from __future__ import annotations

import argparse
from typing import Iterator, Tuple

import torch

from megatron.convert.lora import check_rank, merged
from megatron.convert.megatron_format import Metadata
from megatron.training.checkpoint_safety import CheckpointError
from tools.checkpoint.lora_common import base_from_pointer, read_adapters, write_adapters


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="LoRA saver")
    group.add_argument("--target-tensor-parallel-size", type=int, default=1,
                       help="Tensor-parallel size of the adapter checkpoint (default 1).")


def save_checkpoint(meta: Metadata, tensors: Iterator[Tuple[str, torch.Tensor]], args: argparse.Namespace,
                    save_dir: str) -> None:
    if meta.lora is None:
        raise CheckpointError("--saver lora writes adapters: use it with --loader lora or --loader peft")
    check_rank(meta.lora, "--saver lora")
    write_adapters(save_dir, meta, meta.lora, args.target_tensor_parallel_size)
    print(f"wrote {len(meta.lora.tensors)} adapter tensors at TP {args.target_tensor_parallel_size}", flush=True)


def read_back(save_dir: str):
    adapters = read_adapters(save_dir)
    meta, stream = base_from_pointer(adapters.base, f"the adapters {save_dir}")
    return meta.args, merged(stream, adapters)
