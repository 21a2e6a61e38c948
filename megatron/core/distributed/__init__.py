"""Gradient handling across micro-batches (and, with the data-parallel issue, across ranks)."""
from megatron.core.distributed.fp32_grad_accumulation import enable_fp32_grad_accumulation, zero_main_grads

__all__ = ["enable_fp32_grad_accumulation", "zero_main_grads"]
