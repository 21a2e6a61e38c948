"""DistributedOptimizer: the optimizer state sharded over data-parallel ranks (Megatron's ZeRO-1).

DistributedDataParallel(use_distributed_optimizer=True) lays the params of one (param dtype,
grad dtype) out in a flat param buffer and a flat grad buffer of the same layout, cut into
buckets that are each padded to a multiple of the data-parallel size d. Data-parallel rank r
owns the r-th 1/d slice of every bucket; a param's "shard" on rank r is the part of its range
that falls into rank r's slice (possibly empty, possibly the whole param):

    bucket:   | rank 0 slice | rank 1 slice | rank 2 slice | rank 3 slice |   (padding at the end)
    param p:         [=================)
    p's shards:      [=====)[==========)                  rank 0 and rank 1 each own a piece

For each shard it owns a rank keeps an fp32 "main" tensor that the inner torch optimizer steps:
a view of the param buffer for fp32 params (no copy, as in Megatron), an fp32 clone for
fp16/bf16 params. The inner optimizer keeps the param groups of get_param_groups (wd_mult,
lr_mult, 'lr', 'weight_decay'), so OptimizerParamScheduler drives it unchanged; a group may hold
no shard on some rank. Its state (Adam's exp_avg, exp_avg_sq) is thus 1/d of the model's.

step():
  1. each main shard's grad := its slice of the reduce-scattered grad buffer (a view when the
     buffer is fp32 -- grad_reduce_in_fp32 --, an fp32 copy otherwise);
  2. fp16: unscale; found_inf is MAX-reduced over the data-parallel AND model-parallel groups,
     since each rank sees only its shards' grads;
  3. grad norm: squares summed over the owned shards (tied copies and tensor-parallel duplicates
     left out, as without sharding: a shard meeting a param's replicated K/V rows leaves out
     their flat range), then over the data-parallel and model-parallel groups, so
     the norm equals the non-distributed one (expert shards: over the expert-data-parallel and
     the expert tensor-model-pipeline groups, added to the dense part); clip;
  4. inner step; updated fp32 shards copied (cast) into the param buffer's owned range;
  5. DistributedDataParallel.start_param_sync() on every chunk: every bucket's param slices are
     all-gathered, so every rank holds every updated param (with overlap_param_gather the
     gathers run in the background and the next forward waits for each bucket before use).

Expert params (`allreduce = False`) sit in DistributedDataParallel's expert_parallel_buffers,
whose buckets are padded to and sharded over the expert-data-parallel group: every buffer
carries its own group (buffer.data_parallel_group), and each rank's owned ranges, gathers and
scatters follow it.

zero_grad() drops the main shards' grads only; the grad buffers themselves are zeroed by
DistributedDataParallel.zero_grad_buffer(), which train_step calls before every global batch.
--overlap-param-gather is refused (not supported yet): the all-gather runs inside step().

Checkpoint (--ckpt-format torch): state_dict() is the `optimizer` entry of model_optim_rng.pt
(inner param groups without their params, the Adam step per group as apex keeps it, the grad
scaler); the per-param tensors go to distrib_optim.pt, gathered on data-parallel rank 0:

    key                          content
    "buckets_coalesced"          True
    "per_bucket_numel"           [ {(param dtype, grad dtype): [padded numel of each bucket]} per buffer ]
    "per_bucket_numel_unpadded"  [ {(param dtype, grad dtype): [numel of each bucket]} per buffer ]
    i (int)                      {(param dtype, grad dtype): {"param": fp32 [n], "exp_avg": fp32 [n],
                                  "exp_avg_sq": fp32 [n], "numel_unpadded": n}}   ("momentum_buffer" for SGD)

Buffers are numbered over the model chunks in order (each chunk's dense buffers, then its
expert ones); [n] is every param of buffer i in buffer order without the buckets' padding, so
the file does not depend on d (nor on the bucket size): load_parameter_state re-shards it to
the current layout.

Each buffer's entry is gathered on rank 0 of that buffer's own group. So with expert params the
file of a rank holds the entries of the buffers whose group it is rank 0 of: data-parallel
rank 0 has the dense buffers (and its expert group's), and rank 0 of every other
expert-data-parallel group writes a file with that group's expert buffers only; the key
"expert_parallel_buffers" lists the expert buffers' numbers. At EP > 1 the classic layout keeps
one directory per expert-parallel rank (get_checkpoint_name's _EEE suffix), so every
expert-data-parallel root writes into its own directory and reads its file back from there at
the same layout (changing EP is torch_dist's job).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron.core import communication
from megatron.core.atomic_io import Checksum, atomic_write
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer import (
    _PARAM_ATTRIBUTES,
    MixedPrecisionOptimizer,
    _zero_grad_group_helper,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig

if TYPE_CHECKING:
    from megatron.core.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer


@dataclass
class ParamShard:
    """This rank's piece [start, end) (buffer coordinates) of one model param, and its fp32 main tensor."""

    model_param: nn.Parameter
    buffer_index: int          # over all chunks' buffers, in order
    bucket_index: int
    start: int
    end: int
    main: torch.Tensor         # [end - start] fp32; a view of the param buffer for fp32 params
    main_is_view: bool


def duplicate_range_in_shard(rows: tuple[int, int], row_numel: int, param_start: int, start: int,
                             end: int) -> Optional[tuple[int, int]]:
    """Where a param's duplicate rows [rows[0], rows[1]) (of dim 0, row_numel elements each; the
    param lies row-major from param_start in the buffer) meet the shard [start, end) (buffer
    coordinates): [lo, hi) in the shard's own coordinates, or None when they do not meet."""
    lo = max(start, param_start + rows[0] * row_numel)
    hi = min(end, param_start + rows[1] * row_numel)
    return (lo - start, hi - start) if lo < hi else None


def _owned_range(bucket: "Bucket") -> tuple[int, int]:
    """[start, end) of this data-parallel rank's slice of `bucket`, in buffer coordinates."""
    size = bucket.grad_data.numel() // bucket.world
    start = bucket.offset + bucket.rank * size
    return start, start + size


def _bucket_numel_unpadded(bucket: "Bucket") -> int:
    # A bucket's params are contiguous from its offset; the padding is at its end.
    return sum(param.numel() for param in bucket.params)


def _buffer_numel_unpadded(buffer: "ParamAndGradBuffer") -> int:
    return sum(_bucket_numel_unpadded(bucket) for bucket in buffer.buckets)


def _dtype_key(buffer: "ParamAndGradBuffer") -> tuple[torch.dtype, torch.dtype]:
    return (buffer.param_dtype, buffer.grad_dtype)


def _is_expert_buffer(buffer: "ParamAndGradBuffer") -> bool:
    return any(not getattr(param, "allreduce", True) for param in buffer.param_index_map)


def _rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def _buffers_of(model_chunks: Sequence[nn.Module]) -> list["ParamAndGradBuffer"]:
    """Every chunk's buffers (dense, then expert), in order; the chunks must be
    DistributedDataParallel with use_distributed_optimizer and share one data-parallel group."""
    buffers, groups = [], set()
    for index, chunk in enumerate(model_chunks):
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not hasattr(chunk, "buffers"):
            raise TypeError(f"model chunk {index} ({type(chunk).__name__}) is not wrapped in "
                            "DistributedDataParallel; the distributed optimizer steps its buffers")
        if not ddp_config.use_distributed_optimizer:
            raise ValueError(f"model chunk {index} was wrapped with use_distributed_optimizer=False: its "
                             "gradients are all-reduced and its params are not in a param buffer")
        groups.add(id(chunk.data_parallel_group))
        buffers.extend(chunk.all_buffers() if hasattr(chunk, "all_buffers") else chunk.buffers)
    if len(groups) > 1:
        raise ValueError("the model chunks use different data-parallel groups")
    return buffers


class DistributedOptimizer(MixedPrecisionOptimizer):
    """An inner torch optimizer stepping only this data-parallel rank's shards (see the module docstring).

    `optimizer` is built on the model params (get_param_groups' groups); the constructor swaps
    each group's params for the main shards this rank owns. `model_chunks` are the
    DistributedDataParallel chunks whose buffers hold those params. `model_parallel_group`
    (TP x PP) and the chunks' data-parallel group together span every rank holding a shard;
    for expert params `expert_tensor_model_pipeline_group` and the expert-data-parallel group.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 grad_scaler: Optional[MegatronGradScaler], model_chunks: Sequence[nn.Module],
                 model_parallel_group: Optional[dist.ProcessGroup] = None,
                 expert_tensor_model_pipeline_group: Optional[dist.ProcessGroup] = None,
                 has_expert_params: Optional[bool] = None) -> None:
        super().__init__(optimizer, config, grad_scaler, model_parallel_group, expert_tensor_model_pipeline_group,
                         has_expert_params)
        self.model_chunks = list(model_chunks)
        self.buffers = _buffers_of(self.model_chunks)
        self.data_parallel_group = self.model_chunks[0].data_parallel_group if self.model_chunks else None
        self.expert_buffer_indices = [i for i, buffer in enumerate(self.buffers) if _is_expert_buffer(buffer)]
        owned = self._owned_pieces()
        in_buffers = {param for buffer in self.buffers for param in buffer.param_index_map}
        self.shard_groups: list[list[ParamShard]] = []
        for group in self.optimizer.param_groups:
            shards = []
            for param in group["params"]:
                if param not in in_buffers:
                    raise ValueError(f"a parameter of shape {tuple(param.shape)} in the optimizer's groups is "
                                     "in none of the model chunks' buffers")
                if param in owned:
                    shards.append(self._make_shard(param, *owned[param]))
            group["params"] = [shard.main for shard in shards]
            self.shard_groups.append(shards)
        self._shards_by_bucket: dict[tuple[int, int], list[ParamShard]] = {}
        for shard in self.shards():
            self._shards_by_bucket.setdefault((shard.buffer_index, shard.bucket_index), []).append(shard)
        self.optimizer.state.clear()  # any state was keyed by the model params
        self._loaded_step = 0.0       # Adam step for state created by a load (see load_state_dict)

    # ------------------------------------------------------------------ layout
    def _owned_pieces(self) -> dict[nn.Parameter, tuple[int, int, int, int]]:
        """param -> (buffer index, bucket index, start, end) of its non-empty piece owned here."""
        owned = {}
        for buffer_index, buffer in enumerate(self.buffers):
            for bucket in buffer.buckets:
                own_start, own_end = _owned_range(bucket)
                for param in bucket.params:
                    start, end, _ = buffer.param_index_map[param]
                    lo, hi = max(start, own_start), min(end, own_end)
                    if lo < hi:
                        owned[param] = (buffer_index, bucket.index, lo, hi)
        return owned

    def _make_shard(self, param: nn.Parameter, buffer_index: int, bucket_index: int,
                    start: int, end: int) -> ParamShard:
        model_shard = self.buffers[buffer_index].param_data[start:end]
        if param.dtype == torch.float32:
            main, is_view = model_shard.detach(), True          # fp32: step the buffer in place
        elif param.dtype in (torch.float16, torch.bfloat16):
            main, is_view = model_shard.detach().clone().float(), False
        else:
            raise TypeError(f"wrapped parameters must be float32, float16 or bfloat16, got {param.dtype}")
        for name in _PARAM_ATTRIBUTES:  # the grad-norm filters read these
            if hasattr(param, name) and name != "tensor_parallel_duplicate_rows":
                setattr(main, name, getattr(param, name))
        rows = getattr(param, "tensor_parallel_duplicate_rows", None)
        duplicate = None if rows is None else duplicate_range_in_shard(
            rows, param.numel() // param.shape[0], self.buffers[buffer_index].param_index_map[param][0], start, end)
        if duplicate is not None:
            main.tensor_parallel_duplicate_rows = duplicate  # main is flat: its "rows" are elements
        return ParamShard(param, buffer_index, bucket_index, start, end, main, is_view)


    def shards(self) -> list[ParamShard]:
        return [shard for group in self.shard_groups for shard in group]

    def _data_parallel_rank_and_size(self) -> tuple[int, int]:
        return _rank_and_size(self.data_parallel_group)

    def _reduce_over_shard_holders(self, value: torch.Tensor, op: dist.ReduceOp) -> None:
        """Reduce over data-parallel x model-parallel: every rank holding a piece of the model."""
        for group in (self.data_parallel_group, self.get_model_parallel_group()):
            if group is not None:  # None here means no group, not the world
                communication.all_reduce(value, group=group, op=op)

    def _norm_parts(self) -> list[tuple[list[torch.Tensor], list[Optional[dist.ProcessGroup]]]]:
        """Dense shards' grads over data-parallel then model-parallel; expert shards' over
        expert-data-parallel (when this stage has any) then expert tensor-model-pipeline."""
        if not self.has_expert_params:
            return [(self.get_main_grads_for_grad_norm(), [self.data_parallel_group, self.get_model_parallel_group()])]
        expert_dp = [self.buffers[i].data_parallel_group for i in self.expert_buffer_indices[:1]]
        return [(self.get_main_grads_for_grad_norm(expert=False),
                 [self.data_parallel_group, self.get_model_parallel_group()]),
                (self.get_main_grads_for_grad_norm(expert=True), expert_dp + [self.expert_tensor_model_pipeline_group])]

    # ------------------------------------------------------------------ step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Main shards' grads and the model params' .grad; the grad buffers: DDP.zero_grad_buffer()."""
        for group in self.shard_groups:
            _zero_grad_group_helper([shard.main for shard in group], set_to_none)
        for buffer in self.buffers:
            _zero_grad_group_helper(list(buffer.param_index_map), set_to_none)

    def _copy_model_grads_to_main_grads(self) -> None:
        for shard in self.shards():
            grad = self.buffers[shard.buffer_index].grad_data[shard.start:shard.end]
            shard.main.grad = grad if grad.dtype == torch.float32 else grad.float()

    def _collect_main_grad_data_for_unscaling(self) -> list[torch.Tensor]:
        return [shard.main.grad for shard in self.shards() if shard.main.grad is not None]

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        main_grads = self._collect_main_grad_data_for_unscaling()
        device = self.buffers[0].grad_data.device if self.buffers else torch.device("cpu")
        inv_scale = self.grad_scaler.inv_scale.to(device)
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        for grad in main_grads:
            grad.mul_(inv_scale)
            found_inf = torch.maximum(found_inf, (~torch.isfinite(grad)).any().float().reshape(1))
        # Each rank sees only its shards: all must agree on skipping, or the params diverge.
        self._reduce_over_shard_holders(found_inf, dist.ReduceOp.MAX)
        return bool(found_inf.item() > 0)

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip on the global L2 norm (over all shards of all ranks); returns the norm before clipping."""
        grad_norm = self.get_grad_norm()
        clip_grad_by_total_norm_fp32(self._collect_main_grad_data_for_unscaling(), clip_grad, grad_norm)
        return grad_norm

    def _copy_main_params_to_model_params(self) -> None:
        for shard in self.shards():
            if not shard.main_is_view:
                self.buffers[shard.buffer_index].param_data[shard.start:shard.end].copy_(shard.main)

    def _copy_model_params_to_main_params(self) -> None:
        for shard in self.shards():
            if not shard.main_is_view:
                shard.main.copy_(self.buffers[shard.buffer_index].param_data[shard.start:shard.end])

    def step_with_ready_grads(self) -> bool:
        for chunk in self.model_chunks:
            # A gather still in flight (a bucket whose params no forward used) must land before
            # the step writes this rank's slice of the param buffer.
            chunk.finish_param_sync()
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        for chunk in self.model_chunks:
            chunk.start_param_sync()  # all-gather: every rank gets every updated param
        return True

    def reload_model_params(self) -> None:
        """The fp32 main shards follow the model's (just loaded) weights."""
        for chunk in self.model_chunks:
            chunk.finish_param_sync()
        self._copy_model_params_to_main_params()

    # ------------------------------------------------------------------ non-param state
    def _state_keys(self) -> tuple[str, ...]:
        """The per-param state tensors of the inner optimizer (what distrib_optim.pt holds besides 'param')."""
        if isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            return ("exp_avg", "exp_avg_sq")
        if isinstance(self.optimizer, torch.optim.SGD) and any(g.get("momentum", 0) for g in self.param_groups):
            return ("momentum_buffer",)
        return ()

    def _is_adam(self) -> bool:
        return isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW))

    def _current_step(self) -> float:
        """Adam's step count: every shard steps together, so any one's (0 before the first step)."""
        steps = [float(state["step"]) for state in self.optimizer.state.values() if "step" in state]
        return max(steps) if steps else self._loaded_step

    def state_dict(self) -> dict[str, Any]:
        """Inner param groups without their params (+ 'step' for Adam, as apex's groups keep it) and the grad scaler."""
        groups = []
        for group in self.optimizer.state_dict()["param_groups"]:
            group = {key: value for key, value in group.items() if key != "params"}
            if self._is_adam():
                group["step"] = self._current_step()
            groups.append(group)
        state_dict: dict[str, Any] = {"optimizer": {"param_groups": groups}}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hyper-parameters per group and the grad scaler; the per-param state: load_parameter_state."""
        inner = state_dict.get("optimizer")
        if not isinstance(inner, dict) or "param_groups" not in inner or inner.get("state"):
            raise ValueError("the optimizer checkpoint was not saved by the distributed optimizer (saved "
                             "without --use-distributed-optimizer?): its per-parameter state cannot be "
                             "loaded into data-parallel shards")
        saved = inner["param_groups"]
        if len(saved) != len(self.optimizer.param_groups):
            raise ValueError(f"the optimizer checkpoint holds {len(saved)} param groups, this optimizer "
                             f"{len(self.optimizer.param_groups)} (another model or weight-decay split?)")
        for group, saved_group in zip(self.optimizer.param_groups, saved):
            group.update({key: value for key, value in saved_group.items() if key not in ("params", "step")})
        if self._is_adam():
            self._loaded_step = float(max((g.get("step", 0) for g in saved), default=0))
            for shard in self.shards():  # Megatron's init_state_fn: state exists before the tensors load
                self._init_state(shard.main)["step"] = torch.tensor(self._loaded_step, dtype=torch.float32)
        self._load_grad_scaler(state_dict)

    def _init_state(self, main: torch.Tensor) -> dict[str, Any]:
        """main's inner-optimizer state, created as a fresh optimizer would (zeros) when missing."""
        state = self.optimizer.state[main]
        for key in self._state_keys():
            if key not in state:
                state[key] = torch.zeros_like(main, memory_format=torch.preserve_format)
        if self._is_adam() and "step" not in state:
            state["step"] = torch.tensor(self._loaded_step, dtype=torch.float32)
        return state

    # ------------------------------------------------------------------ distrib_optim.pt
    def _local_bucket_state(self, buffer_index: int, bucket: "Bucket", keys: Sequence[str]) -> torch.Tensor:
        """[k, s]: this rank's slice of `bucket` for each key (zeros in padding and missing state)."""
        own_start, own_end = _owned_range(bucket)
        local = torch.zeros(len(keys), own_end - own_start, dtype=torch.float32, device=bucket.grad_data.device)
        for shard in self._shards_by_bucket.get((buffer_index, bucket.index), []):
            state = self.optimizer.state.get(shard.main, {})
            for k, key in enumerate(keys):
                tensor = shard.main if key == "param" else state.get(key)
                if tensor is not None:
                    local[k, shard.start - own_start:shard.end - own_start] = tensor.detach()
        return local

    def _set_local_bucket_state(self, buffer_index: int, bucket: "Bucket", keys: Sequence[str],
                                local: torch.Tensor) -> None:
        own_start, _ = _owned_range(bucket)
        for shard in self._shards_by_bucket.get((buffer_index, bucket.index), []):
            piece = local[:, shard.start - own_start:shard.end - own_start]
            state = self._init_state(shard.main)
            for k, key in enumerate(keys):
                (shard.main if key == "param" else state[key]).copy_(piece[k])

    @staticmethod
    def _gather_on_root(local: torch.Tensor, group: Optional[dist.ProcessGroup]) -> Optional[torch.Tensor]:
        """[k, s] from every rank of `group` (a buffer's data-parallel group) -> [k, d * s] on its rank 0."""
        rank, size = _rank_and_size(group)
        if size == 1:
            return local
        pieces = [torch.empty_like(local) for _ in range(size)] if rank == 0 else None
        root = dist.get_global_rank(group, 0)
        communication.gather(local, pieces, dst=root, group=group)  # [k, s] x d -> rank 0
        return torch.cat(pieces, dim=1) if rank == 0 else None

    @staticmethod
    def _scatter_from_root(full: Optional[torch.Tensor], keys: int, size: int, device: torch.device,
                           group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        """[k, d * s] on rank 0 of `group` -> [k, s] on every rank of it."""
        rank, world = _rank_and_size(group)
        if world == 1:
            return full.to(device)
        local = torch.empty(keys, size, dtype=torch.float32, device=device)
        pieces = [full[:, r * size:(r + 1) * size].contiguous().to(device) for r in range(world)] if rank == 0 else None
        root = dist.get_global_rank(group, 0)
        communication.scatter(local, pieces, src=root, group=group)  # rank r gets slice r
        return local

    def _root_buffers(self) -> list[int]:
        """The buffers whose data-parallel group has this rank as rank 0 (their entries are saved here)."""
        return [i for i, buffer in enumerate(self.buffers) if _rank_and_size(buffer.data_parallel_group)[0] == 0]

    def _saves_parameter_state(self) -> bool:
        """Whether this rank holds a part of distrib_optim.pt: data-parallel rank 0, or rank 0 of an
        expert buffer's expert-data-parallel group."""
        return self._data_parallel_rank_and_size()[0] == 0 or bool(self._root_buffers())

    def _bucket_numels(self, padded: bool) -> list[dict[tuple, list[int]]]:
        return [{_dtype_key(buffer): [bucket.grad_data.numel() if padded else _bucket_numel_unpadded(bucket)
                                      for bucket in buffer.buckets]} for buffer in self.buffers]

    def get_parameter_state_dp_zero(self) -> Optional[dict[Any, Any]]:
        """The full per-param fp32 state (distrib_optim.pt's content) of the buffers whose group this
        rank is rank 0 of (data-parallel rank 0: every dense buffer); None on ranks that are no root.

        Collective over each buffer's data-parallel group (expert buffers: expert-data-parallel).
        """
        keys = ("param",) + self._state_keys()
        roots = set(self._root_buffers())
        state: dict[Any, Any] = {"buckets_coalesced": True, "per_bucket_numel": self._bucket_numels(True),
                                 "per_bucket_numel_unpadded": self._bucket_numels(False)}
        if self.expert_buffer_indices:
            state["expert_parallel_buffers"] = list(self.expert_buffer_indices)
        for buffer_index, buffer in enumerate(self.buffers):
            is_root = buffer_index in roots
            numel = _buffer_numel_unpadded(buffer)
            world = {key: torch.zeros(numel, dtype=torch.float32) for key in keys} if is_root else {}
            offset = 0
            for bucket in buffer.buckets:
                gathered = self._gather_on_root(self._local_bucket_state(buffer_index, bucket, keys),
                                                buffer.data_parallel_group)
                bucket_numel = _bucket_numel_unpadded(bucket)
                if is_root:
                    for k, key in enumerate(keys):  # drop the bucket's padding
                        world[key][offset:offset + bucket_numel] = gathered[k, :bucket_numel].cpu()
                offset += bucket_numel
            if is_root:
                world["numel_unpadded"] = numel
                state[buffer_index] = {_dtype_key(buffer): world}
        return state if self._saves_parameter_state() else None

    def save_parameter_state(self, filename: str) -> Optional[Checksum]:
        """Gather the param state and write it (atomically) to `filename` on every rank that holds a
        part of it (get_parameter_state_dp_zero); returns the file's Checksum there (None elsewhere)."""
        state = self.get_parameter_state_dp_zero()
        if state is None:
            return None
        return atomic_write(filename, lambda f: torch.save(state, f), checksum=True)

    def load_parameter_state(self, filename: str,
                             read: Optional[Callable[[str], Any]] = None) -> None:
        """Read `filename` on the ranks that saved a part of it and scatter it to this data-parallel layout.

        `read(filename)` reads (and may verify) the file; the default is
        torch.load(weights_only=True). Collective over the data-parallel group (and the
        expert-data-parallel one); every rank raises ValueError when the file cannot be read or
        does not fit this model (the message names what differs).
        """
        state, error = None, None
        if self._saves_parameter_state():
            try:
                if read is not None:
                    state = read(filename)
                else:
                    state = torch.load(filename, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 -- reported on every rank below, or the others hang
                error = (str(exc) if read is not None  # `read`'s errors name the file already
                         else f"cannot read the distributed-optimizer state {filename}: {exc}")
        self.load_parameter_state_from_dp_zero(state, source=filename, error=error)

    def load_parameter_state_from_dp_zero(self, state: Optional[dict[Any, Any]], source: str = "the state",
                                          error: Optional[str] = None) -> None:
        """Scatter `state` (get_parameter_state_dp_zero's dict, given on the ranks that saved one) to
        every rank; `error` (given there) is raised on every rank instead."""
        keys = ("param",) + self._state_keys()
        if self._saves_parameter_state() and error is None:
            mismatch = self._describe_mismatch(state, keys)
            if mismatch is not None:
                error = f"{source} does not fit this model: {mismatch}"
        error = self._agree_on_error(error, source)  # every rank must raise, or the others wait in the scatter
        if error is not None:
            raise ValueError(error)
        for buffer_index, buffer in enumerate(self.buffers):
            rank = _rank_and_size(buffer.data_parallel_group)[0]
            tensors = state[buffer_index][_dtype_key(buffer)] if rank == 0 else None
            offset = 0
            for bucket in buffer.buckets:
                bucket_numel = _bucket_numel_unpadded(bucket)
                full = None
                if rank == 0:
                    full = torch.zeros(len(keys), bucket.grad_data.numel(), dtype=torch.float32)
                    for k, key in enumerate(keys):  # re-pad for this layout
                        full[k, :bucket_numel] = tensors[key][offset:offset + bucket_numel]
                own_start, own_end = _owned_range(bucket)
                local = self._scatter_from_root(full, len(keys), own_end - own_start, bucket.grad_data.device,
                                                buffer.data_parallel_group)
                self._set_local_bucket_state(buffer_index, bucket, keys, local)
                offset += bucket_numel

    def _agree_on_error(self, error: Optional[str], source: str) -> Optional[str]:
        """The error of any rank that read a part of the state, known on every rank."""
        groups = [self.data_parallel_group] + [self.buffers[i].data_parallel_group for i in self.expert_buffer_indices]
        distinct = list({id(group): group for group in groups if _rank_and_size(group)[1] > 1}.values())
        for group in distinct:  # each group's rank 0 tells its group
            message = [error if dist.get_rank(group) == 0 else None]
            communication.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
            error = error or message[0]
        if not self.expert_buffer_indices:
            return error  # the data-parallel rank 0 was the only reader
        # Expert roots are told apart per expert-data-parallel group: a flag over data-parallel x
        # model-parallel (every rank) makes sure no rank goes on to a scatter its peers left.
        device = self.buffers[0].grad_data.device  # NCCL reduces only accelerator tensors
        flag = torch.tensor([float(error is not None)], device=device)
        self._reduce_over_shard_holders(flag, dist.ReduceOp.MAX)
        if flag.item() > 0 and error is None:
            error = f"another rank could not load {source} (its error names the cause)"
        return error

    def _describe_mismatch(self, state: Any, keys: Sequence[str]) -> Optional[str]:
        """None when `state` fits this model's buffers (those whose group this rank is rank 0 of)
        and optimizer, else what differs."""
        if not isinstance(state, dict):
            return f"expected a dict of per-buffer parameter state, got {type(state).__name__}"
        indices = sorted(key for key in state if isinstance(key, int))
        expected = self._root_buffers()
        if indices != expected:
            if not self.expert_buffer_indices:
                return f"it holds {len(indices)} parameter buffers, this model {len(self.buffers)}"
            return (f"it holds parameter buffers {indices}, this rank needs {expected} (expert buffers "
                    f"{self.expert_buffer_indices}; saved at another expert-parallel layout?)")
        for index in expected:
            buffer = self.buffers[index]
            entry, dtype_key = state[index], _dtype_key(buffer)
            if dtype_key not in entry:
                return (f"buffer {index} holds {_names(list(entry))} (param, grad) dtypes, "
                        f"this model {_names([dtype_key])}")
            tensors, numel = entry[dtype_key], _buffer_numel_unpadded(buffer)
            saved_keys = sorted(k for k, v in tensors.items() if isinstance(v, torch.Tensor))
            if saved_keys != sorted(keys):
                return (f"buffer {index} holds state {saved_keys}, this optimizer needs {sorted(keys)} "
                        "(another optimizer?)")
            saved_numel = {k: tensors[k].numel() for k in keys}
            saved_numel["numel_unpadded"] = tensors.get("numel_unpadded", numel)
            if any(value != numel for value in saved_numel.values()):
                return (f"buffer {index} {_names([dtype_key])} holds {saved_numel['param']} parameter "
                        f"elements (numel_unpadded {saved_numel['numel_unpadded']}), this model {numel}")
        return None


def _names(dtype_keys: list) -> str:
    return ", ".join("(" + ", ".join(str(d).replace("torch.", "") for d in key) + ")"
                     if isinstance(key, tuple) else str(key) for key in dtype_keys)


__all__ = ["DistributedOptimizer", "ParamShard", "duplicate_range_in_shard"]
