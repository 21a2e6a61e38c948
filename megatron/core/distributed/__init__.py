"""Gradient handling across micro-batches and data-parallel ranks.

DistributedDataParallel wraps each model chunk: contiguous grad buffers (param.main_grad),
buckets reduced over the data-parallel group (overlapped with backward on request), and the
sharded layout the distributed optimizer steps. finalize_model_grads runs the reductions
after the last micro-batch.
"""
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.param_and_grad_buffer import DistributedDataParallelConfig, ParamAndGradBuffer

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "ParamAndGradBuffer", "finalize_model_grads"]
