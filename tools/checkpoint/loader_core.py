"""`--loader mcore` (or `core`): Megatron-LM checkpoints in megatron-core naming, `--ckpt-format torch`.

Both specs' names: the local spec's are ours; Transformer Engine's fused norms
(`linear_qkv.layer_norm_weight/bias`, `mlp.linear_fc1.layer_norm_weight/bias`) become
`input_layernorm` / `pre_mlp_layernorm`. `_extra_state` entries that carry nothing (None, an empty
tensor, TE's serialized None) are dropped; one with FP8 data is refused. Any TP / PP / virtual
stages; the QKV rows are already ours (grouped by query group, checkpoint_version 3.0).
"""

from __future__ import annotations

import argparse
from typing import Iterator, Tuple

import torch

from megatron.convert.legacy import CoreDialect
from megatron.convert.megatron_format import Metadata
from tools.checkpoint import loader_megatron


def add_arguments(parser: argparse.ArgumentParser) -> None:
    loader_megatron.add_arguments(parser)  # --true-vocab-size, --vocab-file, --tokenizer-model
    group = parser.add_argument_group(title="megatron-core loader")
    group.add_argument("--loader-transformer-impl", type=str, default=None,
                       choices=["transformer_engine", "local"],
                       help="Accepted for Megatron-LM's command lines; both namings are recognised by name.")


def load_checkpoint(args: argparse.Namespace) -> Tuple[Metadata, Iterator[Tuple[str, torch.Tensor]]]:
    """(metadata in our terms, the whole tensors one at a time under our names)."""
    dist = _torch_dist_folder(args.load_dir)
    if dist is not None:  # Megatron-LM's --ckpt-format torch_dist (megatron/convert/mcore_dist.py)
        from megatron.convert.mcore_dist import MegatronLMDist
        from megatron.convert.megatron_format import true_vocab_size_of

        source = MegatronLMDist(dist, getattr(args, "model_type", None) or "GPT")
        meta = Metadata(source.args, source.iteration, False,
                        true_vocab_size_of(source.args, getattr(args, "true_vocab_size", None),
                                           getattr(args, "vocab_file", None), getattr(args, "tokenizer_model", None)))
        return meta, source.tensors()
    return loader_megatron.load_checkpoint(args, CoreDialect(family=getattr(args, "model_type", None) or "GPT"))


def _torch_dist_folder(load_dir: str):
    """The iteration folder the tracker names when it is a torch_dist one (metadata.json), else None."""
    import os

    from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename, read_metadata

    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        return None
    iteration, release = read_metadata(tracker)
    base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    return base_dir if os.path.isfile(os.path.join(base_dir, "metadata.json")) else None
