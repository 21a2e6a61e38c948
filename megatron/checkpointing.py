"""Save and load checkpoints in Megatron's legacy (`--ckpt-format torch`) layout.

    <save>/
      latest_checkpointed_iteration.txt   str(iteration) with no newline, or "release"
      iter_0000010/                       'iter_{:07d}', or 'release/' for release checkpoints
        mp_rank_00/model_optim_rng.pt     TP rank 00 (PP = 1, EP = 1)
        mp_rank_01_003/...                TP 01, PP 003 when PP > 1; '_{ep:03d}' added when EP > 1
        mp_rank_00/distrib_optim.pt       --use-distributed-optimizer: the fp32 main params and Adam
                                          moments of every parameter of this (TP, PP) rank, gathered
                                          from the data-parallel shards and stored unpadded, so a run
                                          may resume at another data-parallel size

`model_optim_rng.pt` is one torch.save'd dict:

    key                                   content
    args                                  the run's argparse.Namespace (holds consumed_*_samples)
    checkpoint_version                    3.0 (fused QKV rows in [np, 3, hn] order)
    iteration                             int (very old files: 'total_iters')
    model | model0, model1, ...           the unwrapped model's state dict, one per model chunk
    optimizer                             absent with --no-save-optim
    opt_param_scheduler                   absent with --no-save-optim (very old: 'lr_scheduler')
    rng_state                             [ {random_rng_state, np_rng_state, torch_rng_state,
                                             cuda_rng_state, rng_tracker_states} ], absent with
                                          --no-save-rng (very old files: those keys at top level)
    num_floating_point_operations_so_far  float

Every file is written to a temporary name in its final directory and renamed into place, and
the tracker is written (by rank 0, after a barrier) only once the model files are complete, so
a crash at any point leaves the previous checkpoint loadable and the tracker naming it.
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megatron.core import communication, device, parallel_state, tensor_parallel
from megatron.core.atomic_io import atomic_write

# The saved args are an argparse.Namespace; PyTorch >= 2.6 refuses it under weights_only=True
# unless allow-listed. Megatron allow-lists it and still loads with weights_only=False, because
# checkpoints also hold numpy RNG state and optimizer objects.
torch.serialization.add_safe_globals([argparse.Namespace])

_CHECKPOINT_VERSION = 3.0
_TRACKER_NAME = "latest_checkpointed_iteration.txt"
_MODEL_FILE_NAME = "model_optim_rng.pt"

# Model-shape args compared on load and taken from the checkpoint by --use-checkpoint-args:
# (attribute, how to name it in an error message).
_SHAPE_ARGS: Tuple[Tuple[str, str], ...] = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("kv_channels", "--kv-channels"),
    ("max_position_embeddings", "--max-position-embeddings"),
    ("padded_vocab_size", "padded vocab size (tokenizer vocab and --make-vocab-size-divisible-by)"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("add_bias_linear", "--disable-bias-linear"),
)
# Also taken from the checkpoint by load_args_from_checkpoint, but not compared on load.
_ARCH_ARGS: Tuple[str, ...] = (
    "position_embedding_type", "layernorm_epsilon", "norm_epsilon",
    "apply_residual_connection_post_layernorm", "openai_gelu", "tokenizer_type",
    "make_vocab_size_divisible_by", "seq_length",
)
# Paths from the machine that saved the checkpoint: used only when this run gives none.
_PATH_ARGS: Tuple[str, ...] = ("vocab_file", "merge_file", "tokenizer_model")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or does not fit this run; the message names the path."""


def _print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _flag(args: argparse.Namespace, name: str) -> bool:
    return bool(getattr(args, name, False))


def ensure_directory_exists(filename: str, check_parent: bool = True) -> None:
    """Create the directory holding `filename` (or `filename` itself when check_parent=False)."""
    dirname = os.path.dirname(filename) if check_parent else filename
    os.makedirs(dirname, exist_ok=True)


def get_checkpoint_name(checkpoints_path: str, iteration: int, release: bool = False,
                        pipeline_parallel: Optional[bool] = None, tensor_rank: Optional[int] = None,
                        pipeline_rank: Optional[int] = None, expert_parallel: Optional[bool] = None,
                        expert_rank: Optional[int] = None, return_base_dir: bool = False,
                        basename: str = _MODEL_FILE_NAME) -> str:
    """Path of this rank's checkpoint file, e.g. <path>/iter_0000010/mp_rank_00/model_optim_rng.pt.

    Ranks and whether PP/EP are in use default to this process's parallel_state.
    return_base_dir=True gives the iteration directory (<path>/iter_0000010) instead.
    """
    directory = "release" if release else "iter_{:07d}".format(iteration)
    if return_base_dir:
        return os.path.join(checkpoints_path, directory)
    if pipeline_parallel is None:
        pipeline_parallel = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if tensor_rank is None:
        tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    if pipeline_rank is None:
        pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    if expert_parallel is None:
        expert_parallel = parallel_state.get_expert_model_parallel_world_size() > 1
    if expert_rank is None:
        expert_rank = parallel_state.get_expert_model_parallel_rank()
    rank_dir = f"mp_rank_{tensor_rank:02d}"
    if pipeline_parallel:
        rank_dir += f"_{pipeline_rank:03d}"
    if expert_parallel:
        rank_dir += f"_{expert_rank:03d}"
    return os.path.join(checkpoints_path, directory, rank_dir, basename)


def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
    """The tracker file naming the latest complete checkpoint under `checkpoints_path`."""
    return os.path.join(checkpoints_path, _TRACKER_NAME)


def checkpoint_exists(checkpoints_path: Optional[str]) -> bool:
    """True when `checkpoints_path` holds a tracker file (i.e. a run saved there)."""
    if checkpoints_path is None:
        return False
    return os.path.isfile(get_checkpoint_tracker_filename(checkpoints_path))


def read_metadata(tracker_filename: str) -> Tuple[int, bool]:
    """Parse the tracker: (iteration, release). The iteration is the MAX over ranks when
    distributed is initialised, so every rank loads the same checkpoint."""
    with open(tracker_filename, "r") as f:
        text = f.read().strip()
    release = False
    try:
        iteration = int(text)
    except ValueError:
        release = text == "release"
        if not release:
            raise CheckpointError(
                f"invalid checkpoint tracker file {tracker_filename}: expected an iteration "
                f"number or 'release', found {text[:40]!r}") from None
        iteration = 0
    if iteration <= 0 and not release:
        raise CheckpointError(f"invalid checkpoint tracker file {tracker_filename}: iteration "
                              f"{iteration} must be > 0 (or the file must say 'release')")
    if dist.is_initialized():
        on = torch.device("cpu") if dist.get_backend() == "gloo" else device.get_device()
        iters = torch.tensor([iteration], dtype=torch.long, device=on)
        communication.all_reduce(iters, op=dist.ReduceOp.MAX)  # [1]
        max_iter = int(iters[0].item())
        if max_iter != iteration:
            print(f"WARNING: on rank {dist.get_rank()} found iteration {iteration} in the tracker "
                  f"{tracker_filename} but the maximum over ranks is {max_iter}", flush=True)
        iteration = max_iter
    return iteration, release


def find_checkpoint_rank_0(checkpoints_path: str, iteration: int,
                           release: bool = False) -> Optional[str]:
    """The rank-0 file of a checkpoint whose parallel layout is unknown (tries the four
    mp_rank_* namings, with/without PP and EP), or None when there is none."""
    for pipeline_parallel in (False, True):
        for expert_parallel in (False, True):
            filename = get_checkpoint_name(checkpoints_path, iteration, release,
                                           pipeline_parallel=pipeline_parallel, tensor_rank=0,
                                           pipeline_rank=0, expert_parallel=expert_parallel,
                                           expert_rank=0)
            if os.path.isfile(filename):
                return filename
    return None


def _unwrap(module: nn.Module) -> nn.Module:
    """Strip Float16Module / DDP-style wrappers by following `.module`."""
    while isinstance(getattr(module, "module", None), nn.Module):
        module = module.module
    return module


def _as_chunks(model: Union[nn.Module, Sequence[nn.Module]]) -> List[nn.Module]:
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    return [_unwrap(chunk) for chunk in chunks]


def get_rng_state() -> List[Dict[str, Any]]:
    """This process's RNG states in Megatron's format (a one-element list)."""
    return [{
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": device.get_rng_state(),  # None on CPU
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }]


def generate_state_dict(args: argparse.Namespace, model: Sequence[nn.Module], optimizer: Any,
                        opt_param_scheduler: Any, rng_state: Optional[List[Dict[str, Any]]],
                        iteration: int,
                        num_floating_point_operations_so_far: float = 0.0) -> Dict[str, Any]:
    """The dict saved as model_optim_rng.pt (see the module docstring for its keys)."""
    state_dict: Dict[str, Any] = {
        "args": args,
        "checkpoint_version": _CHECKPOINT_VERSION,
        "iteration": iteration,
    }
    chunks = _as_chunks(model)
    for i, chunk in enumerate(chunks):
        save_fn = getattr(chunk, "state_dict_for_save_checkpoint", chunk.state_dict)
        state_dict["model" if len(chunks) == 1 else f"model{i}"] = save_fn()
    if not _flag(args, "no_save_optim"):
        if optimizer is not None:
            state_dict["optimizer"] = optimizer.state_dict()
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_state is not None and not _flag(args, "no_save_rng"):
        state_dict["rng_state"] = rng_state
    state_dict["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
    return state_dict


def save_checkpoint(iteration: int, model: Sequence[nn.Module], optimizer: Any,
                    opt_param_scheduler: Any, args: argparse.Namespace,
                    num_floating_point_operations_so_far: float = 0.0) -> None:
    """Save model, optimizer, scheduler and RNG state to args.save at `iteration`, then point
    the tracker at it. Data-parallel rank 0 writes this (tp, pp, ep) coordinate's file."""
    save_dir = getattr(args, "save", None)
    if not save_dir:
        raise CheckpointError("save_checkpoint needs a checkpoint directory (--save)")
    if iteration <= 0:
        raise CheckpointError(f"cannot save iteration {iteration} to {save_dir}: the tracker file "
                              "must name an iteration > 0")
    _print_rank_0("saving checkpoint at iteration {:7d} to {}".format(iteration, save_dir))
    rng_state = get_rng_state()
    checkpoint_name = get_checkpoint_name(save_dir, iteration)
    if not dist.is_initialized() or parallel_state.get_data_parallel_rank() == 0:
        ensure_directory_exists(checkpoint_name)
        state_dict = generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state,
                                         iteration, num_floating_point_operations_so_far)
        atomic_write(checkpoint_name, lambda f: torch.save(state_dict, f))
    if getattr(optimizer, "save_parameter_state", None) is not None and not _flag(args, "no_save_optim"):
        # Distributed optimizer: its shards are gathered (a collective over the data-parallel
        # group) and DP rank 0 writes them, unpadded per parameter, next to the model file.
        ensure_directory_exists(checkpoint_name)
        optimizer.save_parameter_state(get_distributed_optimizer_checkpoint_name(checkpoint_name))
    _barrier()  # every rank's file is complete before the tracker names it
    if not dist.is_initialized() or dist.get_rank() == 0:
        tracker = get_checkpoint_tracker_filename(save_dir)
        atomic_write(tracker, lambda f: f.write(str(iteration).encode("ascii")))
    _barrier()
    _print_rank_0("  successfully saved checkpoint from iteration {:7d} to {}".format(
        iteration, save_dir))


def _load_base_checkpoint(load_dir: str, rank0: bool = False,
                          args: Optional[argparse.Namespace] = None
                          ) -> Tuple[Optional[Dict[str, Any]], str, bool]:
    """(state_dict, checkpoint file, release); state_dict is None when there is no tracker.
    rank0=True reads the rank-0 file whatever the layout (for args, before parallel init).
    With `args`, a missing file of a checkpoint saved at other parallel sizes is refused
    naming the flag that differs."""
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        _print_rank_0("WARNING: could not find the metadata file {} ".format(tracker))
        _print_rank_0("    will not load any checkpoints and will start from random")
        return None, "", False
    iteration, release = read_metadata(tracker)
    name = get_checkpoint_name(load_dir, iteration, release)
    if rank0:
        name = find_checkpoint_rank_0(load_dir, iteration, release) or name
    what = "release" if release else f"iteration {iteration}"
    if not os.path.isfile(name):
        base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
        if os.path.isfile(os.path.join(base_dir, "metadata.json")):
            raise CheckpointError(f"{base_dir} is a distributed (torch_dist) checkpoint; only "
                                  "--ckpt-format torch is supported yet")
        base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
        saved = sorted(d for d in os.listdir(base_dir) if d.startswith("mp_rank_")) if os.path.isdir(base_dir) else []
        if saved:
            _refuse_other_layout(load_dir, iteration, release, args)
            raise CheckpointError(
                f"{base_dir} has no file for this rank ({os.path.relpath(name, base_dir)}): it holds {', '.join(saved)}, "
                f"but this run has tensor-parallel size {parallel_state.get_tensor_model_parallel_world_size()} and "
                f"pipeline-parallel size {parallel_state.get_pipeline_model_parallel_world_size()}; a legacy checkpoint "
                "loads only at the sizes it was saved with")
        raise CheckpointError(f"tracker file {tracker} names {what} but the checkpoint file "
                              f"{name} does not exist")
    _print_rank_0(f" loading checkpoint from {load_dir} at iteration {iteration}")
    try:
        state_dict = torch.load(name, map_location="cpu", weights_only=False)
    except Exception as error:
        raise CheckpointError(f"cannot read checkpoint file {name}: {error}") from error
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"checkpoint file {name} does not hold a dict "
                              f"(found {type(state_dict).__name__})")
    return state_dict, name, release


def _refuse_other_layout(load_dir: str, iteration: int, release: bool,
                         args: Optional[argparse.Namespace]) -> None:
    # This rank's file is missing (e.g. a PP=2 checkpoint has mp_rank_00_000, a PP=1 run looks
    # for mp_rank_00): read the saved args from the rank-0 file so the error names the flag.
    rank0_name = find_checkpoint_rank_0(load_dir, iteration, release)
    if args is None or rank0_name is None:
        return
    try:
        checkpoint_args = torch.load(rank0_name, map_location="cpu", weights_only=False).get("args")
    except Exception:  # unreadable: the caller's message about the missing file still stands
        return
    if checkpoint_args is not None:
        check_parallel_layout(checkpoint_args, args, rank0_name)


def _handle_missing(args: argparse.Namespace, load_dir: Optional[str]) -> None:
    if _flag(args, "exit_on_missing_checkpoint"):
        if load_dir is None:
            raise CheckpointError("--exit-on-missing-checkpoint is set but no checkpoint "
                                  "directory (--load) was given")
        raise CheckpointError(f"--exit-on-missing-checkpoint is set but no checkpoint was found "
                              f"in {load_dir} (no {_TRACKER_NAME})")


def _describe(attr: str, label: str, value: Any) -> str:
    if attr == "add_bias_linear":
        return label if not value else f"no {label}"
    if attr == "untie_embeddings_and_output_weights":
        return label if value else f"no {label}"
    return f"{label} {value}"


def check_checkpoint_args(checkpoint_args: argparse.Namespace, args: argparse.Namespace,
                          checkpoint_name: str) -> None:
    """Raise CheckpointError naming every model-shape flag where the checkpoint differs from
    this run (values that either side leaves unset are not compared)."""
    problems = []
    for attr, label in _SHAPE_ARGS:
        saved, current = getattr(checkpoint_args, attr, None), getattr(args, attr, None)
        if saved is None or current is None or saved == current:
            continue
        problems.append(f"checkpoint at {checkpoint_name} was saved with "
                        f"{_describe(attr, label, saved)} but this run has "
                        f"{_describe(attr, label, current)}")
    if problems:
        raise CheckpointError("; ".join(problems)
                              + " (use --use-checkpoint-args to take the checkpoint's)")


def check_parallel_layout(checkpoint_args: argparse.Namespace, args: argparse.Namespace,
                          checkpoint_name: str) -> None:
    """Raise CheckpointError when the checkpoint was saved at other tensor/pipeline sizes.

    Each file holds one rank's shards; loading it at another layout would mis-assign rows.
    (The padded vocabulary also depends on the TP size, so this check comes first, with the
    message that says what actually differs.)
    """
    # (virtual_pipeline_model_parallel_size is derived from either virtual-stage flag; None means
    # no interleaving, and the message then says "no --num-virtual-stages-per-pipeline-rank")
    for attr, label, default in (("tensor_model_parallel_size", "--tensor-model-parallel-size", 1),
                                 ("pipeline_model_parallel_size", "--pipeline-model-parallel-size", 1),
                                 ("virtual_pipeline_model_parallel_size", "--num-virtual-stages-per-pipeline-rank",
                                  None)):
        saved, current = getattr(checkpoint_args, attr, default), getattr(args, attr, default)
        if saved != current:
            saved_text = f"no {label}" if saved is None else f"{label} {saved}"
            current_text = f"no {label}" if current is None else f"{label} {current}"
            raise CheckpointError(f"checkpoint at {checkpoint_name} was saved with {saved_text} but this run "
                                  f"has {current_text}; a legacy checkpoint loads only at the tensor/pipeline "
                                  "sizes it was saved with (resharding is the checkpoint converter's job)")


def _check_qkv_version(state_dict: Dict[str, Any], checkpoint_name: str) -> None:
    # Before version 2.0 fused QKV rows were [3, np, hn] or [np, hn, 3]; loading them as
    # [np, 3, hn] would silently scramble attention, so refuse instead.
    version = state_dict.get("checkpoint_version", 0)
    if version >= 2.0:
        return
    model_keys = [k for key, sd in state_dict.items() if key.startswith("model")
                  and isinstance(sd, dict) for k in sd]
    if any("qkv" in k or "query_key_value" in k or "key_value" in k for k in model_keys):
        raise CheckpointError(f"checkpoint {checkpoint_name} has checkpoint_version {version}, "
                              "whose fused QKV layout is not [np, 3, hn]; convert it first")


def _load_model(chunks: List[nn.Module], state_dict: Dict[str, Any], checkpoint_name: str,
                strict: bool) -> None:
    for i, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{i}"
        if key not in state_dict:
            raise CheckpointError(f"checkpoint {checkpoint_name} has no '{key}' entry "
                                  f"(this run has {len(chunks)} model chunk(s))")
        saved, current = state_dict[key], chunk.state_dict()
        wrong = [f"{name} is {list(tensor.shape)} in the checkpoint but "
                 f"{list(current[name].shape)} in the model"
                 for name, tensor in saved.items()
                 if torch.is_tensor(tensor) and name in current
                 and torch.is_tensor(current[name]) and tensor.shape != current[name].shape]
        if wrong:
            raise CheckpointError(f"checkpoint {checkpoint_name} does not fit the model: "
                                  + "; ".join(wrong))
        try:
            chunk.load_state_dict(saved, strict=strict)
        except RuntimeError as error:
            raise CheckpointError(
                f"cannot load the model from {checkpoint_name}: {error}") from error


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name: str) -> str:
    """distrib_optim.pt, next to model_optim_rng.pt (Megatron's name)."""
    return os.path.join(os.path.dirname(model_checkpoint_name), "distrib_optim.pt")


def _load_optimizer(optimizer: Any, opt_param_scheduler: Any, state_dict: Dict[str, Any],
                    checkpoint_name: str) -> None:
    if optimizer is not None:
        if "optimizer" not in state_dict:
            raise CheckpointError(f"checkpoint {checkpoint_name} has no optimizer state (saved "
                                  "with --no-save-optim?); pass --no-load-optim or --finetune")
        saved_args = state_dict.get("args")
        saved_dist = bool(getattr(saved_args, "use_distributed_optimizer", False))
        current_dist = getattr(optimizer, "load_parameter_state", None) is not None
        if saved_args is not None and saved_dist != current_dist:
            raise CheckpointError(
                f"checkpoint {checkpoint_name} was saved {'with' if saved_dist else 'without'} "
                f"--use-distributed-optimizer but this run is {'with' if current_dist else 'without'} it; "
                "the optimizer states are laid out differently (pass --no-load-optim to start a fresh optimizer)")
        optimizer.load_state_dict(state_dict["optimizer"])
        if current_dist:
            path = get_distributed_optimizer_checkpoint_name(checkpoint_name)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path} is missing: the distributed optimizer's parameter state "
                                      "(pass --no-load-optim to start a fresh optimizer)")
            # collective: DP rank 0 reads the unpadded state and scatters it to the current DP layout
            optimizer.load_parameter_state(path)
    if opt_param_scheduler is not None:
        # 'lr_scheduler' is the name very old checkpoints used
        key = "lr_scheduler" if "lr_scheduler" in state_dict else "opt_param_scheduler"
        if key not in state_dict:
            raise CheckpointError(f"checkpoint {checkpoint_name} has no opt_param_scheduler "
                                  "state (saved with --no-save-optim?); pass --no-load-optim or "
                                  "--finetune")
        opt_param_scheduler.load_state_dict(state_dict[key])


def _load_rng(state_dict: Dict[str, Any], checkpoint_name: str) -> None:
    if "rng_state" in state_dict:
        rng_state = state_dict["rng_state"][0]
    else:
        rng_state = state_dict  # very old checkpoints kept the states at the top level
    needed = ("random_rng_state", "np_rng_state", "torch_rng_state")
    missing = [key for key in needed if key not in rng_state]
    if missing:
        raise CheckpointError(f"checkpoint {checkpoint_name} has no RNG state "
                              f"({', '.join(missing)} missing; saved with --no-save-rng?); "
                              "pass --no-load-rng or "
                              "--finetune to skip restoring it")
    random.setstate(rng_state["random_rng_state"])
    np.random.set_state(rng_state["np_rng_state"])
    torch.set_rng_state(rng_state["torch_rng_state"])
    device.set_rng_state(rng_state.get("cuda_rng_state"))
    tracker_states = rng_state.get("rng_tracker_states")
    if tracker_states:
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker_states)


def _read_iteration(state_dict: Dict[str, Any], checkpoint_name: str) -> int:
    for key in ("iteration", "total_iters"):  # 'total_iters' in very old checkpoints
        if key in state_dict:
            return int(state_dict[key])
    raise CheckpointError(f"checkpoint {checkpoint_name} has neither 'iteration' nor "
                          "'total_iters'")


def load_checkpoint(model: Sequence[nn.Module], optimizer: Any, opt_param_scheduler: Any,
                    args: argparse.Namespace, load_arg: str = "load",
                    strict: bool = True) -> Tuple[int, float]:
    """Load the checkpoint the tracker in getattr(args, load_arg) names.

    Returns (iteration, num_floating_point_operations_so_far); (0, 0) with a warning when there
    is no checkpoint. Release checkpoints and --finetune start at iteration 0 without optimizer,
    scheduler or RNG state. Sets args.consumed_{train,valid}_samples and skipped_train_samples
    from the checkpoint's args (except with --finetune); the caller updates the micro-batch
    calculator from them.
    """
    load_dir = getattr(args, load_arg, None)
    if load_dir is None:
        _handle_missing(args, load_dir)
        return 0, 0
    state_dict, checkpoint_name, release = _load_base_checkpoint(load_dir, args=args)
    if state_dict is None:
        _handle_missing(args, load_dir)
        return 0, 0
    finetune = _flag(args, "finetune")
    checkpoint_args = state_dict.get("args")
    if checkpoint_args is not None:
        check_parallel_layout(checkpoint_args, args, checkpoint_name)
        check_checkpoint_args(checkpoint_args, args, checkpoint_name)
    _check_qkv_version(state_dict, checkpoint_name)
    _load_model(_as_chunks(model), state_dict, checkpoint_name, strict)

    iteration = 0 if (finetune or release) else _read_iteration(state_dict, checkpoint_name)
    if checkpoint_args is not None and not finetune:
        for name in ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples"):
            setattr(args, name, getattr(checkpoint_args, name, 0))
    elif checkpoint_args is None:
        _print_rank_0("could not find arguments in the checkpoint ...")

    if not release and not finetune and not _flag(args, "no_load_optim"):
        _load_optimizer(optimizer, opt_param_scheduler, state_dict, checkpoint_name)
    elif (_flag(args, "fp16") or _flag(args, "bf16")) and optimizer is not None:
        # fresh optimizer: its fp32 main params must follow the weights just loaded
        reload = getattr(optimizer, "reload_model_params", None)
        if reload is not None:
            reload()
    if not release and not finetune and not _flag(args, "no_load_rng"):
        _load_rng(state_dict, checkpoint_name)

    _barrier()
    _print_rank_0(f"  successfully loaded checkpoint from {load_dir} "
                  f"[ t {parallel_state.get_tensor_model_parallel_rank() + 1}/"
                  f"{parallel_state.get_tensor_model_parallel_world_size()}, "
                  f"p {parallel_state.get_pipeline_model_parallel_rank() + 1}/"
                  f"{parallel_state.get_pipeline_model_parallel_world_size()} ] "
                  f"at iteration {iteration}")
    return iteration, float(state_dict.get("num_floating_point_operations_so_far", 0))


def load_args_from_checkpoint(args: argparse.Namespace,
                              load_arg: str = "load") -> argparse.Namespace:
    """--use-checkpoint-args: overwrite the model-shape args with the checkpoint's (printing each
    one that changes); tokenizer paths are taken only when this run gives none. Call it before
    validate_args. Without a checkpoint the args are returned unchanged (or, with
    --exit-on-missing-checkpoint, CheckpointError)."""
    load_dir = getattr(args, load_arg, None)
    if load_dir is None:
        _print_rank_0("No load directory specified, using provided arguments.")
        return args
    state_dict, checkpoint_name, release = _load_base_checkpoint(load_dir, rank0=True)
    if state_dict is None:
        _handle_missing(args, load_dir)
        _print_rank_0("Checkpoint not found to provide arguments, using provided arguments.")
        return args
    checkpoint_args = state_dict.get("args")
    if checkpoint_args is None:
        _print_rank_0("Checkpoint provided does not have arguments saved, "
                      "using provided arguments.")
        return args
    if hasattr(checkpoint_args, "disable_bias_linear"):  # older files stored the flag itself
        checkpoint_args.add_bias_linear = not checkpoint_args.disable_bias_linear
    args.iteration = 0 if release else state_dict.get("iteration", state_dict.get("total_iters", 0))

    def _set_arg(name: str, force: bool = True) -> None:
        if not hasattr(checkpoint_args, name):
            return
        value, current = getattr(checkpoint_args, name), getattr(args, name, None)
        if (not force and current is not None) or value == current:
            return
        _print_rank_0(f"  overriding {name} = {current} with {value} from the checkpoint "
                      f"{checkpoint_name}")
        setattr(args, name, value)

    for name, _ in _SHAPE_ARGS:
        _set_arg(name)
    for name in _ARCH_ARGS:
        _set_arg(name)
    for name in _PATH_ARGS:
        _set_arg(name, force=False)
    if hasattr(args, "disable_bias_linear") and getattr(args, "add_bias_linear", None) is not None:
        args.disable_bias_linear = not args.add_bias_linear
    return args


__all__ = [
    "CheckpointError", "checkpoint_exists", "check_checkpoint_args", "ensure_directory_exists",
    "find_checkpoint_rank_0", "generate_state_dict", "get_checkpoint_name",
    "get_checkpoint_tracker_filename", "get_rng_state", "check_parallel_layout", "load_args_from_checkpoint",
    "load_checkpoint", "read_metadata", "save_checkpoint",
]
