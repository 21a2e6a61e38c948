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
     the norm equals the non-distributed one; clip;
  4. inner step; updated fp32 shards copied (cast) into the param buffer's owned range;
  5. DistributedDataParallel.start_param_sync() on every chunk: every bucket's param slices are
     all-gathered, so every rank holds every updated param (with overlap_param_gather the
     gathers run in the background and the next forward waits for each bucket before use).

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

Buffers are numbered over the model chunks in order; [n] is every param of buffer i in buffer
order without the buckets' padding, so the file does not depend on d (nor on the bucket size):
load_parameter_state re-shards it to the current layout.
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


def _buffers_of(model_chunks: Sequence[nn.Module]) -> list["ParamAndGradBuffer"]:
    """Every chunk's buffers, in order; the chunks must be DistributedDataParallel with
    use_distributed_optimizer and share one data-parallel group."""
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
        buffers.extend(chunk.buffers)
    if len(groups) > 1:
        raise ValueError("the model chunks use different data-parallel groups")
    return buffers


class DistributedOptimizer(MixedPrecisionOptimizer):
    """An inner torch optimizer stepping only this data-parallel rank's shards (see the module docstring).

    `optimizer` is built on the model params (get_param_groups' groups); the constructor swaps
    each group's params for the main shards this rank owns. `model_chunks` are the
    DistributedDataParallel chunks whose buffers hold those params. `model_parallel_group`
    (TP x PP) and the chunks' data-parallel group together span every rank holding a shard.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 grad_scaler: Optional[MegatronGradScaler], model_chunks: Sequence[nn.Module],
                 model_parallel_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__(optimizer, config, grad_scaler, model_parallel_group)
        self.model_chunks = list(model_chunks)
        self.buffers = _buffers_of(self.model_chunks)
        self.data_parallel_group = self.model_chunks[0].data_parallel_group if self.model_chunks else None
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
        group = self.data_parallel_group
        if group is None:
            return 0, 1
        return dist.get_rank(group), dist.get_world_size(group)

    def _reduce_over_shard_holders(self, value: torch.Tensor, op: dist.ReduceOp) -> None:
        """Reduce over data-parallel x model-parallel: every rank holding a piece of the model."""
        for group in (self.data_parallel_group, self.get_model_parallel_group()):
            if group is not None:  # None here means no group, not the world
                communication.all_reduce(value, group=group, op=op)

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
        device = self.buffers[0].grad_data.device if self.buffers else torch.device("cpu")
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for grad in self.get_main_grads_for_grad_norm():
            total += torch.linalg.vector_norm(grad.float()) ** 2
        self._reduce_over_shard_holders(total, dist.ReduceOp.SUM)
        grad_norm = float(total.item()) ** 0.5
        clip_grad_by_total_norm_fp32(self._collect_main_grad_data_for_unscaling(), clip_grad, grad_norm)
        return grad_norm

    def count_zeros(self) -> int:
        device = self.buffers[0].grad_data.device if self.buffers else torch.device("cpu")
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for grad in self.get_main_grads_for_grad_norm():
            total += grad.numel() - torch.count_nonzero(grad)
        self._reduce_over_shard_holders(total, dist.ReduceOp.SUM)
        return int(total.item())

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

    def _gather_on_root(self, local: torch.Tensor) -> Optional[torch.Tensor]:
        """[k, s] from every data-parallel rank -> [k, d * s] on rank 0 (None elsewhere)."""
        rank, size = self._data_parallel_rank_and_size()
        if size == 1:
            return local
        pieces = [torch.empty_like(local) for _ in range(size)] if rank == 0 else None
        root = dist.get_global_rank(self.data_parallel_group, 0)
        dist.gather(local, pieces, dst=root, group=self.data_parallel_group)  # [k, s] x d -> rank 0
        return torch.cat(pieces, dim=1) if rank == 0 else None

    def _scatter_from_root(self, full: Optional[torch.Tensor], keys: int, size: int,
                           device: torch.device) -> torch.Tensor:
        """[k, d * s] on rank 0 -> [k, s] on every data-parallel rank."""
        rank, world = self._data_parallel_rank_and_size()
        if world == 1:
            return full.to(device)
        local = torch.empty(keys, size, dtype=torch.float32, device=device)
        pieces = [full[:, r * size:(r + 1) * size].contiguous().to(device) for r in range(world)] if rank == 0 else None
        root = dist.get_global_rank(self.data_parallel_group, 0)
        dist.scatter(local, pieces, src=root, group=self.data_parallel_group)  # rank r gets slice r
        return local

    def _bucket_numels(self, padded: bool) -> list[dict[tuple, list[int]]]:
        return [{_dtype_key(buffer): [bucket.grad_data.numel() if padded else _bucket_numel_unpadded(bucket)
                                      for bucket in buffer.buckets]} for buffer in self.buffers]

    def get_parameter_state_dp_zero(self) -> Optional[dict[Any, Any]]:
        """The full per-param fp32 state (distrib_optim.pt's content) on data-parallel rank 0, None elsewhere.

        Collective over the data-parallel group.
        """
        keys = ("param",) + self._state_keys()
        is_root = self._data_parallel_rank_and_size()[0] == 0
        state: dict[Any, Any] = {"buckets_coalesced": True, "per_bucket_numel": self._bucket_numels(True),
                                 "per_bucket_numel_unpadded": self._bucket_numels(False)}
        for buffer_index, buffer in enumerate(self.buffers):
            numel = _buffer_numel_unpadded(buffer)
            world = {key: torch.zeros(numel, dtype=torch.float32) for key in keys} if is_root else {}
            offset = 0
            for bucket in buffer.buckets:
                gathered = self._gather_on_root(self._local_bucket_state(buffer_index, bucket, keys))
                bucket_numel = _bucket_numel_unpadded(bucket)
                if is_root:
                    for k, key in enumerate(keys):  # drop the bucket's padding
                        world[key][offset:offset + bucket_numel] = gathered[k, :bucket_numel].cpu()
                offset += bucket_numel
            world["numel_unpadded"] = numel
            state[buffer_index] = {_dtype_key(buffer): world}
        return state if is_root else None

    def save_parameter_state(self, filename: str) -> Optional[Checksum]:
        """Gather the param state and write it (atomically) to `filename` on data-parallel rank 0;
        returns the file's Checksum there (None on the other ranks)."""
        state = self.get_parameter_state_dp_zero()
        if state is None:
            return None
        return atomic_write(filename, lambda f: torch.save(state, f), checksum=True)

    def load_parameter_state(self, filename: str,
                             read: Optional[Callable[[str], Any]] = None) -> None:
        """Read `filename` on data-parallel rank 0 and scatter it to this data-parallel layout.

        `read(filename)` reads (and may verify) the file; the default is
        torch.load(weights_only=True). Collective over the data-parallel group; every rank raises
        ValueError when the file cannot be read or does not fit this model (the message names
        what differs).
        """
        state, error = None, None
        if self._data_parallel_rank_and_size()[0] == 0:
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
        """Scatter `state` (get_parameter_state_dp_zero's dict, given on data-parallel rank 0) to
        every rank; `error` (rank 0) is raised on every rank instead."""
        keys = ("param",) + self._state_keys()
        rank, world = self._data_parallel_rank_and_size()
        if rank == 0 and error is None:
            mismatch = self._describe_mismatch(state, keys)
            if mismatch is not None:
                error = f"{source} does not fit this model: {mismatch}"
        if world > 1:  # every rank must raise, or the others wait in the scatter
            message = [error]
            dist.broadcast_object_list(message, src=dist.get_global_rank(self.data_parallel_group, 0),
                                       group=self.data_parallel_group)
            error = message[0]
        if error is not None:
            raise ValueError(error)
        for buffer_index, buffer in enumerate(self.buffers):
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
                local = self._scatter_from_root(full, len(keys), own_end - own_start, bucket.grad_data.device)
                self._set_local_bucket_state(buffer_index, bucket, keys, local)
                offset += bucket_numel

    def _describe_mismatch(self, state: Any, keys: Sequence[str]) -> Optional[str]:
        """None when `state` fits this model's buffers and optimizer, else what differs."""
        if not isinstance(state, dict):
            return f"expected a dict of per-buffer parameter state, got {type(state).__name__}"
        indices = sorted(key for key in state if isinstance(key, int))
        if indices != list(range(len(self.buffers))):
            return f"it holds {len(indices)} parameter buffers, this model {len(self.buffers)}"
        for index, buffer in enumerate(self.buffers):
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
