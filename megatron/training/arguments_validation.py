"""validate_args: Megatron's checks and derived values, one small pure function per concern.

Order (each step may rely on the values the earlier ones derived):

| step | function | derives |
|---|---|---|
| 1 | _apply_defaults | values from args_defaults that the user left at None |
| 2 | _apply_flag_aliases | exits/raises for dead flags; recompute/rope aliases |
| 2b | validate_megatron_flags | num_layers, seq_length (--encoder-*), use_flash_attn (--attention-backend) |
| 3 | _validate_parallel | rank, world_size, data_parallel_size, distributed_backend (after DistributedConfig's rules) |
| 4 | _validate_not_yet_supported | (nothing: features of later issues raise) |
| 5 | _require_model_shape | (--num-layers, --hidden-size, --num-attention-heads, --max-position-embeddings given) |
| 5a | _refuse_broken_group_rules | (every group's rules() but TrainingConfig's) |
| 5b | _validate_model | ffn_hidden_size (4h; --swiglu: int(4h x 2/3 / 64) x 64), kv_channels (h / heads) |
| 5c | _validate_tensor_parallel | sequence_parallel off when TP = 1 (with a warning) |
| 5d | validate_model_architecture | apply_rope_fusion off without rope (rope, GQA, activation rules) |
| 6 | _validate_precision | params_dtype, attention_softmax_in_fp32, bf16 fp32 grad accumulation |
| 7 | _validate_batch | global_batch_size (mbs x dp), rampup_batch_size as ints (TrainingConfig's rules, those between groups) |
| 7b | _validate_pipeline_parallel | virtual_pipeline_model_parallel_size |
| 7c | _validate_context_parallel | (seq length divisible by 2 x CP; causal mask only; no ALiBi) |
| 7d | _validate_pipeline_schedule | (PP > 1: the schedule simulator finds no deadlock) |
| 7c | _validate_recompute | (granularity, method, layers per stage, distributed saved inputs) |
| 8 | _validate_train_length | (--train-iters or --train-samples given) |
| 9 | _validate_lr | start/end_weight_decay for the constant style (--lr given) |
| 10 | _validate_checkpointing | (--load a directory; --save created and writable) |
| 11 | _validate_data | split '969, 30, 1' with --data-path, dataloader_type 'single' (none required: pretrain() checks); with --sft every line of the chat files parsed (FILE:LINE) |
| 13 | _set_training_state | consumed/skipped sample counters, variable_seq_lengths |

Every error is an ArgsError naming the flag(s) and what to do. validate_megatron_flags is in
megatron/training/arguments_megatron.py, beside its tables of Megatron-LM's flags; validate_model_architecture
in megatron/training/arguments_model.py.

Where each rule is written. A rule between the values of one config group is written on the group
(its rules(): the model's sizes, dropout and the optimizer's constants, the learning-rate schedule, the
training length, batch sizes and intervals, checkpointing, precision, the parallel sizes and timeouts,
data, MoE and LoRA settings; the groups are in megatron/training/config/groups*.py), a rule between
groups once in megatron/training/config/between.py (positions against the sequence, the data-parallel
options, the hybrid pattern, the schedule's unit, warm-up before decay, the seed on every pipeline stage,
LoRA without experts). Steps 3 (DistributedConfig's), 5a (the other groups') and 7 (TrainingConfig's,
then those between groups) apply them here; MegatronConfig.check gives a config built in Python the
same line. What stays here, and why:
  - required flags (step 5, --micro-batch-size, the training length, --lr, --seq-length): a run needs
    them; a config is built from defaults that leave them unset, and only a run is refused for that;
  - the parallel layout's divisibility (steps 3, 5c, 5d's query groups, 7-7d, the expert layout in
    _validate_moe): the world size divided by the sizes, the model's heads, layers, sequence and
    micro-batches by them (the world size and the run's model family are the run's, not settings), and
    --distributed-backend nccl, which needs the device;
  - the file system: --load and --save directories, dataset files, --sft files (steps 10, 11);
  - derived values and their checks (kv_channels, ffn_hidden_size, params_dtype, the global batch size,
    the legacy split), the dead and older flags (steps 1-2b), the refusal table (step 4);
  - the rules of the model's TransformerConfig (_check_config_rules) and the Mamba sizes: written once in
    megatron/model/transformer_config.py, on the built config (derived values included);
  - the architecture rules of validate_model_architecture (arguments_model.py: rope, GQA, activations,
    T5 and BERT, which read the model family and derived sizes): not moved yet.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import sys
import tempfile
from argparse import Namespace
from typing import Any

import torch

from megatron.training.argument_utils import ArgsError, flag
from megatron.training.arguments_megatron import refusal_rows, validate_megatron_flags
from megatron.training.arguments_model import default_ffn_hidden_size, validate_model_architecture
from megatron.training.config import GROUPS, ConfigGroup
from megatron.training.config.container import RUN_STATE, MegatronConfig
from megatron.training.config.groups import (
    PER_SPLIT_DATA_PATHS,
    DistributedConfig,
    TrainingConfig,
    rampup_batch_sizes,
)
from megatron.training.config_builders import config_flag, core_transformer_config_from_args
from megatron.core import device
from megatron.data.utils import parse_data_path
from megatron.training.utils import print_line


# Deprecated / shorthand flags in one table: dest -> (action, message or (target dest, value)).
# "exit": print Megatron's message on rank 0 and stop the program (as Megatron's exit()).
# "error": raise ArgsError with Megatron's message. "set": the flag is a shorthand for another.
# The dead flags are removed from args afterwards, as Megatron does (del args.checkpoint_activations).
FLAG_ALIASES: dict[str, tuple] = {
    "checkpoint_activations": ("exit", ("--checkpoint-activations is no longer valid, use --recompute-activations, "
                                       "or, for more control, --recompute-granularity and --recompute-method.")),
    "batch_size": ("error", "--batch-size argument is no longer valid, use --micro-batch-size instead"),
    "warmup": ("error", "--warmup argument is no longer valid, use --lr-warmup-fraction instead"),
    "model_parallel_size": ("error", ("--model-parallel-size is no longer valid, "
                                     "use --tensor-model-parallel-size instead")),
    "recompute_activations": ("set", ("recompute_granularity", "selective")),
    "use_rotary_position_embeddings": ("set", ("position_embedding_type", "rope")),
}

# The refusal table: features that later issues add. A row: (dest, flag as the user sees it,
# supported value, feature). A value other than the supported one raises "not supported yet";
# delete the row when it lands. Megatron-LM's flags of features we lack are its last rows
# (megatron/training/arguments_megatron.py REFUSED).
NOT_YET_SUPPORTED = (
    ("transformer_impl", "--transformer-impl", "local", "Transformer Engine layers"),
    ("fp8", "--fp8-format", None, "FP8 training"),
) + refusal_rows()

# The GPT model's required shape flags (Megatron's required_args).
REQUIRED_MODEL_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")


def _print_rank_0(args: Namespace, message: str) -> None:
    if args.rank == 0:
        print_line(message)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ArgsError(f"environment variable {name}={text!r} must be an integer "
                        f"(it is set by torchrun; unset it for a single-process run)") from None


def env_rank_and_world_size() -> tuple:
    """(RANK, WORLD_SIZE) from the environment, as torchrun sets them; (0, 1) when unset."""
    return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)


def with_run_state(args: Namespace) -> Namespace:
    """What every run's Namespace holds besides the flags, so that no reader needs a default for it:
    rank and world_size from RANK / WORLD_SIZE (as Megatron-LM's), and RUN_STATE's values until the run
    sets them (args_defaults fill the ones still None, the tokenizer, a loaded checkpoint). Attributes
    already there stand (a script's own --eos-id; a Namespace validated before)."""
    present = vars(args)
    if "rank" not in present or "world_size" not in present:
        args.rank, args.world_size = env_rank_and_world_size()
    for name, value in RUN_STATE.items():
        if name not in present:
            setattr(args, name, value)
    return args


def _refuse_broken_rules(group: type, args: Namespace) -> None:
    """The rules written on a config group (its rules(): megatron/training/config/groups.py) applied to
    args' values: the first broken one is the ArgsError, the line MegatronConfig.check gives a config
    built in Python. (The dead alias flags, removed from args, are at their defaults.)"""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(group) if f.name not in FLAG_ALIASES}
    problems = group(**values).rules()
    if problems:
        raise ArgsError(problems[0])


def _refuse_broken_group_rules(args: Namespace) -> None:
    """Every group's rules, in --help order, but DistributedConfig's (applied before the world size is
    divided: _validate_parallel) and TrainingConfig's (once the global batch size is derived:
    _validate_batch)."""
    for group in GROUPS:
        if group not in (DistributedConfig, TrainingConfig) and group.rules is not ConfigGroup.rules:
            _refuse_broken_rules(group, args)


def _refuse_broken_rules_between_groups(args: Namespace) -> None:
    """The rules between groups (megatron/training/config/between.py), every group's own having passed:
    the first broken one is the ArgsError, the line MegatronConfig.check gives a config."""
    problems = MegatronConfig.from_namespace(args).rules()
    if problems:
        raise ArgsError(problems[0])


# ----------------------------------------------------------------------------- steps 1-4


def _apply_defaults(args: Namespace, defaults: dict[str, Any] | None) -> None:
    """Megatron's args_defaults: fill values the user did not give (those still None)."""
    for key, value in (defaults or {}).items():
        current = getattr(args, key, None)
        if current is None:
            setattr(args, key, value)
        elif current != value:
            _print_rank_0(args, f"WARNING: overriding default arguments for {key}:{value} "
                                f"with {key}:{current}")


# Accelerate's Megatron-LM guide (its other_megatron_args) spells two model choices as Megatron-LM's
# older releases did: position_embedding_type "rotary" / "absolute", and attention_head_type.
POSITION_EMBEDDING_SPELLINGS = {"rotary": "rope", "absolute": "learned_absolute"}
ATTENTION_HEAD_TYPES = ("multihead", "multiquery")


def _apply_older_spellings(args: Namespace) -> None:
    """position_embedding_type rotary / absolute -> rope / learned_absolute; attention_head_type
    multiquery -> --group-query-attention with one query group (multihead: one group per head)."""
    kind = args.position_embedding_type
    if kind in POSITION_EMBEDDING_SPELLINGS:
        args.position_embedding_type = POSITION_EMBEDDING_SPELLINGS[kind]
    head_type = args.attention_head_type
    if head_type is None:
        return
    if head_type not in ATTENTION_HEAD_TYPES:
        raise ArgsError(f"--attention-head-type {head_type}: use multihead or multiquery")
    if head_type == "multiquery":
        if args.group_query_attention and args.num_query_groups != 1:
            raise ArgsError(f"--attention-head-type multiquery is one query group; --num-query-groups "
                            f"{args.num_query_groups} asks for more")
        args.group_query_attention, args.num_query_groups = True, 1
    elif args.group_query_attention:
        raise ArgsError("--attention-head-type multihead is one key/value head per attention head; "
                        "it contradicts --group-query-attention")


def _apply_flag_aliases(args: Namespace) -> None:
    """Dead flags exit or raise with Megatron's message; shorthand flags set their target."""
    for dest, (action, payload) in FLAG_ALIASES.items():
        value = getattr(args, dest, None)
        if value not in (None, False):
            if action == "exit":
                _print_rank_0(args, payload)
                # Megatron calls exit() (status 0); a non-zero status tells job runners it did not train.
                sys.exit(1)
            if action == "error":
                raise ArgsError(payload)
            target, target_value = payload
            setattr(args, target, target_value)
        if hasattr(args, dest):
            delattr(args, dest)


def data_parallel_size(world_size: int, tp: int, pp: int, cp: int = 1) -> int:
    """world_size / (tp x pp x cp), with an ArgsError when it does not divide."""
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ArgsError(f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp}) "
                        f"x --pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}); "
                        "change the parallel sizes or the number of processes")
    return world_size // model_parallel


def _validate_parallel(args: Namespace) -> None:
    """rank, world_size, data_parallel_size and the distributed backend."""
    if args.rank is None or args.world_size is None:
        args.rank, args.world_size = env_rank_and_world_size()
    if args.world_size < 1:
        raise ArgsError(f"WORLD_SIZE must be >= 1, got {args.world_size}")
    if not 0 <= args.rank < args.world_size:
        raise ArgsError(f"RANK ({args.rank}) must be in [0, WORLD_SIZE ({args.world_size})); "
                        "launch with torchrun, which sets both")
    _refuse_broken_rules(DistributedConfig, args)  # (the sizes positive before the world size is divided)
    args.data_parallel_size = data_parallel_size(args.world_size, args.tensor_model_parallel_size,
                                                 args.pipeline_model_parallel_size, args.context_parallel_size)
    _print_rank_0(args, f"using world size: {args.world_size}, data-parallel size: {args.data_parallel_size}, "
                        f"context-parallel size: {args.context_parallel_size}, "
                        f"tensor-model-parallel size: {args.tensor_model_parallel_size}, "
                        f"pipeline-model-parallel size: {args.pipeline_model_parallel_size} ")
    if args.distributed_backend is None:
        args.distributed_backend = device.get_backend()
    elif args.distributed_backend == "nccl" and not device.accelerator_available():
        raise ArgsError("--distributed-backend nccl needs a CUDA device and none is available; "
                        "use --distributed-backend gloo (or leave it unset to choose automatically)")


def _validate_not_yet_supported(args: Namespace) -> None:
    """Flags of features that later issues add raise instead of being ignored."""
    for dest, shown, supported, feature in NOT_YET_SUPPORTED:
        value = getattr(args, dest)
        if value == supported:
            continue
        given = "" if isinstance(value, bool) else " " + (" ".join(map(str, value)) if isinstance(value, list)
                                                           else str(value))
        keep = "remove it" if supported in (None, False, True, []) else f"use {shown} {supported}"
        raise ArgsError(f"{shown}{given}: {feature} is not supported yet; {keep}")


# ----------------------------------------------------------------------------- steps 5-6


def _require_model_shape(args: Namespace) -> None:
    """The GPT model's shape flags (Megatron's required_args): a run needs them."""
    for dest in REQUIRED_MODEL_ARGS:
        if getattr(args, dest) is None:
            raise ArgsError(f"{flag(dest)} is required")


def _validate_model(args: Namespace) -> None:
    """The 4h and h/heads defaults (ModelConfig's rules passed: the heads split the hidden size)."""
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args)


def _validate_tensor_parallel(args: Namespace) -> None:
    """Heads and MLP columns split evenly over the TP ranks; the sequence too under --sequence-parallel."""
    tp = args.tensor_model_parallel_size
    for dest in ("num_attention_heads", "ffn_hidden_size"):
        if getattr(args, dest) % tp:
            raise ArgsError(f"{flag(dest)} ({getattr(args, dest)}) must be divisible by --tensor-model-parallel-size "
                            f"({tp}): each tensor-parallel rank holds an equal share")
    if args.sequence_parallel and tp == 1:
        _print_rank_0(args, "WARNING: disabling --sequence-parallel because --tensor-model-parallel-size is 1")
        args.sequence_parallel = False
    if args.sequence_parallel and args.seq_length is not None and args.seq_length % tp:
        raise ArgsError(f"--seq-length ({args.seq_length}) must be divisible by --tensor-model-parallel-size ({tp}) "
                        "with --sequence-parallel: each rank keeps seq-length / TP tokens")


def _validate_precision(args: Namespace) -> None:
    """params_dtype from --fp16/--bf16, softmax in fp32 with query-key scaling; the precision rules
    (fp16 or bf16, loss scales) are MixedPrecisionConfig's."""
    args.params_dtype = torch.float32
    if args.fp16:
        args.params_dtype = torch.half
    if args.bf16:
        args.params_dtype = torch.bfloat16
        # bfloat16 gradients are too coarse to sum across micro-batches: accumulate them in fp32.
        if not args.accumulate_allreduce_grads_in_fp32:
            args.accumulate_allreduce_grads_in_fp32 = True
            _print_rank_0(args, "accumulate and all-reduce gradients in fp32 for bfloat16 data type.")
    _print_rank_0(args, f"using {args.params_dtype} for parameters ...")
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True


# ----------------------------------------------------------------------------- steps 7-9


def _validate_batch(args: Namespace) -> None:
    """The global batch size (mbs x dp when not given), the ramp-up's values as ints, and what the
    data-parallel size asks of them; the batch rules of the values themselves are TrainingConfig's."""
    if args.micro_batch_size is None:
        raise ArgsError("--micro-batch-size is required")
    per_step = args.micro_batch_size * args.data_parallel_size
    derived = args.global_batch_size is None
    if derived:
        args.global_batch_size = per_step
    _refuse_broken_rules(TrainingConfig, args)  # (the ramp-up against a derived global batch size too)
    _refuse_broken_rules_between_groups(args)
    if derived:
        _print_rank_0(args, f"setting global batch size to {args.global_batch_size}")
    if args.global_batch_size % per_step:
        raise ArgsError(f"--global-batch-size ({args.global_batch_size}) must be divisible by --micro-batch-size "
                        f"({args.micro_batch_size}) x data-parallel size ({args.data_parallel_size})")
    if args.rampup_batch_size is None:
        return
    start, incr, _ = args.rampup_batch_size = rampup_batch_sizes(args.rampup_batch_size)
    if start % per_step or incr % per_step:
        raise ArgsError(f"--rampup-batch-size start ({start}) and increment ({incr}) must be divisible by "
                        f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
                        f"({args.data_parallel_size}), so that every ramp-up batch splits into micro-batches")


def _validate_context_parallel(args: Namespace) -> None:
    """--context-parallel-size > 1: the load-balanced split needs s divisible by 2 x CP (and the CP
    rank's s / CP by TP under sequence parallelism); only the causal mask and no ALiBi; the comm
    types' own rules are TransformerConfig's (_check_config_rules)."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    family = args.model_family
    if family in ("BERT", "T5"):
        raise ArgsError(f"--context-parallel-size > 1 is for causal (GPT-style) models: {family}'s bidirectional "
                        "attention with a padding mask is not supported")
    seq = args.seq_length
    if seq is not None and seq % (2 * cp):
        raise ArgsError(f"--seq-length ({seq}) must be divisible by 2 x --context-parallel-size ({2 * cp}): "
                        "the sequence is cut into 2 x CP load-balanced chunks")
    tp = args.tensor_model_parallel_size
    if seq is not None and args.sequence_parallel and (seq // cp) % tp:
        raise ArgsError(f"--seq-length / --context-parallel-size ({seq // cp}) must be divisible by "
                        f"--tensor-model-parallel-size ({tp}) with --sequence-parallel")
    if args.reset_attention_mask:
        raise ArgsError("--reset-attention-mask (per-document attention, packed sequences) is not supported with "
                        "--context-parallel-size > 1: context parallelism takes the causal mask only")
    if args.position_embedding_type == "alibi":
        raise ArgsError("--position-embedding-type alibi is not supported with --context-parallel-size > 1")


def _validate_pipeline_parallel(args: Namespace) -> None:
    """Layers split evenly over the stages (and virtual stages); the interleaved schedule's batches.
    With --pipeline-model-parallel-split-rank (T5) each stack splits evenly over its own stages."""
    pp = args.pipeline_model_parallel_size
    split = args.pipeline_model_parallel_split_rank
    if split is not None:
        if not 0 < split < pp:
            raise ArgsError(f"--pipeline-model-parallel-split-rank ({split}) must be in [1, "
                            f"--pipeline-model-parallel-size - 1] = [1, {pp - 1}]: the first decoder stage")
        for name, stages in (("encoder", split), ("decoder", pp - split)):
            if args.num_layers % stages:
                raise ArgsError(f"--num-layers ({args.num_layers}) must be divisible by the {name}'s {stages} "
                                f"pipeline stages (--pipeline-model-parallel-split-rank {split} of "
                                f"--pipeline-model-parallel-size {pp})")
        if args.num_layers_per_virtual_pipeline_stage is not None or args.num_virtual_stages_per_pipeline_rank:
            raise ArgsError("--pipeline-model-parallel-split-rank does not take virtual pipeline stages")
        args.virtual_pipeline_model_parallel_size = None
        return
    if args.num_layers % pp:
        raise ArgsError(f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size "
                        f"({pp}): every stage holds the same number of layers")
    per_stage = args.num_layers // pp
    by_layers, by_stages = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    args.virtual_pipeline_model_parallel_size = None
    if by_layers is None and by_stages is None:
        return
    if by_layers is not None and by_stages is not None:
        raise ArgsError("give one of --num-layers-per-virtual-pipeline-stage and "
                        "--num-virtual-stages-per-pipeline-rank, not both")
    if pp == 1:
        raise ArgsError("the interleaved schedule (--num-layers-per-virtual-pipeline-stage / "
                        "--num-virtual-stages-per-pipeline-rank) needs --pipeline-model-parallel-size > 1")
    shown = ("--num-layers-per-virtual-pipeline-stage", by_layers) if by_layers is not None else \
        ("--num-virtual-stages-per-pipeline-rank", by_stages)
    if shown[1] < 1 or per_stage % shown[1]:
        raise ArgsError(f"{shown[0]} ({shown[1]}) must divide the {per_stage} layers of each pipeline stage "
                        f"(--num-layers {args.num_layers} / --pipeline-model-parallel-size {pp})")
    virtual = per_stage // by_layers if by_layers is not None else by_stages
    if virtual == 1:
        return  # one chunk per stage: the plain 1F1B schedule
    args.virtual_pipeline_model_parallel_size = virtual
    per_step = args.micro_batch_size * args.data_parallel_size
    batches = [args.global_batch_size] + (list(args.rampup_batch_size[:2]) if args.rampup_batch_size else [])
    for batch in batches:
        if (batch // per_step) % pp:
            raise ArgsError(f"the interleaved schedule needs the number of micro-batches ({batch // per_step} = "
                            f"batch {batch} / (--micro-batch-size {args.micro_batch_size} x data-parallel size "
                            f"{args.data_parallel_size})) to be a multiple of --pipeline-model-parallel-size ({pp})")


def _validate_pipeline_schedule(args: Namespace) -> None:
    """PP > 1: replay every stage's sends and receives of the schedule this layout runs (training and
    evaluation) and refuse a layout whose stages would wait on each other forever (simulator.py)."""
    pp = args.pipeline_model_parallel_size
    if pp == 1:
        return
    from megatron.core.pipeline_parallel.simulator import ScheduleDeadlockError, check_schedule

    per_step = args.micro_batch_size * args.data_parallel_size
    batches = [args.global_batch_size] + (list(args.rampup_batch_size[:1]) if args.rampup_batch_size else [])
    for num_microbatches in sorted({max(batch // per_step, 1) for batch in batches}):
        if num_microbatches > 8 * pp:  # past the warm-up the steady 1F1B rounds repeat: replay 8 x pp of them
            num_microbatches = 8 * pp + num_microbatches % pp
        try:
            check_schedule(pp, args.virtual_pipeline_model_parallel_size, num_microbatches)
        except ScheduleDeadlockError as error:
            raise ArgsError(str(error)) from error


def _validate_model_config(args: Namespace) -> None:
    """The rules of the model's config (recompute, MoE, ...): written once, in TransformerConfig,
    and reported here naming the flags."""
    _check_config_rules(args)
    _validate_hybrid(args)


def _validate_hybrid(args: Namespace) -> None:
    """A hybrid model's Mamba sizes (heads and groups divisible by each other and by the tensor-parallel
    size), named by their flags; its pattern's rules are between.hybrid_layers'."""
    from megatron.model.mamba.mixer import mamba_dims
    from megatron.model.transformer_config import ConfigRuleError
    from megatron.training.config_builders import hybrid_pattern_from_args

    pattern = hybrid_pattern_from_args(args)
    if pattern is None or "M" not in pattern:
        return
    try:
        mamba_dims(core_transformer_config_from_args(args))
    except ConfigRuleError as error:
        raise ArgsError(error.render(config_flag)) from None


def _validate_train_length(args: Namespace) -> None:
    """A training length: --train-iters or --train-samples (its rules are TrainingConfig's)."""
    if args.train_iters is None and args.train_samples is None:
        raise ArgsError("give the training length: --train-iters or --train-samples")


def _validate_lr(args: Namespace) -> None:
    """A peak learning rate; the constant weight-decay style's start and end (the schedule's rules are
    LearningRateConfig's and RegularizationConfig's, the optimizer's constants' too)."""
    if args.lr is None:
        raise ArgsError("--lr is required (the peak learning rate)")
    if args.weight_decay_incr_style == "constant":
        args.start_weight_decay = args.end_weight_decay = args.weight_decay


# ----------------------------------------------------------------------------- steps 10-13


def _validate_checkpointing(args: Namespace) -> None:
    """--load must be a directory (not a file); --save a writable one (created if missing). (The flags'
    rules, --save-interval, the format, the options that need --load, are CheckpointConfig's.)"""
    if args.load is not None:
        from megatron.training.checkpointing import check_load_directory

        check_load_directory(args.load)
    if args.save is not None:
        _check_save_directory(args.save)


def _check_save_directory(path: str) -> None:
    """Create --save if missing (as Megatron does) and prove it writable, before any work."""
    def refuse(what: str, error: OSError) -> ArgsError:
        name = errno.errorcode.get(error.errno, "") if error.errno else ""
        reason = f"{name} ({error.strerror})" if name and error.strerror else str(error)
        return ArgsError(f"--save {path}: {what}: {reason}")

    if os.path.exists(path) and not os.path.isdir(path):
        raise ArgsError(f"--save {path} is a file, not a directory (checkpoints are folders under it)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise refuse("cannot create the directory", error) from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        raise refuse("the directory is not writable", error) from None


def _validate_moe(args: Namespace) -> None:
    """The expert-parallel layout against the world size. (The sizes' own rules are MoEConfig's; the MoE
    rules of the model are TransformerConfig's (_check_moe), reported by _validate_model_config.)"""
    if args.num_experts is None and args.expert_model_parallel_size == 1:
        return
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    ep, pp = args.expert_model_parallel_size, args.pipeline_model_parallel_size
    if args.world_size % (etp * ep * pp):
        raise ArgsError(f"world size ({args.world_size}) is not divisible by --expert-tensor-parallel-size ({etp}) x "
                        f"--expert-model-parallel-size ({ep}) x --pipeline-model-parallel-size ({pp})")


def _check_config_rules(args: Namespace) -> None:
    """Build the model's TransformerConfig from args: a rule it refuses becomes an ArgsError whose
    message names the flags (megatron.model.transformer_config.ConfigRuleError)."""
    from megatron.model.transformer_config import ConfigRuleError

    try:
        core_transformer_config_from_args(args)
    except ConfigRuleError as error:
        raise ArgsError(error.render(config_flag)) from None


def _validate_data(args: Namespace) -> None:
    """The data rules (one source, blends, split, --sft's options) are DataConfig's; here the dataset
    files, the legacy default split, the sequence length and the data loader's type."""
    for dest in ("data_path",) + PER_SPLIT_DATA_PATHS:
        if getattr(args, dest) is not None:
            _check_dataset_files(flag(dest), parse_data_path(getattr(args, dest))[0], jsonl=args.sft)
    if args.data_path is not None and args.split is None:
        args.split = "969, 30, 1"
        _print_rank_0(args, 'WARNING: Please specify --split when using --data-path. '
                            'Using legacy default value of "969, 30, 1"')
    if args.seq_length is None:
        raise ArgsError("--seq-length is required (tokens per training sample)")
    if args.sft:
        _check_sft_files(args)
    if args.dataloader_type is None:
        args.dataloader_type = "single"


def require_training_data(args: Namespace) -> None:
    """pretrain()'s data comes from the flags: one of them must name it, said before the model is built.

    Not part of validate_args: as in Megatron, a caller with its own data (Accelerate's data loader,
    a custom dataset provider, tasks/main.py's --train-data) validates without any data flag.
    """
    given = any(getattr(args, dest) is not None
                for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path"))
    if not given and not args.mock_data:
        raise ArgsError("no training data: give --data-path (with --split), --train-data-path/"
                        "--valid-data-path/--test-data-path, or --mock-data")


def _check_sft_files(args: Namespace) -> None:
    """Every line of every --sft file parses (FILE:LINE: reason), before the model is built; the
    dataset builder reuses the line index (megatron.data.sft_dataset.open_sft_file)."""
    from megatron.data.sft_dataset import open_sft_file

    for dest in ("data_path",) + PER_SPLIT_DATA_PATHS:
        if getattr(args, dest) is not None:
            for path in parse_data_path(getattr(args, dest))[0]:
                open_sft_file(path)


def _check_dataset_files(shown: str, prefixes: list, jsonl: bool = False) -> None:
    """Each prefix needs PREFIX.bin and PREFIX.idx (with --sft: is a JSON-lines file): say so now,
    not after the model is built."""
    for prefix in prefixes:
        if jsonl:
            if not os.path.isfile(prefix):
                raise ArgsError(f"{shown} {prefix}: no such file (with --sft, a JSON-lines file of conversations)")
            continue
        missing = [prefix + ext for ext in (".idx", ".bin") if not os.path.isfile(prefix + ext)]
        if missing:
            hint = " (give the prefix without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
            raise ArgsError(f"{shown} {prefix}: no such dataset, {' and '.join(missing)} not found{hint}")


def _set_training_state(args: Namespace) -> None:
    """Counters that checkpoints carry; they start at zero."""
    args.consumed_train_samples = 0
    args.consumed_valid_samples = 0
    args.skipped_train_samples = 0
    args.variable_seq_lengths = False


def validate_args(args: Namespace, defaults: dict[str, Any] | None = None) -> Namespace:
    """Check the parsed flags, derive Megatron's values in place and return args.

    defaults: Megatron's args_defaults; each fills its key only where the value is None.
    Raises ArgsError (a ValueError) naming the flag; --checkpoint-activations exits.
    Prints Megatron's argument block on rank 0 at the end.
    """
    with_run_state(args)  # (a Namespace made by hand, not by parse_args)
    _apply_defaults(args, defaults)
    _apply_older_spellings(args)
    _apply_flag_aliases(args)
    validate_megatron_flags(args)
    _validate_parallel(args)
    _validate_not_yet_supported(args)
    _require_model_shape(args)
    _refuse_broken_group_rules(args)
    _validate_model(args)
    _validate_tensor_parallel(args)
    validate_model_architecture(args)
    _validate_precision(args)
    _validate_batch(args)
    _validate_pipeline_parallel(args)
    _validate_context_parallel(args)
    _validate_pipeline_schedule(args)
    _validate_model_config(args)
    _validate_moe(args)
    _validate_train_length(args)
    _validate_lr(args)
    _validate_checkpointing(args)
    _validate_data(args)
    _set_training_state(args)
    print_args(args)
    return args


def print_args(args: Namespace, title: str = "arguments") -> None:
    """Megatron's sorted '  name .... value' block, on rank 0 only."""
    if args.rank != 0:
        return
    print_line(f"------------------------ {title} ------------------------")
    lines = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in vars(args).items()]
    for line in sorted(lines, key=lambda x: x.lower()):
        print_line(line)
    print_line(f"-------------------- end of {title} ---------------------")
