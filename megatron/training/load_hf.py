"""`pretrain_gpt.py --load-hf DIR`: train straight from a transformers model directory.

    parse_args -> apply_hf_args (the model's args from DIR/config.json) -> validate_args -> ...
    get_model -> load_hf_weights (each rank cuts its own shards from DIR's tensors) -> train

apply_hf_args fills every architecture flag the command line did not give from the HF config (as
--use-checkpoint-args does from a checkpoint) and refuses, in one line naming the flag and both
values, one that it gave differently: the two are compared as ModelArchitecture descriptions
(megatron/training/config/architecture.py), so a flag that shapes nothing in this model (a rotary
setting without RoPE) is not. Dropout and the init std are the run's choice: taken from the HF
config only when not given. The vocabulary is HF's vocab_size, padded as Megatron pads it
for this TP size; without tokenizer flags the directory's tokenizer.json is the tokenizer.

load_hf_weights: for every tensor of this rank's model chunks, the HF tensors its mapping rule
names (megatron/convert/huggingface.weight_rules) are read from safetensors one at a time, turned
into our whole tensor and cut to this rank's shard (layout_rules.tensor_layout, shard_for_rank).
With --load as well, a checkpoint there wins (a restarted run resumes from its own checkpoint);
--load-hf is used while --load holds none.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Callable, List, Optional, Set

import torch

from megatron.training.checkpointing import CheckpointError  # (imported there, so run_cli reports it in one line)
from megatron.convert import huggingface
from megatron.convert.hf_files import ARCHITECTURE_FLAGS, HFCheckpoint, hf_arg_values, hf_seq_length, pad_rows
from megatron.convert.layout_rules import (
    expert_key, is_vocab_tensor, padded_vocab_size, renumber, renumber_expert, tensor_layout,
)
from megatron.training.config.architecture import ModelArchitecture


def given_dests(argv: Optional[List[str]], extra_args_provider: Optional[Callable] = None) -> Set[str]:
    """The dests the command line sets explicitly (whatever the value, the parser's default included)."""
    from megatron.training.arguments import build_parser, given_dests as explicit

    return explicit(build_parser(extra_args_provider), argv)


def _describe(dest: str, value: Any, gqa: bool, other_gqa: bool) -> str:
    """How a message names one side's value of dest (gqa: whether that side has grouped-query attention)."""
    flag = ARCHITECTURE_FLAGS[dest]
    if dest == "num_query_groups":
        if not gqa:
            return "no --group-query-attention"
        return f"{flag} {value}" if other_gqa else f"--group-query-attention {flag} {value}"
    if dest == "add_bias_linear":
        return f"no {flag}" if value else flag
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    return f"{flag} {value}"


def _architecture_conflicts(values: dict, args: argparse.Namespace) -> List[str]:
    """The architecture flags where the run (args: the command line's values, the HF config's where it
    gave none) describes another model than the HF config (values), in the HF config's order."""
    theirs = ModelArchitecture.from_checkpoint_args(argparse.Namespace(**values))  # unknown: None
    ours = ModelArchitecture.from_args(args)
    fields = {field.name for field in dataclasses.fields(ModelArchitecture)}  # (GQA: in num_query_groups)
    names = [dest for dest in values if dest in ARCHITECTURE_FLAGS and dest in fields]
    gqa = (bool(values.get("group_query_attention")), bool(args.group_query_attention))
    problems = []
    for dest, their_value, our_value in theirs.differences(ours, names):
        if dest == "num_query_groups" and not any(gqa):
            continue  # one group per head on both sides: the heads differ, and are named
        problems.append(f"the HF config gives {_describe(dest, their_value, gqa[0], gqa[1])} but the command "
                        f"line has {_describe(dest, our_value, gqa[1], gqa[0])}")
    return problems


def apply_hf_args(args: argparse.Namespace, argv: Optional[List[str]] = None,
                  extra_args_provider: Optional[Callable] = None) -> HFCheckpoint:
    """Before validate_args: the model's args from --load-hf's config (CheckpointError on a conflict)."""
    checkpoint = HFCheckpoint(args.load_hf)
    family = huggingface.ARCHITECTURES[checkpoint.config.model_type].family
    if family == "MAMBA" and not args.is_hybrid_model:
        raise CheckpointError(f"--load-hf {args.load_hf}: a {checkpoint.config.model_type} model is a MambaModel: "
                              "train it with pretrain_mamba.py")
    if family not in ("GPT", "MAMBA"):
        raise CheckpointError(f"--load-hf {args.load_hf}: a {checkpoint.config.model_type} model is not a GPTModel; "
                              f"convert it with tools/checkpoint/convert.py --model-type {family} --loader hf")
    checkpoint.rules()  # missing or unknown tensors: refused before any process builds a model
    given = given_dests(argv, extra_args_provider)
    values = hf_arg_values(checkpoint.config)
    for dest, value in values.items():
        if dest not in given:
            setattr(args, dest, value)
    problems = _architecture_conflicts(values, args)
    if problems:
        raise CheckpointError(f"--load-hf {args.load_hf}: " + "; ".join(problems)
                              + " (leave the flag out to take the HF config's)")
    if "seq_length" not in given and "encoder_seq_length" not in given:
        args.seq_length = hf_seq_length(checkpoint.config)
    else:
        try:
            huggingface.config_from_hf(checkpoint.config, seq_length=args.seq_length or args.encoder_seq_length)
        except ValueError as error:
            raise CheckpointError(f"--load-hf {args.load_hf}: {error}") from None
    if not given & {"tokenizer_type", "tokenizer_model", "vocab_file"} and "tokenizer.json" in checkpoint.tokenizer_files():
        args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", os.path.abspath(args.load_hf)
    args.padded_vocab_size = padded_vocab_size(int(checkpoint.config.vocab_size), int(args.make_vocab_size_divisible_by),
                                               int(args.tensor_model_parallel_size))
    return checkpoint


def load_hf_instead(args: argparse.Namespace) -> bool:
    """--load-hf is used: given, and --load (if any) holds no checkpoint yet."""
    from megatron.training.checkpointing import checkpoint_exists

    return args.load_hf is not None and not checkpoint_exists(args.load)


def load_hf_weights(model: List[torch.nn.Module], args: argparse.Namespace, vocab_size: int) -> None:
    """Fill this rank's model chunks from --load-hf's tensors (vocab_size: the tokenizer's, <= HF's)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layout import shard_for_rank
    from megatron.core.utils import unwrap_model
    from megatron.training.utils import print_rank_0

    checkpoint = HFCheckpoint(args.load_hf)
    rules = {rule.ours: rule for rule in checkpoint.rules()}
    checkpoint.check_tied_head()
    if vocab_size > int(checkpoint.config.vocab_size):
        raise CheckpointError(f"--load-hf {args.load_hf}: the tokenizer has {vocab_size} ids, more than the HF "
                              f"model's vocab_size {checkpoint.config.vocab_size}")
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    pp, pp_rank = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()
    # MoE: this rank's local experts are global ep_rank * E / EP + i, cut over the expert-TP group.
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    per_ep_rank = int(args.num_experts or 0) // parallel_state.get_expert_model_parallel_world_size()
    etp, etp_rank = (parallel_state.get_expert_tensor_parallel_world_size(),
                     parallel_state.get_expert_tensor_parallel_rank())
    chunks = unwrap_model(model)
    per_chunk = int(args.num_layers) // (pp * len(chunks))
    tied = not args.untie_embeddings_and_output_weights
    for chunk_id, chunk in enumerate(chunks):
        offset = (chunk_id * pp + pp_rank) * per_chunk  # chunk v of stage p is model chunk v * pp + p
        for name, target in chunk.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state"):
                continue
            whole_name = renumber(name, offset)
            if tied and whole_name == "output_layer.weight":  # the last stage's copy of the tied embedding
                whole_name = "embedding.word_embeddings.weight"
            split, rank = tp, tp_rank
            if expert_key(whole_name) is not None:
                whole_name = renumber_expert(whole_name, ep_rank * per_ep_rank + expert_key(whole_name)[1])
                split, rank = etp, etp_rank
            rule = rules.get(whole_name)
            if rule is None:
                raise CheckpointError(f"--load-hf {args.load_hf}: the model's {whole_name} has no HF tensor "
                                      f"in the {checkpoint.config.model_type} mapping")
            whole = checkpoint.ours(rule)
            if is_vocab_tensor(whole_name):
                whole = pad_rows(whole, int(args.padded_vocab_size))
            shard = shard_for_rank(whole, tensor_layout(whole_name, args, split, rank), split, rank)
            if shard.shape != target.shape:
                raise CheckpointError(f"--load-hf {args.load_hf}: {whole_name} gives a shard of shape "
                                      f"{tuple(shard.shape)} for a parameter of shape {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(shard)
    print_rank_0(f"  loaded the HF model {checkpoint.config.model_type} from {args.load_hf} "
                 f"(vocabulary {checkpoint.config.vocab_size} ids padded to {args.padded_vocab_size})")
