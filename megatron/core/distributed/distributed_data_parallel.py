"""DistributedDataParallel: Megatron's data-parallel wrapper around one model chunk.

    model = DistributedDataParallel(config, ddp_config, chunk)
    with model.no_sync():            # every micro-batch but the last: accumulate only
        loss.backward()
    loss.backward()                  # last micro-batch: with overlap, buckets launch as they fill
    model.finish_grad_sync()         # (finalize_model_grads) wait; main_grad holds the DP mean (sum)
    model.zero_grad_buffer()         # before the next global batch

Every trainable parameter gets a `main_grad` view into a contiguous buffer (one per
(param dtype, grad dtype); grads in fp32 with grad_reduce_in_fp32). A hook run after each
backward adds the fresh `.grad` into `main_grad` and frees `.grad` (with gradient-accumulation
fusion a linear layer's backward has added its weight gradient already). With overlap_grad_reduce the
hook also reports the parameter ready during the last micro-batch, and a bucket whose
parameters are all ready starts its asynchronous all-reduce (reduce-scatter with the
distributed optimizer) while backward continues through earlier layers.

The wrapper is used at every data-parallel size (at 1 no collective runs), as in Megatron, so
the optimizer always reads `main_grad`.

Expert parameters (`param.allreduce = False`, Megatron's marker) live in buffers of their own
(`expert_parallel_buffers`), reduced over the expert-data-parallel group: the ranks holding the
same experts. Their local gradient already sums over the tokens the dispatcher brought from
every expert-parallel peer, so they are scaled like the dense ones, by 1/d with d the dense
data-parallel x context-parallel size, not 1/(expert-dp size).

Normalisation over the data-parallel ranks follows config.calculate_per_token_loss (Megatron's):
    False  each bucket is pre-scaled by 1/d (or reduced with AVG: dense buckets unscaled, expert
           buckets pre-scaled by expert-dp size / d): main_grad is the replicas' mean
    True   buckets are summed unscaled; finalize_model_grads then divides by the global batch's
           loss-token count, itself summed over the same data-parallel group
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, Iterator, List, Optional, Protocol

import torch
from torch import nn

from megatron.core import communication, parallel_state
from megatron.core.distributed.param_and_grad_buffer import DistributedDataParallelConfig, ParamAndGradBuffer
from megatron.core.utils import unwrap_model


class DDPModelConfig(Protocol):
    """What DistributedDataParallel reads from the model's config (megatron.model.TransformerConfig)."""

    calculate_per_token_loss: bool


class DistributedDataParallel(nn.Module):
    def __init__(self, config: DDPModelConfig, ddp_config: DistributedDataParallelConfig, module: nn.Module,
                 data_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
                 expert_data_parallel_group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        """`data_parallel_group` (default: parallel_state's DP x CP group) reduces the dense params,
        `expert_data_parallel_group` (default: parallel_state's expert-DP group) those with
        `allreduce = False`; None without initialised groups: one rank, no collective."""
        super().__init__()
        self.config = config
        self.module = module
        self.ddp_config = ddp_config
        if data_parallel_group is None and parallel_state.model_parallel_is_initialized():
            data_parallel_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.data_parallel_group = data_parallel_group
        world = _size(data_parallel_group)
        self.data_parallel_world_size = world
        if ddp_config.average_in_collective and config.calculate_per_token_loss:
            raise ValueError("--ddp-average-in-collective cannot be used with --calculate-per-token-loss: "
                             "per-token gradients are summed over the data-parallel ranks, not averaged")

        dense, experts = _trainable_params_by_kind(module)
        if experts and expert_data_parallel_group is None and parallel_state.model_parallel_is_initialized():
            expert_data_parallel_group = parallel_state.get_expert_data_parallel_group()
        self.expert_data_parallel_group = expert_data_parallel_group
        self.expert_data_parallel_world_size = _size(expert_data_parallel_group)
        scaling, expert_scaling = self._gradient_scaling_factors()

        own_bucket = self._pipeline_shared_embedding() if ddp_config.use_distributed_optimizer else []
        self.buffers = self._make_buffers(dense, data_parallel_group, scaling, own_bucket)
        self.expert_parallel_buffers = self._make_buffers(experts, expert_data_parallel_group, expert_scaling, [])
        self.param_to_bucket = {}
        for buffer in self.all_buffers():
            self.param_to_bucket.update(buffer.param_to_bucket)
        self.is_last_microbatch = True
        # The parameters hold their hooks; a hook that held this wrapper would keep it (its buffers,
        # groups and the gloo threads behind them) alive for ever: a parameter's hooks sit beyond
        # the garbage collector's reach. The hook looks the wrapper up through a weak reference.
        grad_hook = _weak_method(self._grad_hook)
        self._hooks = [param.register_post_accumulate_grad_hook(grad_hook) for param in self.param_to_bucket]
        if ddp_config.overlap_param_gather:
            if not ddp_config.use_distributed_optimizer:
                raise ValueError("overlap_param_gather needs use_distributed_optimizer (--use-distributed-optimizer)")
            # Each module waits, just before its forward, for the all-gathers of the buckets that
            # hold its own parameters: the gather of later layers overlaps earlier layers' compute.
            for module in self.module.modules():
                buckets = {id(b): b for p in module.parameters(recurse=False) if p in self.param_to_bucket
                           for b in [self.param_to_bucket[p]]}
                if buckets:
                    module.register_forward_pre_hook(self._make_param_sync_hook(list(buckets.values())))

    def _gradient_scaling_factors(self) -> tuple[float, float]:
        """(dense, expert) bucket pre-scaling, Megatron's: the mean over the d = DP x CP replicas'
        losses for both kinds; with per-token loss a plain sum (finalize_model_grads divides)."""
        if self.config.calculate_per_token_loss:
            return 1.0, 1.0
        if self.ddp_config.average_in_collective:
            # AVG divides expert buckets by the expert-dp size: undo it, then divide by d.
            return 1.0, self.expert_data_parallel_world_size / self.data_parallel_world_size
        return 1.0 / self.data_parallel_world_size, 1.0 / self.data_parallel_world_size

    def _make_buffers(self, params: List[nn.Parameter], group: Optional[torch.distributed.ProcessGroup],
                      scaling: float, own_bucket: List[nn.Parameter]) -> List[ParamAndGradBuffer]:
        """One buffer per (param dtype, grad dtype) of `params`, reduced over `group`."""
        by_dtype: Dict[tuple, List[nn.Parameter]] = {}
        for param in params:
            grad_dtype = torch.float32 if self.ddp_config.grad_reduce_in_fp32 else param.dtype
            by_dtype.setdefault((param.dtype, grad_dtype), []).append(param)
        return [ParamAndGradBuffer(self.ddp_config, param_dtype, grad_dtype, same, group, scaling,
                                   own_bucket=[p for p in own_bucket if p in set(same)])
                for (param_dtype, grad_dtype), same in by_dtype.items()]

    def all_buffers(self) -> List[ParamAndGradBuffer]:
        """The dense buffers, then the expert-parallel ones (the distributed optimizer's numbering)."""
        return self.buffers + self.expert_parallel_buffers

    def _pipeline_shared_embedding(self) -> List[nn.Parameter]:
        """The parameters held on several pipeline stages whose gradients are summed between them:
        the tied embedding weight on the first / last stage (and an encoder-decoder split's first
        decoder stage), the learned position table of a split's first encoder and first decoder
        stage, and the parameters on every stage of a stack (T5's relative position tables)."""
        inner = unwrap_model(self.module)
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return []
        shared = []
        if (getattr(inner, "share_embeddings_and_output_weights", False)
                and (getattr(inner, "pre_process", False) or getattr(inner, "post_process", False))
                and parallel_state.is_rank_in_embedding_group(ignore_virtual=True)):
            shared.append(inner.shared_embedding_or_output_weight())
        position = split_position_embedding(inner)
        shared += [position] if position is not None else []
        return shared + [p for p in inner.parameters() if getattr(p, "pipeline_stack_shared", False)]

    def _grad_hook(self, param: nn.Parameter) -> None:
        if param.grad is None:
            return
        if getattr(param, "grad_added_to_main_grad", False):
            # Gradient-accumulation fusion: the linear layer's backward already added the weight
            # gradient into main_grad; .grad is its placeholder (see layers._fused_weight_grad).
            param.grad_added_to_main_grad = False
        else:
            param.main_grad.add_(param.grad)  # in the buffer's dtype (fp32 += half, computed in fp32)
        param.grad = None
        if self.ddp_config.overlap_grad_reduce and self.is_last_microbatch:
            self.param_to_bucket[param].register_grad_ready(param)

    # ------------------------------------------------------------------ Megatron's interface
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without launching any reduction."""
        previous, self.is_last_microbatch = self.is_last_microbatch, False
        try:
            yield
        finally:
            self.is_last_microbatch = previous

    def start_grad_sync(self) -> None:
        for buffer in self.all_buffers():
            for bucket in buffer.buckets:
                bucket.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Wait for (or run) every bucket's reduction: main_grad then holds the data-parallel result."""
        for buffer in self.all_buffers():
            for bucket in buffer.buckets:
                bucket.finish_grad_sync()

    def start_param_sync(self) -> None:
        """Distributed optimizer: gather every rank's updated parameter slices (asynchronously with
        overlap_param_gather: the next forward waits bucket by bucket)."""
        for buffer in self.all_buffers():
            for bucket in buffer.buckets:
                bucket.start_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every in-flight parameter all-gather (before reading the weights outside forward)."""
        for buffer in self.all_buffers():
            for bucket in buffer.buckets:
                bucket.finish_param_sync()

    @staticmethod
    def _make_param_sync_hook(buckets: List[Any]) -> Any:
        def wait_for_params(module: nn.Module, args: Any) -> None:
            for bucket in buckets:
                bucket.finish_param_sync()
        return wait_for_params

    def zero_grad_buffer(self) -> None:
        for param in self.param_to_bucket:
            param.grad = None
            param.grad_added_to_main_grad = False
        for buffer in self.all_buffers():
            buffer.reset()

    def broadcast_params(self) -> None:
        """Make every data-parallel replica start from data-parallel rank 0's weights (expert
        params: expert-data-parallel rank 0's, over the expert-data-parallel group)."""
        for param in self.module.parameters():
            expert = not getattr(param, "allreduce", True)
            group = self.expert_data_parallel_group if expert else self.data_parallel_group
            if _size(group) > 1:
                src = torch.distributed.get_global_rank(group, 0)
                communication.broadcast(param.data, src=src, group=group)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def set_input_tensor(self, input_tensor: Any) -> None:
        unwrap_model(self.module).set_input_tensor(input_tensor)


def _size(group: Optional[torch.distributed.ProcessGroup]) -> int:
    return torch.distributed.get_world_size(group) if group is not None else 1


def _trainable_params_by_kind(module: nn.Module) -> tuple[List[nn.Parameter], List[nn.Parameter]]:
    """(dense, expert) trainable params in registration order; expert: `allreduce = False`."""
    dense, experts = [], []
    for param in module.parameters():
        if param.requires_grad:
            (dense if getattr(param, "allreduce", True) else experts).append(param)
    return dense, experts


def split_position_embedding(model: nn.Module) -> Optional[nn.Parameter]:
    """The learned position table held on both sides of an encoder-decoder pipeline split (the first
    encoder and the first decoder stage), whose gradients finalize_model_grads sums; else None."""
    if (parallel_state.get_pipeline_model_parallel_world_size() == 1
            or parallel_state.get_pipeline_model_parallel_split_rank() is None):
        return None
    table = getattr(getattr(model, "embedding", None), "position_embeddings", None)
    return table.weight if table is not None else None


def _weak_method(method):
    """A function calling `method` while its object lives (then nothing), without keeping it alive."""
    reference = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = reference()
        return None if bound is None else bound(*args)

    return call
