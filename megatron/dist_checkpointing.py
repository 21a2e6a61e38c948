"""`--ckpt-format torch_dist`: sharded checkpoints that every rank writes in parallel with PyTorch
Distributed Checkpoint (DCP) and that load at any TP / PP / DP / virtual-stage layout.

    <save>/
      latest_checkpointed_iteration.txt   the same tracker as the torch format (written last)
      iter_0000010/
        metadata.json                     {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                           "common_backend": "torch", "common_backend_version": 1}
                                          (Megatron-LM's file, exactly its four keys)
        common.pt                         torch.save'd dict of what is not sharded (below), rank 0
        .metadata                         DCP's index: every tensor's global shape, dtype, and the
                                          boxes (offsets, sizes) it was written in, with the file
                                          and byte range of each
        __R_0.distcp                      rank R's pieces (DCP's FileSystemWriter, one file per rank)
        checksums.json                    size and sha256 of every file above (checkpoint_manifest)

What is saved, as GLOBAL tensors named as a TP = 1, PP = 1 GPTModel's state dict (layers numbered
globally, so the pipeline stage and the virtual chunk that held a layer do not matter):

    key                                           content
    <model key>                                   the weight (its dtype), e.g. decoder.layers.3.mlp.linear_fc1.weight
    optimizer.state.<state>.<model key>           Adam's exp_avg / exp_avg_sq (SGD: momentum_buffer), fp32
    optimizer.state.fp32_param.<model key>        the fp32 main copy, with --fp16 / --bf16 only
    rng_state.tp{t}_pp{p}_dp{d}                   this rank's RNG states (checkpoint_rng's entry), bytes

How a rank's piece is described. A rank's local tensor is the rows (or columns) of the global one
that megatron/core/tensor_parallel/layout.partition_indices names; they are cut into maximal runs
of consecutive global indices along the partition dim and each run is one box (DCP chunk):

    layout                      boxes per rank
    replicated                  one box, the whole tensor (every replica describes the same box)
    contiguous (stride 1)       one box
    SwiGLU fc1 (stride 2)       two boxes: its gate rows and its up rows, at their global rows
    QKV rows, t | ng            one box (ng / t whole groups)
    QKV rows, t = r ng          two boxes: its query heads, and its group's K and V rows (the same
                                box on the r ranks that replicate them)

So the global tensors keep exactly the TP = 1 shapes (no [2, ffn, h] view is needed) and a
box that several ranks hold (DP replicas, replicated K/V rows, norms) is written once: DCP
deduplicates write items with the same key and offsets. The distributed optimizer's state is
described where it lives: a data-parallel rank owns a flat range [a, b) of each parameter's
local tensor; that range is cut into row-major boxes (a partial first row, whole rows, a partial
last row, recursively) and each is mapped to the global tensor as above. Nothing is gathered
over DP; a plain optimizer reads the same keys whole. The last pipeline stage's copy of tied
word embeddings is not written (the first stage's is the same tensor) and is read from
embedding.word_embeddings.weight.

common.pt: args, checkpoint_version 3.0, iteration, opt_param_scheduler, optimizer (kind,
step, grad_scaler, param_groups of rank 0 for information), num_floating_point_operations_so_far,
and `content` (who wrote it: layout version, the TP / PP / DP / VPP sizes, distributed optimizer,
what was saved). It is read with checkpoint_safety.load_file; DCP's .metadata is a pickle that
torch reads with plain pickle.load, so it is read here with an unpickler that builds only DCP's
metadata classes, torch dtypes / sizes and paths (anything else is refused by name); the
.distcp pieces are read by DCP with torch.load(weights_only=True); the RNG bytes with the
allow-list of checkpoint_safety.

Loading reads, at the CURRENT layout, the boxes of this rank's tensors with DCP (its
FileSystemReader and a load planner that intersects them with the saved boxes): no conversion
step. The RNG states load only when the TP / PP / DP sizes equal the saved ones (else a warning
and the fresh RNG, as Megatron's rng ShardedObjects). The padded vocabulary must match.

Saving: every rank plans (DCP's planner: the collective that dedups and validates the boxes),
then writes its file into <save>/.iter_XXXXXXX.partial/; once every rank reported its files
(a collective), rank 0 writes .metadata, metadata.json, common.pt and the manifest there, renames
the folder to iter_XXXXXXX and then writes the tracker. With --async-save the pieces are first
copied (staged) and the writes run in a background thread while training continues; the
collective that checks that every rank finished, and the finalisation, run at a later iteration
(maybe_finalize_async_save) or at exit (finalize_async_save(blocking=True)). A killed save leaves
only the .partial folder, which the next save removes; the tracker still names the previous
checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
import os
import pickle
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, WriteItem, WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.planner import TensorWriteData

from megatron.checkpoint_manifest import manifest_path, read_manifest, verify_file, write_manifest
from megatron.checkpoint_safety import CheckpointError, load_file, safe_globals
from megatron.core import parallel_state
from megatron.core.atomic_io import Checksum, atomic_write, file_checksum
from megatron.core.tensor_parallel.layout import is_tensor_parallel, partition_indices
from megatron.utils import print_line

FORMAT = "torch_dist"
METADATA_JSON = "metadata.json"
COMMON_FILE = "common.pt"
DCP_METADATA = ".metadata"
LAYOUT_VERSION = 1
CHECKPOINT_VERSION = 3.0
_CONTENT_FORMAT = "megatron-torch-dist"
_TRACKER_NAME = "latest_checkpointed_iteration.txt"
# Test hook: "ITERATION:PATH" makes the async writer of that iteration create PATH after writing
# its files and then wait (up to 10 minutes), so a test can kill the run mid-save deterministically.
HOLD_ENV = "MEGATRON_TEST_ASYNC_SAVE_HOLD"

Offsets = Tuple[int, ...]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _print_rank_0(message: str) -> None:
    if _rank() == 0:
        print_line(message)


# ============================================================================ geometry

def index_runs(indices: Sequence[int]) -> List[Tuple[int, int, int]]:
    """(local start, global start, length) of each maximal run of consecutive global indices."""
    runs: List[Tuple[int, int, int]] = []
    for local, index in enumerate(indices):
        if runs and runs[-1][1] + runs[-1][2] == index and runs[-1][0] + runs[-1][2] == local:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((local, index, 1))
    return runs


def split_runs(runs: List[Tuple[int, int, int]], cuts: Sequence[int]) -> List[Tuple[int, int, int]]:
    """`runs` also cut at the local indices `cuts` (so that rows several ranks replicate, e.g. a
    query group's K and V, are one box of the same offsets on each of them)."""
    out = []
    for local_start, global_start, length in runs:
        edges = sorted({local_start, local_start + length} | {c for c in cuts if local_start < c < local_start + length})
        for a, b in zip(edges, edges[1:]):
            out.append((a, global_start + a - local_start, b - a))
    return out


def flat_boxes(shape: Sequence[int], start: int, end: int) -> List[Tuple[Offsets, Offsets]]:
    """The flat range [start, end) of a row-major tensor of `shape` as boxes (offsets, sizes), in
    order; each box is contiguous in the flat order (a partial row, whole rows, a partial row)."""
    if start >= end:
        return []
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner

    def row(index: int, lo: int, hi: int) -> List[Tuple[Offsets, Offsets]]:
        return [((index,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], lo, hi)]

    if first == last:
        return row(first, start - first * inner, end - first * inner)
    boxes: List[Tuple[Offsets, Offsets]] = []
    whole_from = first
    if start % inner:
        boxes += row(first, start % inner, inner)
        whole_from = first + 1
    whole_to = end // inner
    if whole_to > whole_from:
        boxes.append(((whole_from,) + (0,) * (len(shape) - 1), (whole_to - whole_from,) + shape[1:]))
    if end % inner:
        boxes += row(whole_to, 0, end % inner)
    return boxes


@dataclass
class TensorLayout:
    """Where a local tensor sits in its global tensor: runs along `dim` (see the module docstring)."""

    name: str
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    dim: int
    runs: List[Tuple[int, int, int]]
    save: bool = True  # False for a copy another rank writes (the last stage's tied embedding)

    def _split(self, view: torch.Tensor, local_offsets: Offsets) -> List[Tuple[Offsets, torch.Tensor]]:
        if view.dim() == 0:
            return [((), view)]
        dim, lo, size = self.dim, local_offsets[self.dim], view.shape[self.dim]
        boxes = []
        for local_start, global_start, length in self.runs:
            s, e = max(lo, local_start), min(lo + size, local_start + length)
            if s < e:
                offsets = list(local_offsets)
                offsets[dim] = global_start + (s - local_start)
                boxes.append((tuple(offsets), view.narrow(dim, s - lo, e - s)))
        return boxes

    def boxes(self, tensor: torch.Tensor) -> List[Tuple[Offsets, torch.Tensor]]:
        """The global boxes of the whole local tensor, each with its view of `tensor`."""
        return self._split(tensor, (0,) * tensor.dim())

    def flat_boxes(self, flat: torch.Tensor, start: int, end: int) -> List[Tuple[Offsets, torch.Tensor]]:
        """The global boxes of the flat range [start, end) of the local tensor; `flat` [end - start]
        holds that range (a distributed optimizer's shard), the views are into it."""
        boxes = []
        strides = [math.prod(self.local_shape[i + 1:]) for i in range(len(self.local_shape))]
        for offsets, sizes in flat_boxes(self.local_shape, start, end):
            first = sum(o * s for o, s in zip(offsets, strides)) - start
            view = flat[first:first + math.prod(sizes)].view(sizes)
            boxes += self._split(view, offsets)
        return boxes


@dataclass
class GlobalTensor:
    """A leaf of the DCP state dict: a global tensor of `shape` of which this rank holds `boxes`."""

    shape: Tuple[int, ...]
    boxes: List[Tuple[Offsets, torch.Tensor]]

    def staged(self) -> "GlobalTensor":
        """A copy that training can no longer change (async save)."""
        return GlobalTensor(self.shape, [(o, t.detach().clone()) for o, t in self.boxes])


# ============================================================================ what a model holds

def _unwrap(module: nn.Module) -> nn.Module:
    while isinstance(getattr(module, "module", None), nn.Module):
        module = module.module
    return module


def _chunks(model: Any) -> List[nn.Module]:
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    return [_unwrap(chunk) for chunk in chunks]


def _layer_offset(chunk: nn.Module) -> int:
    """Global index of the chunk's first layer (its layers carry their global layer_number)."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", None)
    if layers is None or len(layers) == 0:
        return 0
    return int(getattr(layers[0], "layer_number", 1)) - 1


def _global_name(key: str, offset: int) -> str:
    from megatron.convert.layout_rules import renumber

    return renumber(key, offset)


def model_layouts(model: Any) -> List[Tuple[TensorLayout, torch.Tensor]]:
    """(layout, the local tensor) of every tensor in the model chunks' state dicts.

    Collective over the tensor-parallel group when some tensor has explicit rows (its global
    size along dim 0 is the largest row any rank holds, plus one)."""
    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    entries: List[Tuple[TensorLayout, torch.Tensor]] = []
    rows_sizes: List[Tuple[int, int]] = []  # (entry index, local max row + 1)
    for chunk in _chunks(model):
        offset = _layer_offset(chunk)
        for key, value in chunk.state_dict(keep_vars=True).items():
            if not torch.is_tensor(value):
                continue  # _extra_state entries without data
            local_shape = tuple(value.shape)
            name = _global_name(key, offset)
            save = True
            if getattr(value, "shared_embedding", False):
                name, save = "embedding.word_embeddings.weight", False
            if tp > 1 and is_tensor_parallel(value):
                dim = int(getattr(value, "partition_dim"))
                indices = partition_indices(value, local_shape[dim], tp, rank)
                runs = index_runs(indices)
                replicated_rows = getattr(value, "replicated_kv_rows", None)
                if replicated_rows is not None:  # K/V rows other ranks also hold: always a box of their own
                    runs = split_runs(runs, replicated_rows[:2])
                global_shape = list(local_shape)
                if getattr(value, "partition_rows", None) is not None:
                    rows_sizes.append((len(entries), max(indices) + 1))
                else:
                    global_shape[dim] = local_shape[dim] * tp
                entries.append((TensorLayout(name, local_shape, tuple(global_shape), dim, runs, save), value))
            else:
                runs = [(0, 0, local_shape[0])] if local_shape else []
                entries.append((TensorLayout(name, local_shape, local_shape, 0, runs, save), value))
    if rows_sizes:
        sizes = torch.tensor([size for _, size in rows_sizes], dtype=torch.long)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
        for (index, _), size in zip(rows_sizes, sizes.tolist()):
            layout = entries[index][0]
            layout.global_shape = (int(size),) + layout.global_shape[1:]
    return entries


# ============================================================================ what an optimizer holds

@dataclass
class OptimizerEntry:
    """One parameter as the optimizer steps it: the fp32 tensor it updates (`main`), the flat range
    of the model param's local tensor that main covers (None: all of it), and whether main is a
    copy of its own (mixed precision) rather than the model param (or a view of it)."""

    model_param: torch.Tensor
    main: torch.Tensor
    flat_range: Optional[Tuple[int, int]]
    own_copy: bool


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


def optimizer_kind(optimizer: Any) -> Tuple[str, Tuple[str, ...]]:
    """('adam', ('exp_avg', 'exp_avg_sq')), ('sgd', ('momentum_buffer',) or ()), else ('other', ())."""
    inner = _inner(optimizer)
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam", ("exp_avg", "exp_avg_sq")
    if isinstance(inner, torch.optim.SGD):
        momentum = any(group.get("momentum", 0) for group in inner.param_groups)
        return "sgd", ("momentum_buffer",) if momentum else ()
    return type(inner).__name__, ()


def optimizer_entries(optimizer: Any) -> List[OptimizerEntry]:
    """Every parameter this rank's optimizer steps (DistributedOptimizer: the shards it owns)."""
    if hasattr(optimizer, "shards") and hasattr(optimizer, "buffers"):  # DistributedOptimizer
        entries = []
        for shard in optimizer.shards():
            param_start = optimizer.buffers[shard.buffer_index].param_index_map[shard.model_param][0]
            entries.append(OptimizerEntry(shard.model_param, shard.main,
                                          (shard.start - param_start, shard.end - param_start),
                                          not shard.main_is_view))
        return entries
    if hasattr(optimizer, "float16_groups"):  # Float16OptimizerWithFloat16Params
        entries = [OptimizerEntry(p, m, None, True)
                   for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
                   for p, m in zip(model_group, main_group)]
        return entries + [OptimizerEntry(p, p, None, False)
                          for group in optimizer.fp32_from_fp32_groups for p in group]
    return [OptimizerEntry(p, p, None, False) for group in _inner(optimizer).param_groups for p in group["params"]]


def _is_distributed(optimizer: Any) -> bool:
    return hasattr(optimizer, "shards") and hasattr(optimizer, "buffers")


def _entry_boxes(layout: TensorLayout, entry: OptimizerEntry, tensor: torch.Tensor
                 ) -> List[Tuple[Offsets, torch.Tensor]]:
    """The global boxes of `tensor` (entry.main's shape: a state tensor or the main param)."""
    if entry.flat_range is None:
        return layout.boxes(tensor.view(layout.local_shape))
    start, end = entry.flat_range
    return layout.flat_boxes(tensor.view(-1), start, end)


def _optimizer_step(optimizer: Any) -> float:
    if hasattr(optimizer, "_current_step"):
        return float(optimizer._current_step())
    steps = [float(state["step"]) for state in _inner(optimizer).state.values() if "step" in state]
    return max(steps) if steps else 0.0


# ============================================================================ DCP planners

class _SavePlanner(DefaultSavePlanner):
    """Write items from GlobalTensor boxes (SHARD) and bytes (BYTE_IO); DCP's global plan dedups
    boxes several ranks hold and checks that the boxes tile every tensor exactly."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._by_offsets = {fqn: {offsets: tensor for offsets, tensor in value.boxes}
                            for fqn, value in state_dict.items() if isinstance(value, GlobalTensor)}

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, value in self.state_dict.items():
            if isinstance(value, GlobalTensor):
                for index, (offsets, tensor) in enumerate(value.boxes):
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, offsets, index), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape),
                            properties=TensorProperties.create_from_tensor(tensor),
                            size=torch.Size(value.shape))))
            else:
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self._by_offsets:
            return self._by_offsets[index.fqn][tuple(index.offset)]
        return self.state_dict[index.fqn]

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(object)
        return object.detach()


class _LoadPlanner(LoadPlanner):
    """Read each GlobalTensor box of this rank from the saved boxes it meets; bytes kept as bytes."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict, self.metadata = state_dict, metadata
        self.bytes_read: Dict[str, bytes] = {}

    def create_local_plan(self) -> LoadPlan:
        requests: List[ReadItem] = []
        for fqn, value in self.state_dict.items():
            stored = self.metadata.state_dict_metadata[fqn]
            if isinstance(value, GlobalTensor):
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in value.boxes]
                requests += create_read_items_for_chunk_list(fqn, stored, chunks)
            else:
                requests.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn),
                                         dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(fqn),
                                         storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(requests)

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.bytes_read[read_item.dest_index.fqn] = value.read()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self.state_dict[read_item.dest_index.fqn].boxes[read_item.dest_index.index][1]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, offset, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        return None  # the views were written in place


# ============================================================================ safe .metadata

def _metadata_globals() -> Dict[Tuple[str, str], Any]:
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    allowed: Dict[Tuple[str, str], Any] = {}
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                 "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        if hasattr(metadata, name):
            allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = cls
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _metadata_globals().get((module, name))
        if allowed is None:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return allowed


def read_dcp_metadata(path: str) -> Metadata:
    """DCP's .metadata, unpickled with only its own classes allowed (CheckpointError otherwise)."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"checkpoint file {path} refers to {error}, which is not on the list of what "
                              "DCP metadata may hold (unpickling it could run code); nothing from the file was "
                              "run") from None
    except Exception as error:  # noqa: BLE001 -- truncated or not a pickle
        raise CheckpointError(f"checkpoint file {path} is not DCP metadata ({type(error).__name__}: "
                              f"{error})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint file {path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class _SafeReader(FileSystemReader):
    """FileSystemReader whose .metadata is read by read_dcp_metadata (torch's is plain pickle.load)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_dcp_metadata(os.path.join(str(self.path), DCP_METADATA))


def _load_bytes(data: bytes, what: str) -> Any:
    with torch.serialization.safe_globals(list(safe_globals())):
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            raise CheckpointError(f"{what} holds something the safe unpickler does not build ({error}); "
                                  "nothing from it was run") from None


# ============================================================================ format detection

def is_dist_checkpoint(iteration_dir: str) -> bool:
    return os.path.isfile(os.path.join(iteration_dir, METADATA_JSON))


def sharded_backend(iteration_dir: str) -> str:
    """metadata.json's sharded_backend (CheckpointError when the file is unreadable)."""
    path = os.path.join(iteration_dir, METADATA_JSON)
    try:
        with open(path, "r", encoding="utf-8") as f:
            config = json.load(f)
        return str(config["sharded_backend"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path} is not a distributed-checkpoint config ({type(error).__name__}: "
                              f"{error})") from None


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
    if optimizer is not None and not getattr(args, "no_save_optim", False):
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
            dist.all_reduce(step, op=dist.ReduceOp.MAX)
        scaler = getattr(optimizer, "grad_scaler", None)
        groups = [{k: v for k, v in group.items() if k != "params"} for group in inner.param_groups]
        optimizer_common = {"kind": kind, "state_keys": list(keys), "step": float(step.item()),
                            "grad_scaler": scaler.state_dict() if scaler is not None else None,
                            "param_groups": groups, "fp32_params": mixed}
    if rng_state is not None and not getattr(args, "no_save_rng", False):
        buffer = io.BytesIO()
        torch.save(rng_state, buffer)
        state[_rng_key()] = buffer.getvalue()
    return state, optimizer_common


def _sizes() -> Dict[str, int]:
    if not parallel_state.model_parallel_is_initialized():
        return {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": _world()}
    return {"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "data_parallel_size": parallel_state.get_data_parallel_world_size()}


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
                    "virtual_pipeline_model_parallel_size": getattr(args, "virtual_pipeline_model_parallel_size", None),
                    "use_distributed_optimizer": bool(getattr(args, "use_distributed_optimizer", False)),
                    "optimizer": optimizer_common is not None, "rng": saved_rng},
    }
    if optimizer_common is not None:
        common["optimizer"] = optimizer_common
        if opt_param_scheduler is not None:
            common["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    buffer = io.BytesIO()
    torch.save(common, buffer)
    return buffer.getvalue()


def partial_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, ".iter_{:07d}.partial".format(iteration))


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, "iter_{:07d}".format(iteration))


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
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                    args: argparse.Namespace, num_floating_point_operations_so_far: float = 0.0,
                    rng_state: Any = None) -> None:
    """Save in the torch_dist layout (module docstring); with args.async_save only the planning
    and staging happen now and the files are written in the background. Collective."""
    from megatron.checkpoint_rng import get_rng_state

    save_dir = args.save
    finalize_async_save(blocking=True)  # one save in flight at a time, as Megatron
    asynchronous = bool(getattr(args, "async_save", False))
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
        dist.all_gather_object(plans, (local_error, local_plan))  # every rank sees every failure
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
        dist.scatter_object_list(scattered, [(plan_error, p) for p in central] if central else
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
        dist.all_gather_object(results, mine)
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
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
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


# ============================================================================ load

def _gather_errors(error: Optional[str]) -> Optional[str]:
    if not dist.is_initialized():
        return error
    errors: List[Any] = [None] * _world()
    dist.all_gather_object(errors, error)
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
        common = load_file(path, trust_pickles=bool(getattr(args, "trust_checkpoint_pickles", False)),
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
    saved, current = getattr(saved_args, "padded_vocab_size", None), getattr(args, "padded_vocab_size", None)
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
    from megatron.checkpoint_fit import check_checkpoint_args
    from megatron.checkpoint_rng import set_rng_state

    common = read_common(base_dir, args)
    saved_args = common.get("args")
    if saved_args is not None:
        _check_vocab(saved_args, args, base_dir)
        check_checkpoint_args(saved_args, args, base_dir)
    finetune = bool(getattr(args, "finetune", False))
    load_optim = optimizer is not None and not release and not finetune and not getattr(args, "no_load_optim", False)
    load_rng = not release and not finetune and not getattr(args, "no_load_rng", False)
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
    sizes = _sizes()
    same_layout = all(content.get(k) == v for k, v in sizes.items())
    if load_rng:
        if not content.get("rng"):
            error = error or (f"checkpoint {base_dir} has no RNG state (saved with --no-save-rng?); pass "
                              "--no-load-rng or --finetune to skip restoring it")
        elif same_layout:
            state[rng_key] = b""
        else:
            _print_rank_0(
                f"WARNING: the RNG states in {base_dir} were saved at tensor/pipeline/data-parallel sizes "
                f"{content.get('tensor_model_parallel_size')}/{content.get('pipeline_model_parallel_size')}/"
                f"{content.get('data_parallel_size')}, this run has {sizes['tensor_model_parallel_size']}/"
                f"{sizes['pipeline_model_parallel_size']}/{sizes['data_parallel_size']}: keeping this run's "
                "fresh RNG state")
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
    if optimizer is not None and not load_optim and (getattr(args, "fp16", False) or getattr(args, "bf16", False)):
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
        dist.barrier()
    _print_rank_0(f"  successfully loaded checkpoint from {load_dir} [torch_dist, saved at tensor/pipeline/"
                  f"data-parallel sizes {content.get('tensor_model_parallel_size')}/"
                  f"{content.get('pipeline_model_parallel_size')}/{content.get('data_parallel_size')}, read at "
                  f"{sizes['tensor_model_parallel_size']}/{sizes['pipeline_model_parallel_size']}/"
                  f"{sizes['data_parallel_size']}] at iteration {iteration}")
    return iteration, float(common.get("num_floating_point_operations_so_far", 0.0))


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


def benchmark_save_load(model: Any, optimizer: Any, opt_param_scheduler: Any, args: argparse.Namespace,
                        directory: str, ckpt_format: str = FORMAT, async_save: bool = False,
                        iteration: int = 1) -> Dict[str, float]:
    """Time one save and one load of (model, optimizer, scheduler) in `ckpt_format` ('torch' or
    'torch_dist', async_save with torch_dist) under `directory` (for bench/checkpoint_io.py).

    Collective when distributed. Returns seconds: 'save' (until save_checkpoint returned: what
    training waits for), 'finalize' (until the tracker names it; equal to 'save' when synchronous),
    'load' (load_checkpoint into the same model and optimizer), and 'bytes' (the iteration folder).
    `args` is copied; its save/load/ckpt_format/async_save are set here.
    """
    from megatron import checkpointing

    run = copy.copy(args)
    run.save = run.load = directory
    run.ckpt_format, run.async_save = ckpt_format, bool(async_save)
    run.auto_detect_ckpt_format = False
    for name in ("no_save_optim", "no_load_optim", "no_save_rng", "no_load_rng", "finetune"):
        setattr(run, name, getattr(run, name, False) or False)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    checkpointing.save_checkpoint(iteration, model, optimizer, opt_param_scheduler, run)
    saved = time.perf_counter()
    maybe_finalize_async_save(blocking=True)
    finalized = time.perf_counter()
    checkpointing.load_checkpoint(model, optimizer, opt_param_scheduler, run)
    loaded = time.perf_counter()
    folder = iteration_dir(directory, iteration)
    size = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)
    return {"save": saved - start, "finalize": finalized - start, "load": loaded - finalized, "bytes": float(size)}


__all__ = [
    "FORMAT", "GlobalTensor", "TensorLayout", "async_save_pending", "finalize_async_save", "flat_boxes",
    "abandon_async_saves", "benchmark_save_load", "open_whole", "whole_model_tensors", "index_runs", "is_dist_checkpoint", "load_args", "load_checkpoint", "maybe_finalize_async_save",
    "model_layouts", "optimizer_entries", "read_common", "read_dcp_metadata", "save_checkpoint",
    "sharded_backend",
]
