"""Does a checkpoint fit this run? Its args (model shape, parallel layout), the args
--use-checkpoint-args takes from it, and its model state dict (tensor shapes and keys).

Megatron-LM's checkpoints hold megatron-core's `*._extra_state` entries (None, or an empty
tensor or BytesIO from Transformer Engine): the ones that carry no data are dropped before the
state dict is loaded; one that carries data (FP8 scaling state) has no place in this model and
is refused by name, like any other key the model does not have.
"""

from __future__ import annotations

import argparse
import io
import os
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from megatron.training.checkpoint_safety import CheckpointError
from megatron.training.config.architecture import LABELS, ModelArchitecture

# Model-shape and architecture args compared on load and taken from the checkpoint by
# --use-checkpoint-args (ModelArchitecture's LABELS). A checkpoint's weights mean something else under
# another norm, activation, position embedding or head layout, even where the tensor shapes agree
# (LayerNorm 1p, squared ReLU vs GeLU, interleaved rotary pairs).
_SHAPE_ARGS: Tuple[str, ...] = tuple(LABELS)
# Also taken from the checkpoint by load_args_from_checkpoint, but not compared on load: the
# rotary base and scaling are what a long-context fine-tune changes on purpose.
_ARCH_ARGS: Tuple[str, ...] = (
    "layernorm_epsilon", "norm_epsilon",
    "apply_residual_connection_post_layernorm", "openai_gelu", "tokenizer_type",
    "make_vocab_size_divisible_by", "seq_length", "group_query_attention",
    "rotary_base", "rotary_seq_len_interpolation_factor", "use_rope_scaling", "rope_scaling_factor",
    "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax", "moe_token_dispatcher_type",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
    "moe_grouped_gemm",
)
# Paths from the machine that saved the checkpoint: used only when this run gives none.
_PATH_ARGS: Tuple[str, ...] = ("vocab_file", "merge_file", "tokenizer_model")


def _describe(attr: str, label: str, value: Any) -> str:
    if attr == "add_bias_linear":
        return label if not value else f"no {label}"
    if attr == "num_query_groups":
        return f"{value} {label}"
    if isinstance(value, bool):
        return label if value else f"no {label}"
    return f"{label} {value}"


def check_checkpoint_args(checkpoint_args: argparse.Namespace, args: argparse.Namespace,
                          checkpoint_name: str) -> None:
    """Raise CheckpointError naming every model-shape flag where the checkpoint differs from
    this run (values that either side leaves unset are not compared)."""
    saved = ModelArchitecture.from_checkpoint_args(checkpoint_args)
    problems = [f"checkpoint at {checkpoint_name} was saved with {_describe(attr, LABELS[attr], saved_value)} "
                f"but this run has {_describe(attr, LABELS[attr], current)}"
                for attr, saved_value, current in saved.differences(ModelArchitecture.from_args(args))]
    if problems:
        raise CheckpointError("; ".join(problems)
                              + " (use --use-checkpoint-args to take the checkpoint's)")


def _expert_tensor_parallel_size(ns: argparse.Namespace) -> Any:
    """--expert-tensor-parallel-size, None meaning the tensor-parallel size (Megatron's default)."""
    etp = getattr(ns, "expert_tensor_parallel_size", None)
    return etp if etp is not None else getattr(ns, "tensor_model_parallel_size", 1)


def check_parallel_layout(checkpoint_args: argparse.Namespace, args: argparse.Namespace,
                          checkpoint_name: str) -> None:
    """Raise CheckpointError when the checkpoint was saved at other tensor/pipeline/expert sizes.

    Each file holds one rank's shards (one expert-parallel rank's experts, numbered locally);
    loading it at another layout would mis-assign rows or experts. (The padded vocabulary also
    depends on the TP size, so this check comes first, with the message that says what
    actually differs.)
    """
    # (virtual_pipeline_model_parallel_size is derived from either virtual-stage flag; None means
    # no interleaving, and the message then says "no --num-virtual-stages-per-pipeline-rank")
    for attr, label, default in (("tensor_model_parallel_size", "--tensor-model-parallel-size", 1),
                                 ("pipeline_model_parallel_size", "--pipeline-model-parallel-size", 1),
                                 ("virtual_pipeline_model_parallel_size", "--num-virtual-stages-per-pipeline-rank",
                                  None)):
        saved, current = getattr(checkpoint_args, attr, default), getattr(args, attr)
        if saved != current:
            saved_text = f"no {label}" if saved is None else f"{label} {saved}"
            current_text = f"no {label}" if current is None else f"{label} {current}"
            raise CheckpointError(f"checkpoint at {checkpoint_name} was saved with {saved_text} but this run "
                                  f"has {current_text}; a legacy checkpoint loads only at the tensor/pipeline "
                                  "sizes it was saved with (resharding is the checkpoint converter's job: "
                                  "tools/checkpoint/convert.py --target-tensor-parallel-size N "
                                  "--target-pipeline-parallel-size M)")
    if getattr(checkpoint_args, "num_experts", None) is None or args.num_experts is None:
        return  # a dense model (or a shape mismatch, which check_checkpoint_args names)
    for label, read in (("--expert-model-parallel-size", lambda ns: getattr(ns, "expert_model_parallel_size", 1)),
                        ("--expert-tensor-parallel-size", _expert_tensor_parallel_size)):
        saved, current = read(checkpoint_args), read(args)
        if saved != current:
            folder = os.path.dirname(os.path.dirname(checkpoint_name))  # (every rank names the same one)
            raise CheckpointError(f"checkpoint {folder} was saved with {label} {saved} but this run "
                                  f"has {label} {current}; a legacy (--ckpt-format torch) checkpoint holds each "
                                  "expert-parallel rank's experts in its own mp_rank_* folder and loads only at "
                                  f"the {label} it was saved with (save with --ckpt-format torch_dist to load "
                                  "at any expert-parallel size, or convert it: tools/checkpoint/convert.py "
                                  "--target-expert-parallel-size N)")


def _carries_no_data(value: Any) -> bool:
    if value is None:
        return True
    if torch.is_tensor(value):
        return value.numel() == 0
    if isinstance(value, io.BytesIO):
        return value.getbuffer().nbytes == 0
    if isinstance(value, (bytes, bytearray)):
        return len(value) == 0
    return False


def _listing(names: List[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def model_entries(saved: Dict[str, Any], current: Dict[str, Any], checkpoint_name: str,
                  strict: bool) -> Dict[str, Any]:
    """The entries of `saved` to load into a model whose state dict is `current`.

    Empty `_extra_state` entries the model has no slot for are dropped; CheckpointError names
    the extra state that carries data, the tensors whose shapes differ and (strict) the keys
    either side lacks.
    """
    kept, with_data = {}, []
    for name, value in saved.items():
        if name.rsplit(".", 1)[-1] == "_extra_state" and name not in current:
            if not _carries_no_data(value):
                with_data.append(name)
            continue
        kept[name] = value
    if with_data:
        raise CheckpointError(f"checkpoint {checkpoint_name} holds extra state with data that this "
                              f"model has no place for (Transformer Engine FP8 state?): {_listing(with_data)}")
    wrong = [f"{name} is {list(tensor.shape)} in the checkpoint but {list(current[name].shape)} in "
             "the model" for name, tensor in kept.items()
             if torch.is_tensor(tensor) and name in current and torch.is_tensor(current[name])
             and tensor.shape != current[name].shape]
    if wrong:
        raise CheckpointError(f"checkpoint {checkpoint_name} does not fit the model: " + "; ".join(wrong))
    if strict:
        problems = []
        unexpected = [name for name in kept if name not in current]
        missing = [name for name in current if name not in kept]
        if unexpected:
            problems.append(f"keys the model does not have: {_listing(unexpected)}")
        if missing:
            problems.append(f"model keys missing from the checkpoint: {_listing(missing)}")
        if problems:
            raise CheckpointError(f"checkpoint {checkpoint_name} does not fit the model: "
                                  + "; ".join(problems))
    return kept


def load_model_chunks(chunks: List[nn.Module], state_dict: Dict[str, Any], checkpoint_name: str,
                      strict: bool) -> None:
    """Load 'model' (or 'model0', 'model1', ... with several chunks) into each chunk."""
    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        if key not in state_dict:
            raise CheckpointError(f"checkpoint {checkpoint_name} has no '{key}' entry "
                                  f"(this run has {len(chunks)} model chunk(s))")
        if not isinstance(state_dict[key], dict):
            raise CheckpointError(f"checkpoint {checkpoint_name}: '{key}' is not a state dict "
                                  f"(found {type(state_dict[key]).__name__})")
        entries = model_entries(state_dict[key], chunk.state_dict(), checkpoint_name, strict)
        # A LoRA state-dict view (megatron/model/lora.state_dict_view) shows part of the model: the
        # keys were checked against that part above; torch's own check would count the rest missing.
        partial = getattr(chunk, "_lora_state_dict_view", None) is not None
        try:
            chunk.load_state_dict(entries, strict=strict and not partial)
        except RuntimeError as error:
            raise CheckpointError(
                f"cannot load the model from {checkpoint_name}: {error}") from error


def apply_checkpoint_args(args: argparse.Namespace, checkpoint_args: Any, checkpoint_name: str,
                          log: Callable[[str], None] = print) -> None:
    """--use-checkpoint-args: take the shape and architecture args from `checkpoint_args`
    (printing each that changes); tokenizer paths only when this run gives none."""
    if hasattr(checkpoint_args, "disable_bias_linear"):  # older files stored the flag itself
        checkpoint_args.add_bias_linear = not checkpoint_args.disable_bias_linear

    def _set_arg(name: str, force: bool = True) -> None:
        if not hasattr(checkpoint_args, name):
            return
        value, current = getattr(checkpoint_args, name), getattr(args, name)
        if (not force and current is not None) or value == current:
            return
        if value is None and name == "tokenizer_type":
            return  # a converted checkpoint records no tokenizer: the command line's stands
        log(f"  overriding {name} = {current} with {value} from the checkpoint {checkpoint_name}")
        setattr(args, name, value)

    for name in _SHAPE_ARGS:
        _set_arg(name)
    for name in _ARCH_ARGS:
        _set_arg(name)
    for name in _PATH_ARGS:
        _set_arg(name, force=False)
    if hasattr(args, "disable_bias_linear") and args.add_bias_linear is not None:
        args.disable_bias_linear = not args.add_bias_linear
