"""Gradient handling across micro-batches and ranks (data parallelism joins with its issue)."""
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.fp32_grad_accumulation import enable_fp32_grad_accumulation, zero_main_grads

__all__ = ["enable_fp32_grad_accumulation", "finalize_model_grads", "zero_main_grads"]
