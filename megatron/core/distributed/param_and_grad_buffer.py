"""Contiguous gradient (and parameter) buffers, split into buckets that are reduced over the
data-parallel group.

Parameters of one (param dtype, grad dtype) pair share one flat grad buffer: each parameter's
`main_grad` is a view into it, so micro-batch gradients accumulate in place and one collective
per bucket reduces many parameters. Parameters are laid out in reverse order of registration:
backward produces the last layers' gradients first, so the first buckets fill (and, with
overlap, start reducing) first.

With the distributed optimizer the parameters themselves also become views into a flat param
buffer of the same layout, every bucket is padded to a multiple of the data-parallel size, and
data-parallel rank r owns the r-th 1/d slice of every bucket: gradients are reduce-scattered into
that slice, the optimizer updates it, and the updated slices are all-gathered back.

A bucket's collective runs on its whole grad slice, pre-scaled by gradient_scaling_factor
(1/d: the mean over data-parallel ranks; 1 with per-token loss, a sum that finalize_model_grads
divides by the global token count); with average_in_collective it reduces with AVG, after the
pre-scaling (1 for dense buffers; expert-dp size / d for expert buffers, see
DistributedDataParallel). Expert params' buffers are built the same way over the
expert-data-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
import torch.distributed as dist

from megatron.core import communication


@dataclass
class DistributedDataParallelConfig:
    """Megatron's DDP knobs (the --flag of each in parentheses)."""

    grad_reduce_in_fp32: bool = False        # --accumulate-allreduce-grads-in-fp32
    overlap_grad_reduce: bool = False        # --overlap-grad-reduce
    overlap_param_gather: bool = False       # --overlap-param-gather (distributed optimizer)
    use_distributed_optimizer: bool = False  # --use-distributed-optimizer
    bucket_size: Optional[int] = None        # --ddp-bucket-size, in elements; None: one bucket per buffer
    average_in_collective: bool = False      # --ddp-average-in-collective
    check_for_nan_in_grad: bool = False      # raise on NaN in a bucket before reducing it (not inf: fp16 overflow)


class Bucket:
    """A contiguous range of one buffer and the parameters inside it."""

    def __init__(self, index: int, params: List[torch.nn.Parameter], grad_data: torch.Tensor,
                 param_data: Optional[torch.Tensor], offset: int, data_parallel_group: Optional[dist.ProcessGroup],
                 config: DistributedDataParallelConfig, gradient_scaling_factor: float) -> None:
        self.index = index
        self.params = params
        self.params_set: Set[torch.nn.Parameter] = set(params)
        self.grad_data = grad_data          # view [numel] of the buffer's grads
        self.param_data = param_data        # view [numel] of the buffer's params (distributed optimizer)
        self.offset = offset                # start of the bucket in the buffer
        self.group = data_parallel_group
        self.config = config
        self.world = dist.get_world_size(data_parallel_group) if data_parallel_group is not None else 1
        self.rank = dist.get_rank(data_parallel_group) if data_parallel_group is not None else 0
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_gather: Any = None  # the in-flight parameter all-gather (overlap_param_gather)
        self.reset()

    def reset(self) -> None:
        self.ready: Set[torch.nn.Parameter] = set()
        self.work: Any = None
        self.started = False

    def shard(self, data: torch.Tensor, rank: Optional[int] = None) -> torch.Tensor:
        """Data-parallel rank's (default: this rank's) slice of a bucket-sized view."""
        size = data.numel() // self.world
        rank = self.rank if rank is None else rank
        return data[rank * size:(rank + 1) * size]

    def start_grad_sync(self) -> None:
        """Launch the bucket's reduction (asynchronously with overlap_grad_reduce)."""
        if self.started:
            return
        self.started = True
        if self.config.check_for_nan_in_grad and torch.isnan(self.grad_data).any():
            raise RuntimeError(f"NaN in the local gradients of bucket {self.index} (data-parallel rank "
                               f"{self.rank}) before their reduction: parameters "
                               f"{[tuple(p.shape) for p in self.params][:4]}...")
        # Scaled even without peers: an expert bucket over a one-rank expert-dp group still takes
        # the 1/d of the d dense replicas whose tokens its gradient holds.
        if self.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(self.gradient_scaling_factor)
        if self.world == 1:
            return
        op = dist.ReduceOp.AVG if self.config.average_in_collective else dist.ReduceOp.SUM
        async_op = self.config.overlap_grad_reduce
        if self.config.use_distributed_optimizer:
            self.work = communication.reduce_scatter_tensor(self.shard(self.grad_data), self.grad_data,
                                                            group=self.group, op=op, async_op=async_op)
        else:
            self.work = communication.all_reduce(self.grad_data, group=self.group, op=op, async_op=async_op)
        if not async_op:
            self.work = None

    def finish_grad_sync(self) -> None:
        """Wait for the reduction (launching it now if no gradient hook did)."""
        self.start_grad_sync()
        if self.work is not None:
            self.work.wait()
            self.work = None

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Called when param's gradient of the last micro-batch is in; the last one launches the bucket."""
        if param in self.ready:
            raise RuntimeError("a parameter's gradient was reported ready twice in one step; with "
                               "--overlap-grad-reduce every parameter must be used once per micro-batch")
        self.ready.add(param)
        if len(self.ready) == len(self.params):
            self.start_grad_sync()

    def start_param_sync(self) -> None:
        """All-gather the updated parameter slices of every data-parallel rank (distributed optimizer).

        With overlap_param_gather the all-gather is asynchronous; finish_param_sync waits for it
        (the DDP wrapper's forward pre-hooks call it before a module first uses these params).
        """
        if self.param_data is None or self.world == 1:
            return
        self.param_gather = communication.all_gather_into_tensor(
            self.param_data, self.shard(self.param_data), group=self.group, async_op=self.config.overlap_param_gather)
        if not self.config.overlap_param_gather:
            self.param_gather = None

    def finish_param_sync(self) -> None:
        """Wait for this bucket's parameter all-gather, if one is in flight."""
        if self.param_gather is not None:
            self.param_gather.wait()
            self.param_gather = None


class ParamAndGradBuffer:
    """One flat grad buffer (and param buffer with the distributed optimizer) for params of one dtype."""

    def __init__(self, config: DistributedDataParallelConfig, param_dtype: torch.dtype, grad_dtype: torch.dtype,
                 params: Sequence[torch.nn.Parameter], data_parallel_group: Optional[dist.ProcessGroup],
                 gradient_scaling_factor: float, own_bucket: Sequence[torch.nn.Parameter] = ()) -> None:
        self.config = config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.data_parallel_group = data_parallel_group
        world = dist.get_world_size(data_parallel_group) if data_parallel_group is not None else 1
        self.data_parallel_world_size = world
        pad = config.use_distributed_optimizer
        own = {id(p) for p in own_bucket}

        # Lay out: reverse order; a new bucket when the current one reached bucket_size, and a
        # bucket of its own for each param in own_bucket (the pipeline-shared embedding: its
        # first- and last-stage copies then have the same shard ranges).
        layout: List[tuple[List[torch.nn.Parameter], List[int], int, int]] = []  # (params, starts, start, end)
        current: List[torch.nn.Parameter] = []
        starts: List[int] = []
        cursor = bucket_start = 0

        def close_bucket() -> None:
            nonlocal cursor, bucket_start, current, starts
            if not current:
                return
            end = cursor
            if pad:
                end = bucket_start + -(-(end - bucket_start) // world) * world
            layout.append((current, starts, bucket_start, end))
            cursor = bucket_start = end
            current, starts = [], []

        for param in reversed(list(params)):
            if id(param) in own:
                close_bucket()
            current.append(param)
            starts.append(cursor)
            cursor += param.numel()
            if id(param) in own or (config.bucket_size is not None and cursor - bucket_start >= config.bucket_size):
                close_bucket()
        close_bucket()
        self.numel = cursor
        device = params[0].device if params else torch.device("cpu")
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = (torch.zeros(self.numel, dtype=param_dtype, device=device)
                           if config.use_distributed_optimizer else None)
        self.param_index_map: Dict[torch.nn.Parameter, tuple[int, int, int]] = {}  # param -> (start, end, bucket)
        self.buckets: List[Bucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        for index, (bucket_params, bucket_starts, start, end) in enumerate(layout):
            for param, param_start in zip(bucket_params, bucket_starts):
                param_end = param_start + param.numel()
                self.param_index_map[param] = (param_start, param_end, index)
                param.main_grad = self.grad_data[param_start:param_end].view(param.shape)
                if self.param_data is not None:
                    self.param_data[param_start:param_end].copy_(param.data.view(-1))
                    param.data = self.param_data[param_start:param_end].view(param.shape)
            bucket = Bucket(index, bucket_params, self.grad_data[start:end],
                            None if self.param_data is None else self.param_data[start:end], start,
                            data_parallel_group, config, gradient_scaling_factor)
            self.buckets.append(bucket)
            for param in bucket_params:
                self.param_to_bucket[param] = bucket

    def reset(self) -> None:
        """Zero the gradients and forget the buckets' progress (before a new global batch)."""
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()
