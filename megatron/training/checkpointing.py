"""Save and load checkpoints in Megatron's legacy (`--ckpt-format torch`) layout.

    <save>/
      latest_checkpointed_iteration.txt   str(iteration) with no newline, or "release"
      iter_0000010/                       'iter_{:07d}', or 'release/' for release checkpoints
        mp_rank_00/model_optim_rng.pt     TP rank 00 (PP = 1, EP = 1)
        mp_rank_01_003/...                TP 01, PP 003 when PP > 1; '_{ep:03d}' added when EP > 1
                                          (that expert rank's experts, numbered locally, written by
                                          expert-data-parallel rank 0; loads only at the same EP/ETP)
        mp_rank_00/distrib_optim.pt       --use-distributed-optimizer: the fp32 main params and Adam
                                          moments of every parameter of this (TP, PP) rank, gathered
                                          from the data-parallel shards and stored unpadded, so a run
                                          may resume at another data-parallel size
        checksums.json                    size and sha256 of every file of the iteration
                                          (megatron/training/checkpoint_manifest.py), verified on load

`model_optim_rng.pt` is one torch.save'd dict:

    key                                   content
    args                                  the run's argparse.Namespace (holds consumed_*_samples)
    checkpoint_version                    3.0 (fused QKV rows in [np, 3, hn] order)
    iteration                             int (very old files: 'total_iters')
    model | model0, model1, ...           the unwrapped model's state dict, one per model chunk
    optimizer                             absent with --no-save-optim
    opt_param_scheduler                   absent with --no-save-optim (very old: 'lr_scheduler')
    rng_state                             [ {random_rng_state, np_rng_state, torch_rng_state,
                                             cuda_rng_state, rng_tracker_states, and on CPU
                                             cpu_rng_tracker_states} ], absent with --no-save-rng
                                          (very old files: those keys at top level)
    num_floating_point_operations_so_far  float
    rerun_state_machine                   Megatron-LM core_v0.13's (read and ignored; not written)

Every file is written to a temporary name in its final directory and renamed into place (the
temporaries a killed save left in a folder are removed by the next save there), and the
manifest and then the tracker are written (by rank 0, once every rank reported its files
complete), so a crash at any point leaves the previous checkpoint loadable and the tracker
naming it. A failed write is reported on every rank with the file, the errno and the
checkpoint that is still intact (megatron/training/checkpoint_writes.py). Files are read with the
allow-list unpickler of megatron/training/checkpoint_safety.py; the RNG entry is described in
megatron/training/checkpoint_rng.py, the checks of a checkpoint against this run in checkpoint_fit.py.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron.training.checkpoint_fit import (
    apply_checkpoint_args, check_checkpoint_args, check_parallel_layout, load_model_chunks,
)
from megatron.training.checkpoint_manifest import manifest_path, verify_file, write_manifest
from megatron.training.checkpoint_rng import get_rng_state, set_rng_state
from megatron.training.checkpoint_safety import CheckpointError, load_file
from megatron.training.checkpoint_writes import (
    Failure, attempt, broadcast_from_rank_0, describe_write_error, gather_results, local_error,
)
from megatron.core import communication, device, parallel_state
from megatron.core.atomic_io import Checksum, atomic_write, remove_stale_temporaries
from megatron.training.utils import print_line

_CHECKPOINT_VERSION = 3.0
_TRACKER_NAME = "latest_checkpointed_iteration.txt"
_MODEL_FILE_NAME = "model_optim_rng.pt"


def _print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print_line(message)


def _barrier() -> None:
    if dist.is_initialized():
        communication.barrier()


def _flag(args: Optional[argparse.Namespace], name: str) -> bool:
    """A flag of the run's args; False without args (a file read before the run's args exist)."""
    return args is not None and bool(getattr(args, name))


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
    if iteration < 0:
        raise CheckpointError(f"invalid checkpoint tracker file {tracker_filename}: iteration "
                              f"{iteration} must be >= 0 (or the file must say 'release')")
    # 0 (iter_0000000): a starting checkpoint, as Accelerate's guide makes one from a converted
    # `release` (Megatron-LM asserts > 0); it loads like any other, from iteration 0.
    if dist.is_initialized():
        on = torch.device("cpu") if dist.get_backend() == "gloo" else device.get_device()
        iters = torch.tensor([iteration], dtype=torch.long, device=on)
        communication.all_reduce(iters, op=dist.ReduceOp.MAX)  # [1]
        max_iter = int(iters[0].item())
        if max_iter != iteration:
            print_line(f"WARNING: on rank {dist.get_rank()} found iteration {iteration} in the tracker "
                       f"{tracker_filename} but the maximum over ranks is {max_iter}")
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


def save_checkpoint(iteration: int, model: Sequence[nn.Module], optimizer: Any, opt_param_scheduler: Any,
                    num_floating_point_operations_so_far: float = 0.0, *,
                    args: Optional[argparse.Namespace] = None) -> None:
    """Save model, optimizer, scheduler and RNG state to args.save at `iteration`, then the
    checksum manifest, then point the tracker at it. Data-parallel rank 0 (expert-data-parallel
    rank 0 at EP > 1) writes this (tp, pp, ep) coordinate's file. A failed write raises
    CheckpointError on every rank, naming the file and the errno, with the tracker still naming
    the previous checkpoint.

    Megatron's call form (Accelerate's): the run's args are get_args() unless given by keyword."""
    args = _run_args(args, num_floating_point_operations_so_far, "save_checkpoint",
                     "num_floating_point_operations_so_far")
    from megatron.model.lora import state_dict_view
    from megatron.training.lora_pointer import lora_run, write_pointer

    if lora_run(_as_chunks(model)):
        # LoRA: the adapters alone, after the pointer to their base (megatron/training/checkpoint_lora.py)
        if args.save:
            write_pointer(args.save, args)
        with state_dict_view(_as_chunks(model), "adapters"):
            _save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                             args)
        return
    _save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far, args)


def _save_checkpoint(iteration: int, model: Sequence[nn.Module], optimizer: Any, opt_param_scheduler: Any,
                     num_floating_point_operations_so_far: float, args: argparse.Namespace) -> None:
    save_dir = args.save
    if not save_dir:
        raise CheckpointError("save_checkpoint needs a checkpoint directory (--save)")
    if iteration <= 0:
        raise CheckpointError(f"cannot save iteration {iteration} to {save_dir}: the tracker file "
                              "must name an iteration > 0")
    if args.ckpt_format == "torch_dist":
        from megatron import dist_checkpointing

        dist_checkpointing.save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args,
                                           num_floating_point_operations_so_far)
        return
    _print_rank_0("saving checkpoint at iteration {:7d} to {}".format(iteration, save_dir))
    rng_state = get_rng_state()
    checkpoint_name = get_checkpoint_name(save_dir, iteration)
    base_dir = get_checkpoint_name(save_dir, iteration, return_base_dir=True)
    _refuse_split_experts(args)
    writes_model = _writes_model_file()
    # Distributed optimizer: its shards are gathered (a collective over the data-parallel group)
    # and DP rank 0 writes them, unpadded per parameter, next to the model file.
    distributed = (getattr(optimizer, "save_parameter_state", None) is not None
                   and not _flag(args, "no_save_optim"))
    failure = _prepare_folders(save_dir, checkpoint_name, writes_model or distributed, writes_model)
    _barrier()  # no rank writes before the stale temporaries are gone
    files: Dict[str, Checksum] = {}
    if writes_model and failure is None:
        state_dict = generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state,
                                         iteration, num_floating_point_operations_so_far)
        failure = attempt(checkpoint_name, base_dir, files, lambda: atomic_write(
            checkpoint_name, lambda f: torch.save(state_dict, f), checksum=True))
    if distributed:  # every rank takes part in the gather, even after a failure
        optim_name = get_distributed_optimizer_checkpoint_name(checkpoint_name)
        optim_failure = attempt(optim_name, base_dir, files,
                                 lambda: optimizer.save_parameter_state(optim_name))
        failure = failure or optim_failure
    files, failures = gather_results(files, failure)  # also waits for every rank's files
    if not failures:
        failure = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            tracker = get_checkpoint_tracker_filename(save_dir)
            failure = (attempt(manifest_path(base_dir), base_dir, None,
                                lambda: write_manifest(base_dir, iteration, files))
                       or attempt(tracker, base_dir, None, lambda: atomic_write(
                           tracker, lambda f: f.write(str(iteration).encode("ascii")))))
        failures = broadcast_from_rank_0(failure)
    if failures:
        raise CheckpointError(f"checkpoint of iteration {iteration} was not saved: "
                              f"{'; '.join(message for message, _ in failures)}; "
                              f"{_intact_note(save_dir)}") from local_error(failures)
    _print_rank_0("  successfully saved checkpoint from iteration {:7d} to {}".format(
        iteration, save_dir))


def _run_args(args: Optional[argparse.Namespace], positional: Any, function: str,
              parameter: str) -> argparse.Namespace:
    """The args a save or load runs with: those given, else get_args(). A Namespace in Megatron's
    positional slot is the older call form of this project, refused with the fix."""
    if isinstance(positional, argparse.Namespace):
        raise TypeError(f"{function}: the run's args go by keyword (args=...); the positional parameter "
                        f"there is Megatron's {parameter}")
    if args is not None:
        return args
    from megatron.training.global_vars import get_args

    return get_args()


def _writes_model_file() -> bool:
    """Whether this rank writes its mp_rank_* folder's model file: data-parallel rank 0 (one per
    tensor/pipeline rank), or under expert parallelism expert-data-parallel rank 0 (Megatron's
    rule: the dense data-parallel group then spans expert ranks holding different experts, and
    the ranks that share a tensor, pipeline and expert rank form one expert-data-parallel group)."""
    if not dist.is_initialized():
        return True
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        return parallel_state.get_expert_data_parallel_rank() == 0
    # The CP ranks of a data-parallel rank hold the same weights: the first of them writes.
    return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0


def _refuse_split_experts(args: argparse.Namespace) -> None:
    """A folder is named by tensor, pipeline and expert rank only: experts split over an expert
    tensor-parallel size other than the tensor-parallel one have no file of their own."""
    if not parallel_state.model_parallel_is_initialized():
        return
    tp, etp = (parallel_state.get_tensor_model_parallel_world_size(),
               parallel_state.get_expert_tensor_parallel_world_size())
    if etp == tp:
        return
    if args.num_experts is not None:  # (args, not this stage's layers: every rank refuses)
        raise CheckpointError(f"--ckpt-format torch keeps one file per tensor/pipeline/expert rank and cannot hold "
                              f"experts split over --expert-tensor-parallel-size {etp} while "
                              f"--tensor-model-parallel-size is {tp}: save with --ckpt-format torch_dist")


def _prepare_folders(save_dir: str, checkpoint_name: str, makes_folder: bool,
                     writes_model: bool) -> Optional[Failure]:
    """Create this rank's folder and remove the temporaries a killed save left there (each
    file's writer does it for its files; a barrier follows before anything is written)."""
    path = os.path.dirname(checkpoint_name)
    try:
        if makes_folder:
            ensure_directory_exists(checkpoint_name)
        stale = []
        if writes_model:
            stale += [checkpoint_name, get_distributed_optimizer_checkpoint_name(checkpoint_name)]
        if not dist.is_initialized() or dist.get_rank() == 0:
            base_dir = os.path.dirname(os.path.dirname(checkpoint_name))
            stale += [get_checkpoint_tracker_filename(save_dir), manifest_path(base_dir)]
        for path in stale:
            remove_stale_temporaries(path)
    except OSError as error:
        return describe_write_error(path, error), error
    return None


def _intact_note(save_dir: str) -> str:
    tracker = get_checkpoint_tracker_filename(save_dir)
    try:
        with open(tracker, "r") as f:
            text = f.read().strip()
    except OSError:
        return f"no earlier checkpoint was recorded in {save_dir} (there is no {_TRACKER_NAME})"
    named = "release" if text == "release" else f"iteration {text}"
    return f"the previous checkpoint is intact: {tracker} still names {named}"


def check_load_directory(load_dir: str, flag: str = "--load") -> None:
    """CheckpointError when `load_dir` exists but is not a directory (a checkpoint is a folder)."""
    if os.path.exists(load_dir) and not os.path.isdir(load_dir):
        raise CheckpointError(f"{flag} {load_dir} is a file, not a checkpoint directory (one holding "
                              f"{_TRACKER_NAME} and iter_*/ folders)")


def _load_base_checkpoint(load_dir: str, rank0: bool = False,
                          args: Optional[argparse.Namespace] = None, flag: str = "--load"
                          ) -> Tuple[Optional[Dict[str, Any]], str, bool]:
    """(state_dict, checkpoint file, release); state_dict is None when there is no tracker.
    rank0=True reads the rank-0 file whatever the layout (for args, before parallel init).
    With `args`, a missing file of a checkpoint saved at other parallel sizes is refused
    naming the flag that differs."""
    check_load_directory(load_dir, flag)
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        _print_rank_0("WARNING: could not find the metadata file {} ".format(tracker))
        _print_rank_0("    will not load any checkpoints and will start from random")
        return None, "", False
    iteration, release = read_metadata(tracker)
    name = get_checkpoint_name(load_dir, iteration, release)
    if rank0:
        name = find_checkpoint_rank_0(load_dir, iteration, release) or name
    if not os.path.isfile(name):
        raise _missing_file_error(load_dir, tracker, iteration, release, name, args)
    _print_rank_0(f" loading checkpoint from {load_dir} at iteration {iteration}")
    base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    state_dict = _read_checkpoint_file(name, base_dir, args)
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"checkpoint file {name} does not hold a dict "
                              f"(found {type(state_dict).__name__})")
    saved = state_dict.get("iteration", state_dict.get("total_iters"))
    if not release and isinstance(saved, int) and saved != iteration:
        raise CheckpointError(f"checkpoint file {name} holds iteration {saved}, but its folder "
                              f"{os.path.basename(base_dir)} and the tracker {tracker} say iteration "
                              f"{iteration}: the file belongs to another checkpoint")
    return state_dict, name, release


def _read_checkpoint_file(name: str, base_dir: str, args: Optional[argparse.Namespace]) -> Any:
    """Verify `name` against the iteration's manifest, then read it with the safe unpickler."""
    try:
        if not verify_file(name, base_dir):
            _print_rank_0(f"  {name} is not verified: {base_dir} has no checksums.json (saved by "
                          "Megatron-LM or before checksums were written)")
        return load_file(name, trust_pickles=_flag(args, "trust_checkpoint_pickles"),
                         log=_print_rank_0)
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(f"cannot read checkpoint file {name}: {error}") from error


def _missing_file_error(load_dir: str, tracker: str, iteration: int, release: bool, name: str,
                        args: Optional[argparse.Namespace]) -> CheckpointError:
    """Why this rank's file is not there: say what is missing, or which layout was saved."""
    what = "release" if release else f"iteration {iteration}"
    base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    if os.path.isfile(os.path.join(base_dir, "metadata.json")):
        return CheckpointError(f"{base_dir} is a distributed (torch_dist) checkpoint but this run has "
                               "--ckpt-format torch; pass --auto-detect-ckpt-format (or --ckpt-format "
                               "torch_dist) to load it")
    if os.path.isdir(name):
        return CheckpointError(f"checkpoint file {name} is a directory, not a file written by "
                               f"torch.save (the tracker {tracker} names {what})")
    rank_dir = os.path.dirname(name)
    if os.path.isdir(rank_dir):
        held = sorted(os.listdir(rank_dir))
        holds = "it holds " + ", ".join(held) if held else "it is empty"
        return CheckpointError(
            f"{rank_dir} has no {os.path.basename(name)} ({holds}): the save of {what} did not "
            f"finish writing it, or it was removed since; the tracker {tracker} names {what}")
    folders = sorted(os.listdir(base_dir)) if os.path.isdir(base_dir) else []
    saved = [d for d in folders if d.startswith("mp_rank_")
             and os.path.isfile(os.path.join(base_dir, d, _MODEL_FILE_NAME))]
    if saved:
        _refuse_other_layout(load_dir, iteration, release, args)
        return CheckpointError(
            f"{base_dir} has no file for this rank ({os.path.relpath(name, base_dir)}): it holds {', '.join(saved)}, "
            f"but this run has tensor-parallel size {parallel_state.get_tensor_model_parallel_world_size()} and "
            f"pipeline-parallel size {parallel_state.get_pipeline_model_parallel_world_size()}; a legacy checkpoint "
            "loads only at the sizes it was saved with")
    if folders:
        return CheckpointError(f"tracker file {tracker} names {what} but {base_dir} holds no "
                               f"{_MODEL_FILE_NAME} in any mp_rank_* folder (it holds {', '.join(folders)})")
    return CheckpointError(f"tracker file {tracker} names {what} but the checkpoint file "
                           f"{name} does not exist")


def _refuse_other_layout(load_dir: str, iteration: int, release: bool,
                         args: Optional[argparse.Namespace]) -> None:
    # This rank's file is missing (e.g. a PP=2 checkpoint has mp_rank_00_000, a PP=1 run looks
    # for mp_rank_00): read the saved args from the rank-0 file so the error names the flag.
    rank0_name = find_checkpoint_rank_0(load_dir, iteration, release)
    if args is None or rank0_name is None:
        return
    try:
        checkpoint_args = load_file(rank0_name, trust_pickles=_flag(args, "trust_checkpoint_pickles"),
                                    log=_print_rank_0).get("args")
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
                              "whose fused QKV layout is not [np, 3, hn]; convert it first "
                              "(tools/checkpoint/convert.py --loader legacy)")


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name: str) -> str:
    """distrib_optim.pt, next to model_optim_rng.pt (Megatron's name)."""
    return os.path.join(os.path.dirname(model_checkpoint_name), "distrib_optim.pt")


def _load_optimizer(optimizer: Any, opt_param_scheduler: Any, state_dict: Dict[str, Any],
                    checkpoint_name: str, args: argparse.Namespace) -> None:
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
            # collective: DP rank 0 reads (verified, allow-listed) the unpadded state and scatters
            # it to the current DP layout; a bad file raises on every rank
            base_dir = os.path.dirname(os.path.dirname(path))
            try:
                optimizer.load_parameter_state(
                    path, read=lambda name: _read_checkpoint_file(name, base_dir, args))
            except ValueError as error:
                raise CheckpointError(str(error)) from error
    if opt_param_scheduler is not None:
        # 'lr_scheduler' is the name very old checkpoints used
        key = "lr_scheduler" if "lr_scheduler" in state_dict else "opt_param_scheduler"
        if key not in state_dict:
            raise CheckpointError(f"checkpoint {checkpoint_name} has no opt_param_scheduler "
                                  "state (saved with --no-save-optim?); pass --no-load-optim or "
                                  "--finetune")
        opt_param_scheduler.load_state_dict(state_dict[key])


def _read_iteration(state_dict: Dict[str, Any], checkpoint_name: str) -> int:
    for key in ("iteration", "total_iters"):  # 'total_iters' in very old checkpoints
        if key in state_dict:
            return int(state_dict[key])
    raise CheckpointError(f"checkpoint {checkpoint_name} has neither 'iteration' nor "
                          "'total_iters'")


def load_checkpoint(model: Sequence[nn.Module], optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load",
                    strict: bool = True, *, args: Optional[argparse.Namespace] = None) -> Tuple[int, float]:
    """Load the checkpoint the tracker in getattr(args, load_arg) names (Megatron's call form; the
    run's args are get_args() unless given by keyword).

    Returns (iteration, num_floating_point_operations_so_far); (0, 0) with a warning when there
    is no checkpoint. Release checkpoints and --finetune start at iteration 0 without optimizer,
    scheduler or RNG state. Sets args.consumed_{train,valid}_samples and skipped_train_samples
    from the checkpoint's args (except with --finetune); the caller updates the micro-batch
    calculator from them.
    """
    args = _run_args(args, load_arg, "load_checkpoint", "load_arg")
    load_dir = getattr(args, load_arg)
    flag = "--" + load_arg.replace("_", "-")
    pretrained = args.pretrained_checkpoint if load_arg == "load" else None
    if pretrained is not None and not checkpoint_exists(load_dir):
        # Megatron's --pretrained-checkpoint: a run that saved nothing yet under --load starts
        # from the pretrained model (weights only, iteration 0); later runs resume from --load.
        _print_rank_0(f"no checkpoint under --load {load_dir}: finetuning from --pretrained-checkpoint {pretrained}")
        check_load_directory(pretrained, "--pretrained-checkpoint")
        if not checkpoint_exists(pretrained):
            raise CheckpointError(f"--pretrained-checkpoint {pretrained}: no checkpoint there (no {_TRACKER_NAME})")
        load_dir, flag = pretrained, "--pretrained-checkpoint"
        args.finetune = True
    if load_dir is None:
        _handle_missing(args, load_dir)
        return 0, 0
    found = _saved_format(load_dir, args, flag)
    if found is not None and found[0] == "torch_dist":
        from megatron import dist_checkpointing

        _, base_dir, iteration, release = found
        return dist_checkpointing.load_checkpoint(_as_chunks(model), optimizer, opt_param_scheduler, args,
                                                  load_dir, base_dir, iteration, release, strict)
    state_dict, checkpoint_name, release = _load_base_checkpoint(load_dir, args=args, flag=flag)
    if state_dict is None:
        _handle_missing(args, load_dir)
        return 0, 0
    finetune = _flag(args, "finetune")
    checkpoint_args = state_dict.get("args")
    if checkpoint_args is not None:
        check_parallel_layout(checkpoint_args, args, checkpoint_name)
        check_checkpoint_args(checkpoint_args, args, checkpoint_name)
    _check_qkv_version(state_dict, checkpoint_name)
    load_model_chunks(_as_chunks(model), state_dict, checkpoint_name, strict)

    iteration = 0 if (finetune or release) else _read_iteration(state_dict, checkpoint_name)
    if checkpoint_args is not None and not finetune:
        for name in ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples"):
            setattr(args, name, getattr(checkpoint_args, name, 0))
    elif checkpoint_args is None:
        _print_rank_0("could not find arguments in the checkpoint ...")

    if not release and not finetune and not _flag(args, "no_load_optim"):
        _load_optimizer(optimizer, opt_param_scheduler, state_dict, checkpoint_name, args)
    elif (_flag(args, "fp16") or _flag(args, "bf16")) and optimizer is not None:
        # fresh optimizer: its fp32 main params must follow the weights just loaded
        reload = getattr(optimizer, "reload_model_params", None)
        if reload is not None:
            reload()
    if not release and not finetune and not _flag(args, "no_load_rng"):
        if iteration == 0 and "rng_state" not in state_dict:
            _print_rank_0(f"  {checkpoint_name} (iteration 0, a starting checkpoint) has no RNG state: "
                          "the generators keep this run's seed")
        else:
            set_rng_state(state_dict, checkpoint_name, log=_print_rank_0)

    _barrier()
    _print_rank_0(f"  successfully loaded checkpoint from {load_dir} "
                  f"[ t {parallel_state.get_tensor_model_parallel_rank() + 1}/"
                  f"{parallel_state.get_tensor_model_parallel_world_size()}, "
                  f"p {parallel_state.get_pipeline_model_parallel_rank() + 1}/"
                  f"{parallel_state.get_pipeline_model_parallel_world_size()} ] "
                  f"at iteration {iteration}")
    return iteration, float(state_dict.get("num_floating_point_operations_so_far", 0))


def _saved_format(load_dir: str, args: argparse.Namespace, flag: str
                  ) -> Optional[Tuple[str, str, int, bool]]:
    """(format, iteration folder, iteration, release) of the checkpoint the tracker names, or None
    when there is no tracker. The format comes from the files (metadata.json: torch_dist); one
    that is not --ckpt-format's is refused unless --auto-detect-ckpt-format."""
    check_load_directory(load_dir, flag)
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        return None
    iteration, release = read_metadata(tracker)
    base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    from megatron import dist_checkpointing

    saved = "torch"
    if dist_checkpointing.is_dist_checkpoint(base_dir):
        saved = dist_checkpointing.sharded_backend(base_dir)
        if saved != "torch_dist":
            raise CheckpointError(f"{base_dir} is a distributed checkpoint with sharded backend {saved}, "
                                  "which this framework does not read (only torch_dist)")
    wanted = args.ckpt_format
    if saved != wanted and not _flag(args, "auto_detect_ckpt_format"):
        raise CheckpointError(f"{base_dir} is a {saved} checkpoint but this run has --ckpt-format {wanted}; "
                              "pass --auto-detect-ckpt-format to load either format (or --ckpt-format "
                              f"{saved})")
    return saved, base_dir, iteration, release


def load_args_from_checkpoint(args: argparse.Namespace,
                              load_arg: str = "load") -> argparse.Namespace:
    """--use-checkpoint-args: overwrite the model-shape args with the checkpoint's (printing each
    one that changes); tokenizer paths are taken only when this run gives none. Call it before
    validate_args. Without a checkpoint the args are returned unchanged (or, with
    --exit-on-missing-checkpoint, CheckpointError)."""
    load_dir = getattr(args, load_arg)
    if load_dir is None:
        _print_rank_0("No load directory specified, using provided arguments.")
        return args
    found = _saved_format(load_dir, args, "--" + load_arg.replace("_", "-"))
    if found is not None and found[0] == "torch_dist":
        from megatron import dist_checkpointing

        _, base_dir, iteration, release = found
        checkpoint_args, saved_iteration = dist_checkpointing.load_args(base_dir, args)
        if checkpoint_args is None:
            _print_rank_0("Checkpoint provided does not have arguments saved, using provided arguments.")
            return args
        args.iteration = 0 if release else saved_iteration
        apply_checkpoint_args(args, checkpoint_args, base_dir, log=_print_rank_0)
        return args
    state_dict, checkpoint_name, release = _load_base_checkpoint(
        load_dir, rank0=True, args=args, flag="--" + load_arg.replace("_", "-"))
    if state_dict is None:
        _handle_missing(args, load_dir)
        _print_rank_0("Checkpoint not found to provide arguments, using provided arguments.")
        return args
    checkpoint_args = state_dict.get("args")
    if checkpoint_args is None:
        _print_rank_0("Checkpoint provided does not have arguments saved, "
                      "using provided arguments.")
        return args
    args.iteration = 0 if release else state_dict.get("iteration", state_dict.get("total_iters", 0))
    apply_checkpoint_args(args, checkpoint_args, checkpoint_name, log=_print_rank_0)
    return args


__all__ = [
    "CheckpointError", "checkpoint_exists", "check_checkpoint_args", "check_load_directory",
    "ensure_directory_exists",
    "find_checkpoint_rank_0", "generate_state_dict", "get_checkpoint_name",
    "get_checkpoint_tracker_filename", "get_rng_state", "check_parallel_layout", "load_args_from_checkpoint",
    "load_checkpoint", "read_metadata", "save_checkpoint",
]


def benchmark_save_load(model: Any, optimizer: Any, opt_param_scheduler: Any, args: argparse.Namespace,
                        directory: str, ckpt_format: str = "torch_dist", async_save: bool = False,
                        iteration: int = 1) -> Dict[str, float]:
    """Time one save and one load of (model, optimizer, scheduler) in `ckpt_format` ('torch' or
    'torch_dist', async_save with torch_dist) under `directory` (for bench/checkpoint_io.py).

    Collective when distributed. Returns seconds: 'save' (until save_checkpoint returned: what
    training waits for), 'finalize' (until the tracker names it; equal to 'save' when synchronous),
    'load' (load_checkpoint into the same model and optimizer), and 'bytes' (the iteration folder).
    `args` is copied; its save/load/ckpt_format/async_save are set here.
    """
    from megatron import dist_checkpointing

    run = copy.copy(args)
    run.save = run.load = directory
    run.ckpt_format, run.async_save = ckpt_format, bool(async_save)
    run.auto_detect_ckpt_format = False
    for name in ("no_save_optim", "no_load_optim", "no_save_rng", "no_load_rng", "finetune"):
        setattr(run, name, getattr(run, name, False) or False)
    if dist.is_initialized():
        communication.barrier()
    start = time.perf_counter()
    save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args=run)
    saved = time.perf_counter()
    dist_checkpointing.maybe_finalize_async_save(blocking=True)
    finalized = time.perf_counter()
    load_checkpoint(model, optimizer, opt_param_scheduler, args=run)
    loaded = time.perf_counter()
    folder = dist_checkpointing.iteration_dir(directory, iteration)
    size = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)
    return {"save": saved - start, "finalize": finalized - start, "load": loaded - finalized, "bytes": float(size)}
