"""`--saver megatron`: write this framework's checkpoint (`--ckpt-format torch`) at the target TP / PP.

No optimizer or RNG state is written (as Megatron-LM's converter): train from it with
`--finetune`, or `--no-load-optim --no-load-rng`.
"""

from __future__ import annotations

import argparse
from typing import Iterator, Tuple

import torch

from megatron.checkpoint_safety import CheckpointError
from megatron.convert.megatron_format import (
    OURS, Dialect, Metadata, check_target, open_source, read_tensors, write_tensors,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="Megatron saver")
    group.add_argument("--target-tensor-parallel-size", type=int, default=None,
                       help="Tensor-parallel size of the new checkpoint (default: the source's).")
    group.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                       help="Pipeline-parallel size of the new checkpoint (default: the source's).")
    group.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Layers per virtual pipeline stage (model chunk) of the new checkpoint, for the "
                            "interleaved schedule: train it with the same --num-layers-per-virtual-pipeline-stage "
                            "(default: no virtual stages).")


def save_checkpoint(meta: Metadata, tensors: Iterator[Tuple[str, torch.Tensor]], args: argparse.Namespace,
                    save_dir: str, dialect: Dialect = OURS) -> None:
    """Write the stream under save_dir (a new, empty folder); `dialect`: the files' naming (saver_core)."""
    tp = args.target_tensor_parallel_size or int(getattr(meta.args, "tensor_model_parallel_size", 1))
    pp = args.target_pipeline_parallel_size or int(getattr(meta.args, "pipeline_model_parallel_size", 1))
    vp = 1
    per_chunk = args.target_num_layers_per_virtual_pipeline_stage
    if per_chunk is not None:
        layers = int(meta.args.num_layers)
        if per_chunk < 1 or layers % (pp * per_chunk):
            raise CheckpointError(f"--target-num-layers-per-virtual-pipeline-stage {per_chunk}: {layers} layers "
                                  f"do not split into {pp} pipeline stages of chunks of {per_chunk} layers")
        vp = layers // (pp * per_chunk)
    check_target(meta.args, tp, pp, vp)
    virtual = f" ({vp} virtual stages of {per_chunk} layers)" if vp > 1 else ""
    print(f"saving at tensor-parallel size {tp}, pipeline-parallel size {pp}{virtual} to {save_dir}", flush=True)
    write_tensors(save_dir, meta, tensors, tp, pp, vp, dialect)


def read_back(save_dir: str,
              dialect: Dialect = OURS) -> Tuple[argparse.Namespace, Iterator[Tuple[str, torch.Tensor]]]:
    """What was saved, as whole tensors (for the verification)."""
    source = open_source(save_dir, dialect)
    return source.args, read_tensors(source)
