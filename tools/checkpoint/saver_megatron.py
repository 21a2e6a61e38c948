"""`--saver megatron`: write this framework's checkpoint (`--ckpt-format torch`) at the target TP / PP.

No optimizer or RNG state is written (as Megatron-LM's converter): train from it with
`--finetune`, or `--no-load-optim --no-load-rng`.
"""

from __future__ import annotations

import argparse
from typing import Iterator, Optional, Tuple

import torch

from megatron.training.checkpoint_safety import CheckpointError
from megatron.convert.megatron_format import (
    OURS, Dialect, Metadata, check_target, open_source, read_tensors, write_tensors,
)
from megatron.convert.t5_stages import is_t5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="Megatron saver")
    group.add_argument("--target-tensor-parallel-size", type=int, default=None,
                       help="Tensor-parallel size of the new checkpoint (default: the source's).")
    group.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                       help="Pipeline-parallel size of the new checkpoint (default: the source's).")
    group.add_argument("--target-expert-parallel-size", type=int, default=None,
                       help="MoE models: expert-parallel size of the new checkpoint, files mp_rank_TT[_PPP]_EEE "
                            "(default: the source's).")
    group.add_argument("--target-expert-tensor-parallel-size", type=int, default=None,
                       help="MoE models: expert-tensor-parallel size of the new checkpoint; must divide the "
                            "target TP size (default: the source's when it differed from the source's TP size, "
                            "else the target TP size, Megatron's default).")
    group.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Layers per virtual pipeline stage (model chunk) of the new checkpoint, for the "
                            "interleaved schedule: train it with the same --num-layers-per-virtual-pipeline-stage "
                            "(default: no virtual stages).")
    group.add_argument("--target-pipeline-model-parallel-split-rank", type=int, default=None,
                       help="T5 at a pipeline-parallel size > 1: the first decoder stage (stages before it hold "
                            "the encoder), written into the checkpoint's args as --pipeline-model-parallel-split-rank "
                            "(default: the source's at the source's pipeline size, else half the stages, PP // 2).")


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
    split = _split_rank(meta.args, pp, getattr(args, "target_pipeline_model_parallel_split_rank", None))
    ep, etp = _expert_sizes(meta.args, tp, args)
    check_target(meta.args, tp, pp, vp, split, ep, etp)
    virtual = f" ({vp} virtual stages of {per_chunk} layers)" if vp > 1 else ""
    virtual += f", split rank {split}" if split is not None else ""
    virtual += f", expert-parallel size {ep}, expert-tensor-parallel size {etp}" if getattr(
        meta.args, "num_experts", None) else ""
    print(f"saving at tensor-parallel size {tp}, pipeline-parallel size {pp}{virtual} to {save_dir}", flush=True)
    write_tensors(save_dir, meta, tensors, tp, pp, vp, dialect, split, ep, etp)


def _expert_sizes(source: argparse.Namespace, tp: int, args: argparse.Namespace) -> Tuple[int, int]:
    """(EP, ETP) of the target: the flags, else the source's EP, and the source's ETP where it was
    not its TP size (else the target TP size)."""
    ep = getattr(args, "target_expert_parallel_size", None) or int(
        getattr(source, "expert_model_parallel_size", 1) or 1)
    etp = getattr(args, "target_expert_tensor_parallel_size", None)
    if etp is None:
        source_tp = int(getattr(source, "tensor_model_parallel_size", 1) or 1)
        kept = getattr(source, "expert_tensor_parallel_size", None)
        etp = int(kept) if kept is not None and int(kept) != source_tp else tp
    return int(ep), int(etp)


def _split_rank(source: argparse.Namespace, pp: int, given: Optional[int]) -> Optional[int]:
    """T5's first decoder stage at the target: the flag, else the source's at the same pipeline size,
    else pp // 2; None at pp = 1 and for models of one stack (check_target refuses the flag there)."""
    if given is not None or not is_t5(source) or pp == 1:
        return given
    same_size = int(getattr(source, "pipeline_model_parallel_size", 1) or 1) == pp
    kept = getattr(source, "pipeline_model_parallel_split_rank", None)
    return kept if same_size and kept is not None else pp // 2


def read_back(save_dir: str,
              dialect: Dialect = OURS) -> Tuple[argparse.Namespace, Iterator[Tuple[str, torch.Tensor]]]:
    """What was saved, as whole tensors (for the verification)."""
    source = open_source(save_dir, dialect)
    return source.args, read_tensors(source)
