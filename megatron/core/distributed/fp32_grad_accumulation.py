"""Accumulate the gradients of half-precision parameters in fp32 (`param.main_grad`).

With --bf16 (and --fp16 with --accumulate-allreduce-grads-in-fp32), Megatron sums the
micro-batch gradients of each parameter in an fp32 buffer, not in the parameter's own dtype:
adding eight bf16 gradients in bf16 loses most of their low bits. Here every such parameter gets
an fp32 `main_grad`; a hook run after each backward adds the fresh `.grad` into it and frees
`.grad`. The optimizer reads `main_grad` when it is there.
"""

from __future__ import annotations

import torch
from torch import nn


def _accumulate(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)  # fp32 += half, computed in fp32
    param.grad = None


def enable_fp32_grad_accumulation(module: nn.Module) -> int:
    """Give each trainable non-fp32 parameter of module an fp32 main_grad; returns how many."""
    count = 0
    for param in module.parameters():
        if not param.requires_grad or param.dtype == torch.float32 or hasattr(param, "main_grad"):
            continue
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        param.register_post_accumulate_grad_hook(_accumulate)
        count += 1
    return count


def zero_main_grads(module: nn.Module) -> None:
    """Reset the fp32 accumulators before the next global batch."""
    for param in module.parameters():
        main_grad = getattr(param, "main_grad", None)
        if main_grad is not None:
            main_grad.zero_()
