"""A checkpoint's model for inference, built as pretraining builds it (no optimizer, no data).

The text generation server, tools/generate_text.py and the lm-evaluation-harness scorer all load
a model the same way: initialize_megatron with their own flags, then `build_model(args)` gives
this rank's chunk of the GPT model (with --is-hybrid-model, pretrain_mamba.py's MambaModel), with the
weights of --load (either checkpoint format) or --load-hf, in eval mode.
"""

import argparse

import torch

# flags that name a data source: a tool that reads no data adds --mock-data when none is given, so
# the training checks of validate_args pass without reading anything
DATA_FLAGS = ("--mock-data", "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")


class ServerFlagError(ValueError):
    """A bad flag of a serving or scoring tool: one line, exit status 1."""


def initialize_for_inference(argv: list, extra_args_provider=None) -> argparse.Namespace:
    """initialize_megatron for a tool that loads a model and reads no data (the server, the
    harness, generate_text.py, megatron.training.api.load): --mock-data when no data flag is given
    (the training checks want a source; nothing is read) and one-sample, no-optimizer defaults."""
    from megatron.training.initialize import initialize_megatron

    argv = list(argv)
    if not any(arg.split("=")[0] in DATA_FLAGS for arg in argv):
        argv.append("--mock-data")
    return initialize_megatron(extra_args_provider, argv=argv, args_defaults={
        "tokenizer_type": "GPT2BPETokenizer", "micro_batch_size": 1, "train_iters": 1, "lr": 0.0})


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The model of this rank, loaded, in eval mode (one chunk: no virtual pipeline stages)."""
    from megatron.training.checkpointing import CheckpointError, checkpoint_exists, load_checkpoint
    from megatron.training.global_vars import get_tokenizer
    from megatron.training.load_hf import load_hf_instead, load_hf_weights
    from megatron.training.recipes import gpt, mamba
    from megatron.training.training import get_model

    if args.virtual_pipeline_model_parallel_size is not None:
        raise ServerFlagError("the server runs without virtual pipeline stages: drop "
                              "--num-layers-per-virtual-pipeline-stage")
    model = get_model(mamba.model_provider if args.is_hybrid_model else gpt.model_provider)
    from megatron.training.lora_pointer import lora_run

    if lora_run(model):  # --lora-rank: a LoRA checkpoint's base (from its pointer) and adapters, or a base
        from megatron.training.checkpoint_lora import load_lora_run

        if not checkpoint_exists(args.load) and args.load_hf is None:
            raise CheckpointError(f"--load {args.load}: no checkpoint there (no latest_checkpointed_iteration.txt)")
        args.no_load_optim, args.no_load_rng, args.auto_detect_ckpt_format = True, True, True
        load_lora_run(model, None, None, args)
    elif load_hf_instead(args):
        load_hf_weights(model, args, get_tokenizer().vocab_size)
    else:
        if not checkpoint_exists(args.load):
            raise CheckpointError(f"--load {args.load}: no checkpoint there (no latest_checkpointed_iteration.txt)")
        args.no_load_optim, args.no_load_rng = True, True  # weights only: there is no optimizer
        args.auto_detect_ckpt_format = True  # serve a checkpoint of either format
        load_checkpoint(model, None, None, args=args)
    for chunk in model:
        chunk.eval()
    return model[0]
