"""Megatron-LM's own torch_dist checkpoints (megatron.core.dist_checkpointing, PyTorch DCP backend), read
as our TP = 1 whole tensors under our names, whatever TP / PP / virtual stages they were written at.

    iter_XXXXXXX/  metadata.json, common.pt (args, checkpoint_version, iteration, ...: what is not
                   sharded), .metadata (DCP's index), __R_S.distcp (the pieces)

How megatron-core names a GPTModel's tensors (their DCP keys are the ShardedTensors' keys, their
global shapes include the prepended axes):
    decoder.layers.<part>                  a homogeneous block: every layer in one global tensor
                                           [num_layers, *TP = 1 shape] (the layer axis prepended)
    decoder.layers.<N>.<part>              non-homogeneous layers (heterogeneous specs, MoE every
                                           k-th layer, singleton_local_shards): one tensor per layer
    <..>.linear_fc1.weight (SwiGLU)        the gate rows of every TP rank, then the up rows: the
                                           TP = 1 tensor; with singleton_local_shards the two halves
                                           are keys of their own, <..>.weight_w / <..>.weight_v
    <..>.linear_qkv.weight                 query groups in order: our rows (checkpoint_version 3.0)
    <..>.linear_qkv.layer_norm_weight      the TE names of the fused norms (also what the local spec
                                           saves): input_layernorm / pre_mlp_layernorm (legacy.core_name)
    <..>.mlp.experts.experts.linear_fc1/2.weight (and .bias)
                                           an MoE layer's experts (SequentialMLP, TEGroupedMLP and
                                           GroupedMLP save the same): the expert axis [E, *TP = 1
                                           shape] after the layer axis if any, EP / expert-TP shards
                                           placed in it -> <..>.mlp.experts.local_experts.<e>.*;
                                           singleton_local_shards: <..>.experts.experts.<e>.linear_fc1.*
                                           one key per global expert (fc1's _w / _v halves as above)
    <..>.mlp.router.weight, <..>.mlp.shared_experts.*   as they are
    decoder.layers.N.mixer.in_proj.weight.{z,x,B,C,dt}   a hybrid (MambaStack: per-layer keys) Mamba
    decoder.layers.N.mixer.conv1d.{weight,bias}.{x,B,C}  mixer's packed tensors, one global tensor per
                                           part (each the TP = 1 part): joined in that order, our
                                           TP = 1 in_proj / conv1d; mixer.in_proj.layer_norm_weight
                                           is the layer's norm (TE's fused name), decoder.final_norm
    <module>._extra_state/shard_<o>_<n>    ShardedObjects (bytes: a torch.save'd list of the objects);
                                           empty ones are dropped, FP8 data refused (check_extra_state)
    output_layer.weight                    absent when tied (the last stage's copy is saved as a
                                           replica of embedding.word_embeddings.weight)
    rng_state/..., optimizer.*             not model tensors: not read
.metadata is read with dist_checkpointing's restricted unpickler, the pieces by DCP with
weights_only, the extra state and common.pt with checkpoint_safety's allow-list; the args become
ours as for the torch format (legacy.megatron_lm_args).
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from megatron.training.checkpoint_safety import CheckpointError, load_file

COMMON_FILE = "common.pt"
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine")
_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")
# an MoE layer's experts (the MoE layer's `experts.` and the expert module's own `experts.`)
_EXPERTS_STACKED = re.compile(r"^(.*\.mlp\.experts\.)experts\.(linear_fc[12]\.(?:weight|bias))$")  # [.., E, ...]
_EXPERT_SINGLE = re.compile(r"^(.*\.mlp\.experts\.)experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")
_SWIGLU_HALF = re.compile(r"^(.*\.linear_fc1\.(?:weight|bias))(_[wv])$")
# a Mamba mixer's packed tensors, saved as one global tensor per part (MambaMixer.sharded_state_dict)
_MAMBA_PART = re.compile(r"^(.*\.mixer\.(?:in_proj\.weight|conv1d\.(?:weight|bias)))(\.(?:z|x|B|C|dt))$")
_MAMBA_PARTS = {"in_proj": (".z", ".x", ".B", ".C", ".dt"), "conv1d": (".x", ".B", ".C")}  # in row order


def read_common(base_dir: str) -> Dict[str, Any]:
    """common.pt of a torch_dist folder, read with the allow-list (CheckpointError otherwise)."""
    path = os.path.join(base_dir, COMMON_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{base_dir} has metadata.json but no {COMMON_FILE}: the save did not finish")
    try:
        common = load_file(path)
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 -- truncated or not a torch file
        raise CheckpointError(f"cannot read checkpoint file {path}: {type(error).__name__}: {error}") from None
    if not isinstance(common, dict):
        raise CheckpointError(f"checkpoint file {path} does not hold a dict")
    return common


def is_megatron_lm(common: Dict[str, Any]) -> bool:
    """A common.pt that Megatron-LM wrote (ours has a `content` entry naming our layout)."""
    return "content" not in common


def _whole_of(key: str) -> Tuple[str, Optional[Tuple[str, ...]]]:
    """(the whole tensor's key, the suffixes of its parts in row order) of a key that holds one part
    of a tensor (SwiGLU's _w / _v halves, a Mamba mixer's z / x / B / C / dt), else (key, None)."""
    match = _SWIGLU_HALF.match(key)
    if match is not None:
        return match.group(1), ("_w", "_v")
    match = _MAMBA_PART.match(key)
    if match is not None:
        return match.group(1), _MAMBA_PARTS[match.group(1).split(".")[-2]]
    return key, None


class MegatronLMDist:
    """One Megatron-LM torch_dist iteration folder: `args` (ours), `iteration`, `names()` (our TP = 1
    names in canonical order) and `read(name)` (that whole tensor). One process, no collectives."""

    def __init__(self, base_dir: str, family: str = "GPT") -> None:
        from megatron.convert.legacy import megatron_lm_args
        from megatron.dist_checkpointing import DCP_METADATA, read_dcp_metadata

        self.base_dir = base_dir
        common = read_common(base_dir)
        if not is_megatron_lm(common):
            raise CheckpointError(f"{base_dir} is this framework's torch_dist checkpoint: read it with --loader megatron")
        path = os.path.join(base_dir, COMMON_FILE)
        if common.get("args") is None:
            raise CheckpointError(f"{path} has no saved args: the converter needs them for the tensor layouts")
        version = common.get("checkpoint_version", 0)
        if version != 3.0:
            raise CheckpointError(f"{path} has checkpoint_version {version}; Megatron-LM's torch_dist "
                                  "checkpoints have 3.0")
        self.raw_args = common["args"]
        self.args = megatron_lm_args(self.raw_args, path, family)
        self.iteration = int(common.get("iteration", 0))
        metadata_path = os.path.join(base_dir, DCP_METADATA)
        if not os.path.isfile(metadata_path):
            raise CheckpointError(f"{base_dir} has no DCP metadata file {DCP_METADATA}: the save did not finish")
        self.metadata = read_dcp_metadata(metadata_path)
        # ours -> (key, index along the prepended axes, None or the suffixes of the parts to join)
        self._sources: Dict[str, Tuple[str, Tuple[int, ...], Optional[Tuple[str, ...]]]] = {}
        self._scan()

    # ---------------------------------------------------------------- key mapping

    def _scan(self) -> None:
        from megatron.convert.legacy import check_extra_state, core_name, expert_order
        from megatron.dist_checkpointing.load import _canonical_order

        found: Dict[str, Tuple[str, Tuple[int, ...], Optional[Tuple[str, ...]]]] = {}
        for key, stored in self.metadata.state_dict_metadata.items():
            if key.startswith(_NOT_MODEL):
                continue
            base = key.split("/shard_", 1)[0]
            if not base.startswith(_MODEL_PREFIXES):
                raise CheckpointError(f"{self.base_dir} holds {key}, which is not part of a GPT model this "
                                      "reader knows (MTP layers, another model family?)")
            if isinstance(stored, BytesStorageMetadata):
                if not base.endswith("_extra_state"):
                    raise CheckpointError(f"{self.base_dir} holds {key} as bytes, not a tensor")
                for value in self._objects(key):
                    check_extra_state(value, base, self.base_dir)
                continue
            if not isinstance(stored, TensorStorageMetadata):
                raise CheckpointError(f"{self.base_dir}: {key} is neither a tensor nor bytes")
            name, parts = _whole_of(key)
            if parts is not None:
                missing = [name + part for part in parts if name + part not in self.metadata.state_dict_metadata]
                if missing:
                    raise CheckpointError(f"{self.base_dir} holds {key} but not {', '.join(missing)}: the parts "
                                          f"of {name} are incomplete")
            for ours, index in self._places(key, name, tuple(stored.size)):
                self._add(found, core_name(ours), name, index, parts)
        # each layer's experts expert by expert (fc1, then fc2), as SequentialMLP's state dict has them
        self._sources = expert_order({name: found[name] for name in sorted(found, key=_canonical_order)})

    def _places(self, key: str, name: str, shape: Tuple[int, ...]) -> List[Tuple[str, Tuple[int, ...]]]:
        """(our name, its index along the prepended axes) of each whole tensor in the global tensor
        `key` (name: key without a part's suffix, _whole_of): the layer axis of a homogeneous block,
        then the expert axis of stacked experts (E, the global expert index), or none."""
        layers = int(self.args.num_layers)
        stacked = _STACKED.match(name)
        if stacked is None:
            prefixes = [(name, ())]
        else:
            if not shape or shape[0] != layers:
                raise CheckpointError(f"{self.base_dir}: {key} has shape {list(shape)}, not "
                                      f"[{layers}, ...] (num_layers {layers} in its args)")
            prefixes = [(f"decoder.layers.{layer}.{stacked.group(1)}", (layer,)) for layer in range(layers)]
        single = _EXPERT_SINGLE.match(prefixes[0][0])
        if single is not None:  # singleton_local_shards: one key per global expert
            self._check_expert(key, int(single.group(2)))
            return [(_EXPERT_SINGLE.sub(r"\1local_experts.\2.\3", ours), index) for ours, index in prefixes]
        if _EXPERTS_STACKED.match(prefixes[0][0]) is None:
            return prefixes
        experts = self._check_expert(key, None)
        axis = len(prefixes[0][1])
        if len(shape) <= axis or shape[axis] != experts:
            raise CheckpointError(f"{self.base_dir}: {key} has shape {list(shape)}, whose axis {axis} is not "
                                  f"the {experts} experts of its args (num_experts)")
        return [(_EXPERTS_STACKED.sub(rf"\1local_experts.{expert}.\2", ours), index + (expert,))
                for ours, index in prefixes for expert in range(experts)]

    def _check_expert(self, key: str, index: Optional[int]) -> int:
        experts = int(getattr(self.args, "num_experts", None) or 0)
        if not experts:
            raise CheckpointError(f"{self.base_dir} holds expert tensor {key} but its args have no num_experts")
        if index is not None and index >= experts:
            raise CheckpointError(f"{self.base_dir} holds {key}, expert {index} of {experts} (num_experts)")
        return experts

    @staticmethod
    def _add(found: Dict[str, Any], name: str, key: str, index: Tuple[int, ...],
             parts: Optional[Tuple[str, ...]]) -> None:
        if parts is not None and name in found and found[name][2] == parts:
            return  # one entry for all the parts (key: their common prefix)
        if name in found:
            raise CheckpointError(f"{key} and {found[name][0]} both name {name} (TE's fused norm and a separate one?)")
        found[name] = (key, index, parts)

    def _objects(self, key: str) -> List[Any]:
        from megatron.dist_checkpointing.dcp_io import _load_bytes
        from megatron.dist_checkpointing.load import _read

        try:
            data = _read({key: b""}, self.base_dir, self.metadata)[key]
            objects = _load_bytes(data, f"{key} of {self.base_dir}")
        except Exception as error:  # noqa: BLE001 -- a damaged .distcp file; torch's messages span lines
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise CheckpointError(f"cannot read {key} from {self.base_dir}: {first}") from None
        return objects if isinstance(objects, list) else [objects]

    # ---------------------------------------------------------------- reading

    def names(self) -> List[str]:
        return list(self._sources)

    def _slab(self, key: str, index: Tuple[int, ...]) -> torch.Tensor:
        """The whole tensor at `index` along the prepended axes (layer, expert) of global tensor `key`."""
        from megatron.dist_checkpointing.layout import GlobalTensor
        from megatron.dist_checkpointing.load import _read

        stored = self.metadata.state_dict_metadata.get(key)
        if not isinstance(stored, TensorStorageMetadata):
            raise CheckpointError(f"{self.base_dir} holds no tensor {key}")
        shape = tuple(stored.size)
        local = (1,) * len(index) + shape[len(index):]
        out = torch.empty(local, dtype=stored.properties.dtype)
        offsets = tuple(index) + (0,) * (len(shape) - len(index))
        try:
            _read({key: GlobalTensor(shape, [(offsets, out)])}, self.base_dir, self.metadata)
        except CheckpointError:
            raise
        except Exception as error:  # noqa: BLE001 -- a missing or damaged .distcp file
            first = str(error).splitlines()[0] if str(error) else ""
            raise CheckpointError(f"cannot read {key} from {self.base_dir}: {type(error).__name__}: {first}") from None
        return out.reshape(shape[len(index):])

    def read(self, name: str) -> torch.Tensor:
        key, index, parts = self._sources[name]
        if parts is None:
            return self._slab(key, index)
        return torch.cat([self._slab(key + part, index) for part in parts])

    def tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for name in self._sources:
            yield name, self.read(name)
