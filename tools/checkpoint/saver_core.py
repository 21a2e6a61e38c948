"""`--saver mcore` (or `core`): a checkpoint Megatron-LM (megatron-core GPT) loads with `--ckpt-format torch`.

Files as Megatron-LM's save_checkpoint writes them (iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt,
the tracker): `args` is a plain argparse Namespace with Megatron-LM's field names (ours are
theirs) and transformer_impl set, checkpoint_version 3.0, `model` in megatron-core's names:
`--saver-transformer-impl transformer_engine` (the default, as Megatron-LM's saver_core and its
default GPT spec) fuses the layer norms into linear_qkv / linear_fc1 as layer_norm_weight/bias and
writes Transformer Engine's empty `_extra_state` (an empty uint8 tensor: no FP8) for each TE module;
`local` writes the local spec's names with megatron-core's None `_extra_state` of its linears.
A checksums.json manifest is added (Megatron-LM ignores it). No optimizer or RNG state: load it
with `--finetune` or `--no-load-optim --no-load-rng`.
"""

from __future__ import annotations

import argparse
from typing import Iterator, Tuple

import torch

from megatron.checkpoint_safety import CheckpointError
from megatron.convert.legacy import CoreDialect
from megatron.convert.megatron_format import Metadata
from tools.checkpoint import saver_megatron


def add_arguments(parser: argparse.ArgumentParser) -> None:
    saver_megatron.add_arguments(parser)  # the --target-* sizes
    group = parser.add_argument_group(title="megatron-core saver")
    group.add_argument("--saver-transformer-impl", type=str, default="transformer_engine",
                       choices=["transformer_engine", "local"],
                       help="The layer spec whose names are written: transformer_engine (Megatron-LM's "
                            "default GPT spec: norms fused into the linears) or local.")


def save_checkpoint(meta: Metadata, tensors: Iterator[Tuple[str, torch.Tensor]], args: argparse.Namespace,
                    save_dir: str) -> None:
    """Write the stream under save_dir (a new, empty folder) in megatron-core naming."""
    impl = getattr(args, "saver_transformer_impl", "transformer_engine")
    if getattr(meta.args, "num_experts", None):  # TE's MoE keeps pre_mlp_layernorm and has no mlp.linear_fc1
        raise CheckpointError("--saver mcore: MoE models are not written in megatron-core's names yet (its MoE "
                              "layers' norms, extra states and grouped-GEMM tensors differ); use --saver megatron "
                              "or --saver hf")
    print(f"writing megatron-core names ({impl} spec)", flush=True)
    saver_megatron.save_checkpoint(meta, tensors, args, save_dir, CoreDialect(impl))


def read_back(save_dir: str) -> Tuple[argparse.Namespace, Iterator[Tuple[str, torch.Tensor]]]:
    """What was saved, as whole tensors under our names (for the verification)."""
    return saver_megatron.read_back(save_dir, CoreDialect())
