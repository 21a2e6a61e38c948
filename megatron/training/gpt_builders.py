"""gpt_builder: the GPT model of the flags, as pretrain_gpt.py's model provider builds it.

Megatron-LM keeps its gpt_builder in gpt_builders.py beside pretrain_gpt.py; Accelerate's Megatron-LM
integration imports it as megatron.training.gpt_builders, and so does pretrain_gpt.py here.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Iterator, Optional

from megatron.core import parallel_state
from megatron.training.utils import print_rank_0


def gpt_builder(args: argparse.Namespace, pre_process: bool, post_process: bool, vp_stage: Optional[int] = None,
                config: Any = None) -> Any:
    """A megatron.model.GPTModel of validated args (Megatron's signature).

    config: the TransformerConfig to build with (None: core_transformer_config_from_args(args)).
    vp_stage: the virtual pipeline stage (model chunk) to build; None builds the one parallel_state
    names (get_model sets it for each chunk). The padded vocabulary (args.padded_vocab_size) is the
    embedding's; the ids above the tokenizer's (Accelerate: args.orig_vocab_size, as it builds no
    tokenizer) are padding, left out of the loss unless --include-padded-vocab-in-loss.
    """
    from megatron.model import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args, gpt_model_kwargs

    if args.is_hybrid_model:
        from megatron.training.argument_utils import ArgsError

        raise ArgsError("--is-hybrid-model: a hybrid (Mamba) model trains with pretrain_mamba.py")
    print_rank_0("building GPT model ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    padded = args.padded_vocab_size
    num_tokens = _real_vocab_size(args) or padded
    print_rank_0(f" > loss over all {padded} ids, the {padded - num_tokens} padding ids included (Megatron's loss, "
                 "--include-padded-vocab-in-loss)" if args.include_padded_vocab_in_loss else
                 f" > loss over the tokenizer's {num_tokens} ids, the {padded - num_tokens} padding ids excluded "
                 f"(--include-padded-vocab-in-loss for Megatron's loss over all {padded})")
    with _virtual_stage(vp_stage):
        model = GPTModel(config, vocab_size=padded, num_tokens=num_tokens,
                         max_sequence_length=args.max_position_embeddings,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         pre_process=pre_process, post_process=post_process, **gpt_model_kwargs(args))
    model.return_logits = bool(args.return_logits)  # set by Accelerate's MegatronLMPlugin
    return model


def _real_vocab_size(args: argparse.Namespace) -> Optional[int]:
    """The tokenizer's vocabulary size; without a tokenizer (Accelerate builds none) args.orig_vocab_size."""
    from megatron.training.global_vars import get_tokenizer

    try:
        return get_tokenizer().vocab_size
    except RuntimeError:  # no tokenizer was built
        return args.orig_vocab_size


@contextlib.contextmanager
def _virtual_stage(vp_stage: Optional[int]) -> Iterator[None]:
    """parallel_state's virtual pipeline rank set to vp_stage while the model is built (the layers
    of a chunk come from it), then set back; nothing to do for None."""
    if vp_stage is None:
        yield
        return
    previous = parallel_state.get_virtual_pipeline_model_parallel_rank()
    parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage)
    try:
        yield
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_rank(previous)
