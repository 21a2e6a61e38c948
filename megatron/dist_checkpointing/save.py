"""torch_dist: saving, synchronous or --async-save, and its finalisation.

See megatron/dist_checkpointing/__init__.py for the layout and the rules.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from megatron.training.checkpoint_manifest import write_manifest
from megatron.training.checkpoint_safety import CheckpointError
from megatron.core import communication, parallel_state
from megatron.core.atomic_io import Checksum, atomic_write, file_checksum
from megatron.dist_checkpointing.common import (
    CHECKPOINT_VERSION, COMMON_FILE, DCP_METADATA, FORMAT, HOLD_ENV, LAYOUT_VERSION, METADATA_JSON,
    _CONTENT_FORMAT, _TRACKER_NAME, _print_rank_0, _rank, _world, iteration_dir, partial_dir,
)
from megatron.dist_checkpointing.layout import (
    GlobalTensor, TensorLayout, _entry_boxes, _expert_ranks, _inner, _optimizer_step, model_layouts, optimizer_entries,
    optimizer_kind,
)
from megatron.dist_checkpointing.dcp_io import _SavePlanner

# ============================================================================ save

def _state_to_save(model: Any, optimizer: Any, args: argparse.Namespace, rng_state: Any
                   ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the DCP state dict of this rank, the optimizer part of common.pt)."""
    layouts = model_layouts(model)
    state: Dict[str, Any] = {}
    by_param: Dict[int, TensorLayout] = {}
    for layout, tensor in layouts:
        by_param[id(tensor)] = layout
        if layout.save:
            state[layout.name] = GlobalTensor(layout.global_shape, layout.boxes(tensor.detach()))
    optimizer_common: Optional[Dict[str, Any]] = None
    if optimizer is not None and not args.no_save_optim:
        kind, keys = optimizer_kind(optimizer)
        inner = _inner(optimizer)
        mixed = False
        for entry in optimizer_entries(optimizer):
            layout = by_param.get(id(entry.model_param))
            if layout is None:
                raise CheckpointError(f"an optimizer parameter of shape {tuple(entry.model_param.shape)} is not "
                                      "in the model's state dict")
            if not layout.save:
                continue
            mixed = mixed or entry.own_copy
            held = inner.state.get(entry.main, {})
            tensors = {key: held.get(key) for key in keys}
            if entry.own_copy:
                tensors["fp32_param"] = entry.main.detach()
            for key, tensor in tensors.items():
                if tensor is None:  # before the first step: a fresh optimizer's zeros
                    tensor = torch.zeros_like(entry.main)
                fqn = f"optimizer.state.{key}.{layout.name}"
                boxes = _entry_boxes(layout, entry, tensor.detach())
                if fqn in state:
                    state[fqn].boxes += boxes
                else:
                    state[fqn] = GlobalTensor(layout.global_shape, boxes)
        step = torch.tensor([_optimizer_step(optimizer)], dtype=torch.float64)
        if dist.is_initialized():
            communication.all_reduce(step, op=dist.ReduceOp.MAX)
        scaler = getattr(optimizer, "grad_scaler", None)
        groups = [{k: v for k, v in group.items() if k != "params"} for group in inner.param_groups]
        optimizer_common = {"kind": kind, "state_keys": list(keys), "step": float(step.item()),
                            "grad_scaler": scaler.state_dict() if scaler is not None else None,
                            "param_groups": groups, "fp32_params": mixed}
    if rng_state is not None and not args.no_save_rng:
        buffer = io.BytesIO()
        torch.save(rng_state, buffer)
        state[_rng_key()] = buffer.getvalue()
    return state, optimizer_common


def _sizes() -> Dict[str, int]:
    """The parallel sizes common.pt records (the RNG states load only where they all match)."""
    if not parallel_state.model_parallel_is_initialized():
        return {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": _world(),
                "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1}
    _, ep, _, etp = _expert_ranks()
    return {"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "data_parallel_size": parallel_state.get_data_parallel_world_size(),
            "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}


def saved_sizes(content: Dict[str, Any]) -> Dict[str, int]:
    """The sizes of _sizes() as common.pt's content records them (checkpoints written before
    expert parallelism: EP 1, ETP = TP)."""
    sizes = {key: content.get(key) for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                "data_parallel_size")}
    sizes["expert_model_parallel_size"] = content.get("expert_model_parallel_size", 1)
    sizes["expert_tensor_parallel_size"] = content.get("expert_tensor_parallel_size",
                                                       sizes["tensor_model_parallel_size"])
    return sizes


def _rng_key() -> str:
    if not parallel_state.model_parallel_is_initialized():
        return f"rng_state.tp0_pp0_dp{_rank()}"
    return (f"rng_state.tp{parallel_state.get_tensor_model_parallel_rank()}"
            f"_pp{parallel_state.get_pipeline_model_parallel_rank()}"
            f"_dp{parallel_state.get_data_parallel_rank()}")


def _common_state(args: argparse.Namespace, iteration: int, opt_param_scheduler: Any,
                  optimizer_common: Optional[Dict[str, Any]], num_flops: float, saved_rng: bool) -> bytes:
    common: Dict[str, Any] = {
        "args": copy.deepcopy(args), "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
        "num_floating_point_operations_so_far": float(num_flops),
        "content": {"format": _CONTENT_FORMAT, "layout_version": LAYOUT_VERSION, **_sizes(),
                    "virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
                    "use_distributed_optimizer": bool(args.use_distributed_optimizer),
                    "optimizer": optimizer_common is not None, "rng": saved_rng},
    }
    if optimizer_common is not None:
        common["optimizer"] = optimizer_common
        if opt_param_scheduler is not None:
            common["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    buffer = io.BytesIO()
    torch.save(common, buffer)
    return buffer.getvalue()


def _tracked(save_dir: str) -> Optional[str]:
    try:
        with open(os.path.join(save_dir, _TRACKER_NAME), "r") as f:
            return f.read().strip()
    except OSError:
        return None


@dataclass
class _PendingSave:
    """A save whose files are being (or have been) written; finalize() makes it the latest."""

    iteration: int
    save_dir: str
    staging: str
    common: bytes
    writer: FileSystemWriter
    metadata: Optional[Metadata]       # the global metadata (rank 0)
    results: Any = None                # this rank's WriteResults
    files: Optional[Dict[str, Checksum]] = None
    error: Optional[str] = None
    thread: Optional[threading.Thread] = None
    started: float = 0.0

    def write(self, plan: SavePlan, planner: _SavePlanner) -> None:
        """Write this rank's file (in the calling thread); failures are kept, not raised."""
        try:
            self.results = self.writer.write_data(plan, planner).wait()
            files = {}
            for result in self.results:
                relative = result.storage_data.relative_path
                if relative not in files:
                    files[relative] = file_checksum(os.path.join(self.staging, relative))
            self.files = files
            _hold_for_test(self.iteration)
        except Exception as error:  # noqa: BLE001 -- reported on every rank at finalisation
            self.error = f"cannot write the pieces of rank {_rank()} into {self.staging}: {type(error).__name__}: {error}"

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()


_PENDING: List[_PendingSave] = []


def _hold_for_test(iteration: int) -> None:
    hook = os.environ.get(HOLD_ENV)
    if not hook or ":" not in hook:
        return
    wanted, path = hook.split(":", 1)
    if wanted != str(iteration):
        return
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def _broadcast(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    communication.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                    args: argparse.Namespace, num_floating_point_operations_so_far: float = 0.0,
                    rng_state: Any = None) -> None:
    """Save in the torch_dist layout (module docstring); with args.async_save only the planning
    and staging happen now and the files are written in the background. Collective."""
    from megatron.training.checkpoint_rng import get_rng_state

    save_dir = args.save
    finalize_async_save(blocking=True)  # one save in flight at a time, as Megatron
    asynchronous = bool(args.async_save)
    _print_rank_0("saving checkpoint at iteration {:7d} to {} in torch_dist format{}".format(
        iteration, save_dir, " (asynchronously)" if asynchronous else ""))
    staging = partial_dir(save_dir, iteration)
    error = None
    if _rank() == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            # what killed saves left (no save of this run is in flight: the last one was finalized)
            for name in os.listdir(save_dir):
                path, original = os.path.join(save_dir, name), os.path.join(save_dir, name[1:-len(".old")])
                if name.startswith(".iter_") and name.endswith(".old") and not os.path.exists(original):
                    os.replace(path, original)  # a save killed between its two renames: put it back
                elif name.startswith(".iter_") and name.endswith((".partial", ".old")):
                    shutil.rmtree(path, ignore_errors=True)
            final = iteration_dir(save_dir, iteration)
            if os.path.isdir(final) and _tracked(save_dir) != str(iteration):
                shutil.rmtree(final)  # an unfinished save of this iteration that was never tracked
            os.makedirs(staging)
        except OSError as exc:
            error = f"cannot prepare {staging}: {exc}"
    error = _broadcast(error)  # also: no rank writes before the folder is ready
    if error is not None:
        raise CheckpointError(f"checkpoint of iteration {iteration} was not saved: {error}")
    # (model_layouts and the step's all-reduce are collectives every rank reaches; a failure after
    # them is carried by the plans' all-gather, so that every rank raises instead of waiting)
    state, optimizer_common = _state_to_save(model, optimizer, args, rng_state if rng_state is not None
                                             else get_rng_state())
    writer = FileSystemWriter(staging, single_file_per_rank=True, sync_files=True, thread_count=1)
    planner = _SavePlanner()
    is_coordinator = _rank() == 0
    local_plan, local_error, common = None, None, b""
    try:
        if asynchronous:
            state = {k: (v.staged() if isinstance(v, GlobalTensor) else v) for k, v in state.items()}
        common = _common_state(args, iteration, opt_param_scheduler, optimizer_common,
                               num_floating_point_operations_so_far, _rng_key() in state)
        writer.set_up_storage_writer(is_coordinator, rank=_rank(), use_collectives=True)
        planner.set_up_planner(state, writer.storage_meta(), is_coordinator)
        local_plan = writer.prepare_local_plan(planner.create_local_plan())
    except Exception as exc:  # noqa: BLE001 -- reported on every rank below
        local_error = f"rank {_rank()}: cannot prepare its pieces: {type(exc).__name__}: {exc}"
    plans: List[Any] = [None] * _world()
    if dist.is_initialized():
        communication.all_gather_object(plans, (local_error, local_plan))  # every rank sees every failure
    else:
        plans = [(local_error, local_plan)]
    failed = [error for error, _ in plans if error is not None]
    if failed:
        if is_coordinator:
            shutil.rmtree(staging, ignore_errors=True)
        tracked = _tracked(save_dir)
        note = (f"the previous checkpoint is intact: the tracker still names iteration {tracked}"
                if tracked else "no earlier checkpoint was recorded")
        raise CheckpointError(f"checkpoint of iteration {iteration} was not saved: {failed[0]}; {note}")
    plans = [plan for _, plan in plans]
    metadata, plan_error, central = None, None, None
    if is_coordinator:
        try:
            global_plan, metadata = planner.create_global_plan(plans)
            central = writer.prepare_global_plan(global_plan)
        except Exception as exc:  # noqa: BLE001 -- e.g. boxes that overlap or leave holes
            plan_error = f"the ranks' pieces do not make whole tensors ({exc})"
    scattered = [None]
    if dist.is_initialized():
        communication.scatter_object_list(scattered, [(plan_error, p) for p in central] if central else
                                          [(plan_error, None)] * _world(), src=0)
    else:
        scattered = [(plan_error, central[0] if central else None)]
    plan_error, plan = scattered[0]
    if plan_error is not None:
        if is_coordinator:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"checkpoint of iteration {iteration} was not saved: {plan_error}")
    plan = planner.finish_plan(plan)
    pending = _PendingSave(iteration, save_dir, staging, common, writer, metadata, started=time.time())
    if asynchronous:
        pending.thread = threading.Thread(target=pending.write, args=(plan, planner),
                                          name=f"async-save-{iteration}", daemon=False)
        pending.thread.start()
        _PENDING.append(pending)
        return
    pending.write(plan, planner)
    _finalize(pending)


def _finalize(pending: _PendingSave) -> None:
    """Collective: every rank's results to rank 0, which completes the folder and the tracker."""
    results: List[Any] = [None] * _world()
    mine = (pending.results, pending.files, pending.error)
    if dist.is_initialized():
        communication.all_gather_object(results, mine)
    else:
        results = [mine]
    errors = [error for _, _, error in results if error is not None]
    failure = None
    if not errors and _rank() == 0:
        try:
            _complete(pending, [r for r, _, _ in results], [f for _, f, _ in results])
        except Exception as exc:  # noqa: BLE001 -- reported on every rank
            failure = f"cannot complete {pending.staging}: {type(exc).__name__}: {exc}"
    if errors:
        failure = "; ".join(errors)
    failure = _broadcast(failure)
    if failure is not None:
        if _rank() == 0:
            shutil.rmtree(pending.staging, ignore_errors=True)
        tracked = _tracked(pending.save_dir)
        note = (f"the previous checkpoint is intact: the tracker still names iteration {tracked}"
                if tracked else "no earlier checkpoint was recorded")
        raise CheckpointError(f"checkpoint of iteration {pending.iteration} was not saved: {failure}; {note}")
    _print_rank_0("  successfully saved checkpoint from iteration {:7d} to {} [torch_dist{}]".format(
        pending.iteration, pending.save_dir,
        f", written in the background in {time.time() - pending.started:.2f} s" if pending.thread else ""))


def _complete(pending: _PendingSave, results: List[Any], files: List[Dict[str, Checksum]]) -> None:
    """Rank 0: .metadata, metadata.json, common.pt, manifest; rename into place; tracker."""
    staging = pending.staging
    pending.writer.finish(pending.metadata, results)
    checksums: Dict[str, Checksum] = {}
    for rank_files in files:
        checksums.update(rank_files or {})
    checksums[DCP_METADATA] = file_checksum(os.path.join(staging, DCP_METADATA))
    common_path = os.path.join(staging, COMMON_FILE)
    checksums[COMMON_FILE] = atomic_write(common_path, lambda f: f.write(pending.common), checksum=True)
    config = {"sharded_backend": FORMAT, "sharded_backend_version": 1, "common_backend": "torch",
              "common_backend_version": 1}
    text = json.dumps(config).encode("utf-8")
    checksums[METADATA_JSON] = atomic_write(os.path.join(staging, METADATA_JSON), lambda f: f.write(text),
                                            checksum=True)
    write_manifest(staging, pending.iteration, checksums)
    final = iteration_dir(pending.save_dir, pending.iteration)
    old = None
    if os.path.isdir(final):  # re-saving the iteration the tracker names: swap folders
        old = staging[:-len(".partial")] + ".old"
        os.replace(final, old)
    os.replace(staging, final)
    tracker = os.path.join(pending.save_dir, _TRACKER_NAME)
    atomic_write(tracker, lambda f: f.write(str(pending.iteration).encode("ascii")))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def async_save_pending() -> bool:
    return bool(_PENDING)


def maybe_finalize_async_save(blocking: bool = False) -> None:
    """Finalize the background save once every rank's writes finished (a collective that every
    rank calls at the same points: after each iteration, before a save, at exit). blocking waits."""
    while _PENDING:
        pending = _PENDING[0]
        if blocking and pending.thread is not None:
            pending.thread.join()
        done = torch.tensor([1 if pending.done() else 0], dtype=torch.int32)
        if dist.is_initialized():
            communication.all_reduce(done, op=dist.ReduceOp.MIN)
        if not done.item():
            return
        _PENDING.pop(0)
        _finalize(pending)


def abandon_async_saves() -> None:
    """After a failure: wait for this rank's writer threads, finalize nothing (no collective)."""
    while _PENDING:
        pending = _PENDING.pop(0)
        if pending.thread is not None:
            pending.thread.join()


def finalize_async_save(blocking: bool = True) -> None:
    maybe_finalize_async_save(blocking=blocking)
