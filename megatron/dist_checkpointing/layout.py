"""torch_dist: where each rank's tensors (model and optimizer state) sit in the global tensors.

See megatron/dist_checkpointing/__init__.py for the layout and the rules.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.core import communication, parallel_state
from megatron.core.tensor_parallel.layout import is_tensor_parallel, partition_indices
from megatron.dist_checkpointing.common import Offsets

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


def _layer_offsets(chunk: nn.Module) -> Dict[str, int]:
    """Global index of the first layer of each of the chunk's layer stacks ("decoder", and
    "encoder" for BERT and T5), by stack name; its layers carry their global layer_number."""
    offsets = {}
    for stack in ("encoder", "decoder"):
        layers = getattr(getattr(chunk, stack, None), "layers", None)
        if layers is not None and len(layers) > 0:
            offsets[stack] = int(getattr(layers[0], "layer_number", 1)) - 1
    return offsets


def _global_name(key: str, offsets: Dict[str, int]) -> str:
    from megatron.convert.layout_rules import renumber

    return renumber(key, offsets.get(key.split(".", 1)[0], 0))


_EXPERT = re.compile(r"^(?P<prefix>(?:decoder|encoder)\.layers\.\d+\.mlp\.experts\.local_experts\.)"
                     r"(?P<index>\d+)\.(?P<rest>.+)$")


def _expert_ranks() -> Tuple[int, int, int, int]:
    """(ep rank, ep size, etp rank, etp size) of this rank; all trivial without parallel_state."""
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, 0, 1
    return (parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size())


def global_expert_names(keys: Sequence[str], ep_rank: int) -> Dict[str, str]:
    """{local key: global key} for the expert keys among `keys` (one chunk's state dict, layers
    already numbered globally): local expert i of a layer holding n of them on expert-parallel
    rank r is global expert r n + i. Other keys are not in the result."""
    local_counts: Dict[str, int] = {}
    matches = {}
    for key in keys:
        match = _EXPERT.match(key)
        if match is not None:
            matches[key] = match
            prefix = match.group("prefix")
            local_counts[prefix] = max(local_counts.get(prefix, 0), int(match.group("index")) + 1)
    return {key: f"{m.group('prefix')}{ep_rank * local_counts[m.group('prefix')] + int(m.group('index'))}."
                 f"{m.group('rest')}" for key, m in matches.items()}


def _split_layout(name: str, value: torch.Tensor, save: bool, size: int, rank: int
                  ) -> Tuple[TensorLayout, Optional[int]]:
    """The layout of `value` split over `size` ranks (TP, or ETP for an expert), and, for explicit
    rows, the largest global row + 1 this rank holds (the global size is their max over ranks)."""
    local_shape = tuple(value.shape)
    dim = int(getattr(value, "partition_dim"))
    indices = partition_indices(value, local_shape[dim], size, rank)
    runs = index_runs(indices)
    replicated_rows = getattr(value, "replicated_kv_rows", None)
    if replicated_rows is not None:  # K/V rows other ranks also hold: always a box of their own
        runs = split_runs(runs, replicated_rows[:2])
    global_shape = list(local_shape)
    rows_size = None
    if getattr(value, "partition_rows", None) is not None:
        rows_size = max(indices) + 1
    else:
        global_shape[dim] = local_shape[dim] * size
    return TensorLayout(name, local_shape, tuple(global_shape), dim, runs, save), rows_size


def model_layouts(model: Any) -> List[Tuple[TensorLayout, torch.Tensor]]:
    """(layout, the local tensor) of every tensor in the model chunks' state dicts.

    Experts are named globally (global_expert_names) and split over the expert tensor-parallel
    group (their partition attributes are ETP's), so their boxes do not depend on EP or ETP.
    Collective over the tensor-parallel group when some tensor has explicit rows (its global
    size along dim 0 is the largest row any rank holds, plus one)."""
    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    ep_rank, _, etp_rank, etp = _expert_ranks()
    entries: List[Tuple[TensorLayout, torch.Tensor]] = []
    rows_sizes: List[Tuple[int, int]] = []  # (entry index, local max row + 1)
    for chunk in _chunks(model):
        offsets = _layer_offsets(chunk)
        tensors = {_global_name(key, offsets): value for key, value in chunk.state_dict(keep_vars=True).items()
                   if torch.is_tensor(value)}  # (not _extra_state entries without data)
        experts = global_expert_names(list(tensors), ep_rank)
        for local_name, value in tensors.items():
            local_shape = tuple(value.shape)
            name = experts.get(local_name, local_name)
            save = True
            if getattr(value, "shared_embedding", False):
                name, save = "embedding.word_embeddings.weight", False
            elif getattr(value, "pipeline_copy", False):  # held (and saved) by an earlier stage too
                save = False
            size, split_rank = (etp, etp_rank) if local_name in experts else (tp, rank)
            if size > 1 and is_tensor_parallel(value):
                layout, rows_size = _split_layout(name, value, save, size, split_rank)
                if rows_size is not None:
                    rows_sizes.append((len(entries), rows_size))
                entries.append((layout, value))
            else:
                runs = [(0, 0, local_shape[0])] if local_shape else []
                entries.append((TensorLayout(name, local_shape, local_shape, 0, runs, save), value))
    if rows_sizes:
        sizes = torch.tensor([size for _, size in rows_sizes], dtype=torch.long)
        communication.all_reduce(sizes, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
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
