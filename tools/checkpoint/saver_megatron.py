"""`--saver megatron`: write this framework's checkpoint (`--ckpt-format torch`) at the target TP / PP.

No optimizer or RNG state is written (as Megatron-LM's converter): train from it with
`--finetune`, or `--no-load-optim --no-load-rng`.
"""

from __future__ import annotations

import argparse
from typing import Iterator, Tuple

import torch

from megatron.convert.megatron_format import Metadata, check_target, open_source, read_tensors, write_tensors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="Megatron saver")
    group.add_argument("--target-tensor-parallel-size", type=int, default=None,
                       help="Tensor-parallel size of the new checkpoint (default: the source's).")
    group.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                       help="Pipeline-parallel size of the new checkpoint (default: the source's).")


def save_checkpoint(meta: Metadata, tensors: Iterator[Tuple[str, torch.Tensor]], args: argparse.Namespace,
                    save_dir: str) -> None:
    """Write the stream under save_dir (a new, empty folder)."""
    tp = args.target_tensor_parallel_size or int(getattr(meta.args, "tensor_model_parallel_size", 1))
    pp = args.target_pipeline_parallel_size or int(getattr(meta.args, "pipeline_model_parallel_size", 1))
    check_target(meta.args, tp, pp)
    print(f"saving at tensor-parallel size {tp}, pipeline-parallel size {pp} to {save_dir}", flush=True)
    write_tensors(save_dir, meta, tensors, tp, pp)


def read_back(save_dir: str) -> Tuple[argparse.Namespace, Iterator[Tuple[str, torch.Tensor]]]:
    """What was saved, as whole tensors (for the verification)."""
    source = open_source(save_dir)
    return source.args, read_tensors(source)
