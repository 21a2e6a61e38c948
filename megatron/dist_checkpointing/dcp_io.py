"""torch_dist: DCP planners, the safe reader of DCP's .metadata, and the format's files.

See megatron/dist_checkpointing/__init__.py for the layout and the rules.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from typing import Any, Dict, List, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, WriteItem, WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.planner import TensorWriteData

from megatron.training.checkpoint_safety import CheckpointError, safe_globals
from megatron.dist_checkpointing.common import DCP_METADATA, METADATA_JSON, iteration_dir
from megatron.dist_checkpointing.layout import GlobalTensor

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
    # megatron-core's save planner keeps the global plan (its cached SavePlans) in the metadata: plain
    # dataclasses and an enum of DCP's planner module
    from torch.distributed.checkpoint import planner
    for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"):
        allowed[("torch.distributed.checkpoint.planner", name)] = getattr(planner, name)
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
