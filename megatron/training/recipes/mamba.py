"""Pretrain a Mamba-2 or hybrid Mamba / attention / MLP model (Megatron-LM's pretrain_mamba.py).

    python pretrain_mamba.py --num-layers 4 --hybrid-override-pattern M*M- --hidden-size 64 ...
    torchrun --nproc-per-node 2 pretrain_mamba.py ...

The GPT recipe's data, batch, loss and forward step (megatron/training/recipes/gpt.py) with a
MambaModel (megatron/model/mamba/) as the model; --is-hybrid-model is implied, and the checkpoints
record it, so the tools that load them (conversion, generation, the server) build the same model.
"""

from __future__ import annotations

from typing import List, Optional

from megatron.core.enums import ModelType
from megatron.training.global_vars import get_args
from megatron.training.gpt_builders import _real_vocab_size, _virtual_stage
from megatron.training.recipes.gpt import (  # noqa: F401 (the recipe's other functions, re-exported)
    forward_step,
    get_batch,
    is_dataset_built_on_rank,
    loss_func,
    train_valid_test_datasets_provider,
)
from megatron.training.training import pretrain
from megatron.training.utils import print_rank_0


def mamba_builder(args, pre_process: bool, post_process: bool, vp_stage: Optional[int] = None, config=None):
    """A megatron.model.mamba.MambaModel of validated args (Megatron's mamba_builder)."""
    from megatron.model.mamba import MambaModel
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.config_builders import mamba_model_kwargs

    print_rank_0("building Mamba model ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    padded = args.padded_vocab_size
    kwargs = mamba_model_kwargs(args)
    print_rank_0(f" > hybrid layer pattern {kwargs['hybrid_override_pattern']} "
                 "(M Mamba, * attention, - MLP, E MoE)")
    with _virtual_stage(vp_stage):
        model = MambaModel(config, vocab_size=padded, num_tokens=_real_vocab_size(args) or padded,
                           max_sequence_length=args.max_position_embeddings,
                           share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                           pre_process=pre_process, post_process=post_process, **kwargs)
    return model


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None):
    """A MambaModel shaped by the flags."""
    return mamba_builder(get_args(), pre_process, post_process, vp_stage=vp_stage)


def hybrid_model_flags(parser):
    """extra_args_provider: --is-hybrid-model on by default (the model this script trains is one)."""
    parser.set_defaults(is_hybrid_model=True)
    return parser


def pretrain_arguments() -> dict:
    """pretrain()'s arguments for this recipe (main and megatron.training.api.pretrain use them)."""
    return dict(train_valid_test_dataset_provider=train_valid_test_datasets_provider, model_provider=model_provider,
                model_type=ModelType.encoder_or_decoder, forward_step_func=forward_step,
                extra_args_provider=hybrid_model_flags, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})


def main(argv: Optional[List[str]] = None, record_history: bool = False):
    """Train with the flags in argv (None: sys.argv); returns megatron.training.training.TrainingResult."""
    return pretrain(**pretrain_arguments(), argv=argv, record_history=record_history)


__all__ = ["ModelType", "forward_step", "get_batch", "hybrid_model_flags", "is_dataset_built_on_rank", "loss_func",
           "main", "mamba_builder", "model_provider", "pretrain_arguments", "train_valid_test_datasets_provider"]
