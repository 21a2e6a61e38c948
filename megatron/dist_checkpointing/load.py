"""torch_dist: loading at the current layout, and whole tensors for the converter.

See megatron/dist_checkpointing/__init__.py for the layout and the rules.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from megatron.core import communication
from megatron.training.checkpoint_manifest import manifest_path, read_manifest, verify_file
from megatron.training.checkpoint_safety import CheckpointError, load_file
from megatron.dist_checkpointing.common import (
    COMMON_FILE, DCP_METADATA, FORMAT, LAYOUT_VERSION, _CONTENT_FORMAT, _print_rank_0, _rank, _world,
)
from megatron.dist_checkpointing.layout import (
    GlobalTensor, TensorLayout, _entry_boxes, _inner, _is_distributed, model_layouts, optimizer_entries,
    optimizer_kind,
)
from megatron.dist_checkpointing.dcp_io import _LoadPlanner, _SafeReader, _load_bytes, read_dcp_metadata
from megatron.dist_checkpointing.save import _rng_key, _sizes, saved_sizes

# ============================================================================ load

def _gather_errors(error: Optional[str]) -> Optional[str]:
    if not dist.is_initialized():
        return error
    errors: List[Any] = [None] * _world()
    communication.all_gather_object(errors, error)
    found = [e for e in errors if e is not None]
    return found[0] if found else None


def _verify(base_dir: str, metadata: Metadata) -> Optional[str]:
    """Check this rank's share of the files against the manifest (None, or the first problem)."""
    try:
        manifest = read_manifest(base_dir)
        if manifest is None:
            _print_rank_0(f"  {base_dir} is not verified: it has no checksums.json")
            return None
        names = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
        missing = [name for name in names if name not in manifest]
        if missing:
            return (f"checkpoint file {os.path.join(base_dir, missing[0])} is not listed in "
                    f"{manifest_path(base_dir)}: the folder holds files from another save")
        for name in names[_rank()::_world()]:
            path = os.path.join(base_dir, name)
            if not os.path.isfile(path):
                return f"checkpoint file {path} is missing (the DCP metadata lists it)"
            verify_file(path, base_dir)
    except CheckpointError as error:
        return str(error)
    return None


def read_common(base_dir: str, args: Optional[argparse.Namespace] = None) -> Dict[str, Any]:
    """common.pt, verified against the manifest and read with the allow-list."""
    path = os.path.join(base_dir, COMMON_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{base_dir} has metadata.json but no {COMMON_FILE}: the save did not finish")
    if not verify_file(path, base_dir):
        _print_rank_0(f"  {path} is not verified: {base_dir} has no checksums.json")
    try:
        common = load_file(path, trust_pickles=args is not None and bool(args.trust_checkpoint_pickles),
                           log=_print_rank_0)
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(f"cannot read checkpoint file {path}: {error}") from None
    if not isinstance(common, dict):
        raise CheckpointError(f"checkpoint file {path} does not hold a dict")
    content = common.get("content")
    if not isinstance(content, dict) or content.get("format") != _CONTENT_FORMAT:
        raise CheckpointError(f"{base_dir} is a torch_dist checkpoint that this framework did not write "
                              "(Megatron-LM's own sharded layout?); it cannot be read here yet")
    if content.get("layout_version", 0) > LAYOUT_VERSION:
        raise CheckpointError(f"{base_dir} has torch_dist layout version {content['layout_version']}, newer than "
                              f"this framework's {LAYOUT_VERSION}")
    return common


def _check_vocab(saved_args: Any, args: argparse.Namespace, base_dir: str) -> None:
    saved, current = getattr(saved_args, "padded_vocab_size", None), args.padded_vocab_size
    if saved is not None and current is not None and saved != current:
        raise CheckpointError(
            f"checkpoint {base_dir} has a vocabulary padded to {saved} rows but this run pads it to {current} "
            "(the padding depends on --make-vocab-size-divisible-by x TP): pad it again with "
            "tools/checkpoint/convert.py --true-vocab-size N, or choose --make-vocab-size-divisible-by so that "
            "both agree")


def _describe(name: str, stored: Any) -> str:
    return name if stored is None else f"{name} {list(stored.size)}"


def _check_requests(state: Dict[str, Any], metadata: Metadata, base_dir: str) -> Optional[str]:
    known = metadata.state_dict_metadata
    for fqn, value in state.items():
        stored = known.get(fqn)
        if stored is None:
            return f"checkpoint {base_dir} holds no {fqn} (saved from another model, or without it)"
        if isinstance(value, GlobalTensor):
            if not isinstance(stored, TensorStorageMetadata):
                return f"checkpoint {base_dir} holds {fqn} as bytes, not a tensor"
            if tuple(stored.size) != tuple(value.shape):
                return (f"checkpoint {base_dir} holds {fqn} of shape {list(stored.size)} but this model's is "
                        f"{list(value.shape)}")
        elif not isinstance(stored, BytesStorageMetadata):
            return f"checkpoint {base_dir} holds {fqn} as a tensor, not bytes"
    return None


def _read(state: Dict[str, Any], base_dir: str, metadata: Metadata) -> Dict[str, bytes]:
    """Read every box of `state` from the checkpoint into its view (no collectives)."""
    reader = _SafeReader(base_dir)
    planner = _LoadPlanner()
    planner.set_up_planner(state, metadata, _rank() == 0)
    reader.set_up_storage_reader(metadata, _rank() == 0, rank=_rank(), use_collectives=False)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = planner.finish_plan(plan)
    reader.read_data(plan, planner).wait()
    return planner.bytes_read


def load_checkpoint(model: Any, optimizer: Any, opt_param_scheduler: Any, args: argparse.Namespace,
                    load_dir: str, base_dir: str, iteration: int, release: bool,
                    strict: bool = True) -> Tuple[int, float]:
    """Load a torch_dist checkpoint at this run's layout (collective). Returns (iteration, flops)."""
    from megatron.training.checkpoint_fit import check_checkpoint_args
    from megatron.training.checkpoint_rng import set_rng_state

    common = read_common(base_dir, args)
    saved_args = common.get("args")
    if saved_args is not None:
        _check_vocab(saved_args, args, base_dir)
        check_checkpoint_args(saved_args, args, base_dir)
    finetune = bool(args.finetune)
    load_optim = optimizer is not None and not release and not finetune and not args.no_load_optim
    load_rng = not release and not finetune and not args.no_load_rng
    error = None
    try:
        metadata_path = os.path.join(base_dir, DCP_METADATA)
        if not os.path.isfile(metadata_path):
            raise CheckpointError(f"{base_dir} has no DCP metadata file {DCP_METADATA}: the save did not finish")
        verify_file(metadata_path, base_dir)  # (a folder without a manifest is said so by _verify)
        metadata = read_dcp_metadata(metadata_path)
    except CheckpointError as exc:
        metadata, error = None, str(exc)
    error = _gather_errors(error or (_verify(base_dir, metadata) if metadata is not None else None))
    if error is not None:
        raise CheckpointError(error)

    layouts = model_layouts(model)
    state: Dict[str, Any] = {}
    for layout, tensor in layouts:
        boxes = layout.boxes(tensor.detach())
        if layout.name in state:  # e.g. two chunks of one stage reading the same name never happens
            state[layout.name].boxes += boxes
        else:
            state[layout.name] = GlobalTensor(layout.global_shape, boxes)
    if not strict:
        state = {k: v for k, v in state.items() if k in metadata.state_dict_metadata}

    finish_optimizer: Optional[Callable[[], None]] = None
    content = common["content"]
    if load_optim:
        if not content.get("optimizer") or "optimizer" not in common:
            error = (f"checkpoint {base_dir} has no optimizer state (saved with --no-save-optim?); pass "
                     "--no-load-optim or --finetune")
        else:
            error, finish_optimizer = _optimizer_targets(optimizer, common["optimizer"], layouts, metadata, state,
                                                         base_dir)
    rng_key = _rng_key()
    sizes, saved = _sizes(), saved_sizes(content)
    same_layout = saved == sizes
    if load_rng:
        if not content.get("rng"):
            error = error or (f"checkpoint {base_dir} has no RNG state (saved with --no-save-rng?); pass "
                              "--no-load-rng or --finetune to skip restoring it")
        elif same_layout:
            state[rng_key] = b""
        else:
            _print_rank_0(
                f"WARNING: the RNG states in {base_dir} were saved at {_describe_sizes(saved, sizes)}, "
                f"this run has {_describe_sizes(sizes, saved, values_only=True)}: keeping this run's fresh RNG state")
    error = _gather_errors(error or _check_requests(state, metadata, base_dir))
    if error is not None:
        raise CheckpointError(error)
    try:
        read_bytes = _read(state, base_dir, metadata)
        if finish_optimizer is not None:
            finish_optimizer()
        if rng_key in state:
            rng_state = _load_bytes(read_bytes[rng_key], f"the RNG state {rng_key} of {base_dir}")
            set_rng_state({"rng_state": rng_state}, base_dir, log=_print_rank_0)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 -- a damaged file: reported on every rank
        error = f"cannot read checkpoint {base_dir}: {type(exc).__name__}: {exc}"
    error = _gather_errors(error)
    if error is not None:
        raise CheckpointError(error)
    if optimizer is not None and not load_optim and (args.fp16 or args.bf16):
        reload = getattr(optimizer, "reload_model_params", None)
        if reload is not None:
            reload()  # a fresh optimizer's fp32 main params follow the loaded weights
    if load_optim and opt_param_scheduler is not None:
        if "opt_param_scheduler" not in common:
            raise CheckpointError(f"checkpoint {base_dir} has no opt_param_scheduler state; pass --no-load-optim")
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    iteration = 0 if (finetune or release) else int(common.get("iteration", iteration))
    if saved_args is not None and not finetune:
        for name in ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples"):
            setattr(args, name, getattr(saved_args, name, 0))
    if dist.is_initialized():
        communication.barrier()
    _print_rank_0(f"  successfully loaded checkpoint from {load_dir} [torch_dist, saved at "
                  f"{_describe_sizes(saved, sizes)}, read at {_describe_sizes(sizes, saved, values_only=True)}] "
                  f"at iteration {iteration}")
    return iteration, float(common.get("num_floating_point_operations_so_far", 0.0))


def _describe_sizes(sizes: Dict[str, Any], other: Dict[str, Any], values_only: bool = False) -> str:
    """'tensor/pipeline/data-parallel sizes 2/2/2', with the expert(-tensor)-parallel sizes too
    when either side is expert parallel ('.../expert/expert-tensor-parallel sizes 2/2/2/2/2')."""
    names = ["tensor", "pipeline", "data"]
    keys = ["tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size"]
    if any(s.get("expert_model_parallel_size", 1) != 1 for s in (sizes, other)):
        names += ["expert", "expert-tensor"]
        keys += ["expert_model_parallel_size", "expert_tensor_parallel_size"]
    values = "/".join(str(sizes.get(key)) for key in keys)
    return values if values_only else f"{'/'.join(names)}-parallel sizes {values}"


def _optimizer_targets(optimizer: Any, saved: Dict[str, Any], layouts: List[Tuple[TensorLayout, torch.Tensor]],
                       metadata: Metadata, state: Dict[str, Any], base_dir: str
                       ) -> Tuple[Optional[str], Optional[Callable[[], None]]]:
    """Add the optimizer's boxes to `state` (fresh tensors, or the distributed optimizer's own);
    return (error, the function that installs them once read)."""
    kind, keys = optimizer_kind(optimizer)
    if saved.get("kind") != kind or list(saved.get("state_keys", [])) != list(keys):
        return (f"checkpoint {base_dir} holds the state of a {saved.get('kind')} optimizer "
                f"({', '.join(saved.get('state_keys', [])) or 'no per-parameter state'}) but this run uses {kind}; "
                "pass --no-load-optim to start a fresh optimizer"), None
    by_param = {id(tensor): layout for layout, tensor in layouts}
    inner = _inner(optimizer)
    distributed = _is_distributed(optimizer)
    step = float(saved.get("step", 0.0))
    installs: List[Tuple[torch.Tensor, Dict[str, torch.Tensor]]] = []
    have_fp32 = any(k.startswith("optimizer.state.fp32_param.") for k in metadata.state_dict_metadata)
    for entry in optimizer_entries(optimizer):
        layout = by_param.get(id(entry.model_param))
        if layout is None:
            return f"an optimizer parameter of shape {tuple(entry.model_param.shape)} is not in the model", None
        if distributed:
            held = optimizer._init_state(entry.main)
            tensors = {key: held[key] for key in keys}
        else:
            tensors = {key: torch.zeros_like(entry.main) for key in keys}
        if entry.own_copy and have_fp32:
            tensors["fp32_param"] = entry.main.detach()
        for key, tensor in tensors.items():
            fqn = f"optimizer.state.{key}.{layout.name}"
            boxes = _entry_boxes(layout, entry, tensor)
            if fqn in state:
                state[fqn].boxes += boxes
            else:
                state[fqn] = GlobalTensor(layout.global_shape, boxes)
        installs.append((entry.main, {k: v for k, v in tensors.items() if k != "fp32_param"}))

    def install() -> None:
        step_tensor = torch.tensor(step, dtype=torch.float32)
        if distributed:
            optimizer._loaded_step = step
        for main, tensors in installs:
            held = inner.state[main]
            held.update(tensors)
            if kind == "adam":
                held["step"] = step_tensor.clone()
        if not have_fp32 and hasattr(optimizer, "reload_model_params"):
            optimizer.reload_model_params()  # saved from an fp32 run: the weights are the main params
        scaler, saved_scaler = getattr(optimizer, "grad_scaler", None), saved.get("grad_scaler")
        if scaler is not None and saved_scaler is not None:
            scaler.load_state_dict(saved_scaler)

    return None, install


def load_args(base_dir: str, args: argparse.Namespace) -> Tuple[Any, int]:
    """(saved args, iteration) from common.pt, for --use-checkpoint-args."""
    common = read_common(base_dir, args)
    return common.get("args"), int(common.get("iteration", 0))


# ============================================================================ whole tensors, for the converter

def _canonical_order(name: str) -> Tuple[int, int]:
    """A TP = 1 state dict's order: embedding, the layers by global index, the final norm, the output layer."""
    from megatron.convert.layout_rules import layer_index

    if name.startswith("embedding."):
        return 0, 0
    index = layer_index(name)
    if index is not None:
        return 1, index
    return (2, 0) if name.startswith("decoder.") else (3, 0)


def open_whole(base_dir: str) -> Tuple[Any, Metadata]:
    """(the saved args, the DCP metadata) of a torch_dist checkpoint folder, every file checked
    against its manifest (CheckpointError otherwise); one process, no collectives."""
    common = read_common(base_dir)
    metadata = read_dcp_metadata(os.path.join(base_dir, DCP_METADATA))
    if dist.is_initialized():
        raise CheckpointError("open_whole reads a torch_dist checkpoint in one process (no process group)")
    problem = _verify(base_dir, metadata)
    if problem is not None:
        raise CheckpointError(problem)
    args = common.get("args")
    if args is None:
        raise CheckpointError(f"{base_dir}/{COMMON_FILE} has no saved args: the converter needs them")
    return args, metadata


def whole_model_tensors(base_dir: str, metadata: Metadata) -> Iterator[Tuple[str, torch.Tensor]]:
    """The model's global tensors (TP = 1 names, layers numbered globally) in canonical order, each
    read whole when the iterator reaches it: what tools/checkpoint's loaders send."""
    names = [name for name, stored in metadata.state_dict_metadata.items()
             if isinstance(stored, TensorStorageMetadata) and not name.startswith("optimizer.")]
    for name in sorted(names, key=_canonical_order):  # stable: a layer's keys keep the saved order
        stored = metadata.state_dict_metadata[name]
        whole = torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
        _read({name: GlobalTensor(tuple(whole.shape), [((0,) * whole.dim(), whole)])}, base_dir, metadata)
        yield name, whole
