"""`--saver mcore` (or `core`): a checkpoint Megatron-LM (megatron-core GPT) loads with `--ckpt-format torch`.

Files as Megatron-LM's save_checkpoint writes them (iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt,
the tracker): `args` is a plain argparse Namespace with Megatron-LM's field names (ours are
theirs) and transformer_impl set, checkpoint_version 3.0, `model` in megatron-core's names:
`--saver-transformer-impl transformer_engine` (the default, as Megatron-LM's saver_core and its
default GPT spec) fuses the layer norms into linear_qkv / linear_fc1 as layer_norm_weight/bias and
writes Transformer Engine's empty `_extra_state` (an empty uint8 tensor: no FP8) for each TE module;
`local` writes the local spec's names with megatron-core's None `_extra_state` of its linears.
MoE models (megatron/convert/legacy.py has the names): files per EP rank
(mp_rank_TT[_PPP]_EEE, experts numbered locally), each MoE layer's own pre_mlp_layernorm (TE's MoE
layers do not fuse it), the router, the shared experts; the experts as SequentialMLP's
local_experts.{i}.* (local spec, and TE spec without --moe-grouped-gemm; the local spec's args
then say moe_grouped_gemm False, since with it Megatron-LM's local spec builds the legacy
GroupedMLP) or, TE spec with --moe-grouped-gemm, TEGroupedMLP's experts.linear_fc1 / fc2.weight{i}.
A checksums.json manifest is added (Megatron-LM ignores it). No optimizer or RNG state: load it
with `--finetune` or `--no-load-optim --no-load-rng`.
"""

from __future__ import annotations

import argparse
from typing import Iterator, Tuple

import torch

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
    grouped = bool(getattr(meta.args, "num_experts", None) and getattr(meta.args, "moe_grouped_gemm", False))
    print(f"writing megatron-core names ({impl} spec" + (", TEGroupedMLP experts" if grouped and impl != "local"
                                                          else "") + ")", flush=True)
    saver_megatron.save_checkpoint(meta, tensors, args, save_dir, CoreDialect(impl, grouped_gemm=grouped))


def read_back(save_dir: str) -> Tuple[argparse.Namespace, Iterator[Tuple[str, torch.Tensor]]]:
    """What was saved, as whole tensors under our names (for the verification)."""
    return saver_megatron.read_back(save_dir, CoreDialect())
