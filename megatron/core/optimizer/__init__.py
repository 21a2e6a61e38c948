"""Optimizers for Megatron models: param groups, precision wrappers, loss scaling, clipping.

get_megatron_optimizer(config, model_chunks) is the entry point: it splits the params into
groups (no weight decay on biases and 1-D params such as norm weights), builds torch AdamW/Adam
or SGD on them, and wraps that in FP32Optimizer or, for --fp16/--bf16,
Float16OptimizerWithFloat16Params with the matching loss scaler. Model chunks wrapped in
DistributedDataParallel with use_distributed_optimizer get a DistributedOptimizer instead (any
precision), which steps only this data-parallel rank's shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    clip_grad_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    MegatronGradScaler,
)
from megatron.core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
    expert_params_on_any_stage,
)
from megatron.core.optimizer.memory import optimizer_memory_per_parameter
from megatron.core.optimizer.optimizer_config import OptimizerConfig

__all__ = [
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "clip_grad_by_total_norm_fp32",
    "clip_grad_norm_fp32",
    "count_zeros_fp32",
    "get_grad_norm_fp32",
    "get_megatron_optimizer",
    "get_param_groups",
    "optimizer_memory_per_parameter",
]

ParamCond = Callable[[str, nn.Parameter], bool]


def get_param_groups(model_chunks: Sequence[nn.Module], no_weight_decay_cond: ParamCond | None = None,
                     scale_lr_cond: ParamCond | None = None, lr_mult: float = 1.0,
                     lr: float = 0.0, weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """Megatron's param groups, one per (wd_mult, lr_mult, is_expert_parallel).

    By default biases and 1-D params (norm weights) get wd_mult 0.0; params for which
    scale_lr_cond(name, param) is true get lr_mult. A param shared by several modules or
    chunks (tied embeddings) appears once. Each group also starts with 'lr' = lr * lr_mult and
    'weight_decay' = weight_decay * wd_mult, which the scheduler then keeps up to date.
    """
    groups: dict[tuple[float, float, bool], list[nn.Parameter]] = {}
    seen = set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if no_weight_decay_cond is not None:
                no_wd = no_weight_decay_cond(name, param)
            else:
                # Do not regularize biases and norm parameters.
                no_wd = name.endswith(".bias") or param.ndim == 1
            scale_lr = scale_lr_cond(name, param) if scale_lr_cond is not None else False
            is_expert_parallel = not getattr(param, "allreduce", True)
            key = (0.0 if no_wd else 1.0, lr_mult if scale_lr else 1.0, is_expert_parallel)
            groups.setdefault(key, []).append(param)
    return [{"params": params, "wd_mult": wd_mult, "lr_mult": group_lr_mult,
             "is_expert_parallel": is_expert_parallel, "lr": lr * group_lr_mult,
             "weight_decay": weight_decay * wd_mult}
            for (wd_mult, group_lr_mult, is_expert_parallel), params in groups.items()]


def _fused_adam_applies(param_groups: list[dict[str, Any]]) -> bool:
    """torch's fused Adam kernel (one pass per tensor over param, grad and both moments; Megatron
    uses apex's FusedAdam on GPUs) takes floating-point params on CPU or CUDA (the wrappers swap
    half-precision ones for their fp32 main copies afterwards). Same update as torch's default,
    to rounding; on CPU that default is a Python loop of ~10 ops per tensor."""
    params = [p for group in param_groups for p in group["params"]]
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def _build_torch_optimizer(config: OptimizerConfig, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    lr = config.lr if config.lr is not None else 0.0
    if config.optimizer == "adam":
        adam_cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        return adam_cls(param_groups, lr=lr, weight_decay=config.weight_decay,
                        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                        fused=_fused_adam_applies(param_groups) or None)
    if config.optimizer == "sgd":
        return torch.optim.SGD(param_groups, lr=lr, weight_decay=config.weight_decay,
                               momentum=config.sgd_momentum)
    raise ValueError(f"{config.optimizer} optimizer is not supported.")


def _build_grad_scaler(config: OptimizerConfig) -> MegatronGradScaler | None:
    """Constant scaler for --loss-scale, dynamic for fp16, none for bf16 (Megatron's choice)."""
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                                 growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=config.loss_scale_window, hysteresis=config.hysteresis)
    return None


def _chunks_use_distributed_optimizer(model_chunks: Sequence[nn.Module]) -> bool:
    """Whether the chunks were wrapped in DistributedDataParallel(use_distributed_optimizer=True)."""
    flags = [isinstance(chunk, DistributedDataParallel) and chunk.ddp_config.use_distributed_optimizer
             for chunk in model_chunks]
    if any(flags) and not all(flags):
        raise ValueError("some model chunks use the distributed optimizer's buffers and some do not")
    return bool(flags) and all(flags)


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: nn.Module | Sequence[nn.Module],
                           no_weight_decay_cond: ParamCond | None = None,
                           scale_lr_cond: ParamCond | None = None,
                           lr_mult: float = 1.0,
                           use_distributed_optimizer: bool | None = None) -> MegatronOptimizer:
    """Build the optimizer for a model given as a list of chunks (a bare module is accepted).

    use_distributed_optimizer: None follows the chunks (DistributedDataParallel built with
    use_distributed_optimizer=True gets a DistributedOptimizer); True/False must agree with them,
    since the sharded buffers and the plain optimizers cannot be mixed.
    """
    if isinstance(model_chunks, nn.Module):
        model_chunks = [model_chunks]
    sharded = _chunks_use_distributed_optimizer(model_chunks)
    if use_distributed_optimizer is not None and use_distributed_optimizer != sharded:
        raise ValueError(f"use_distributed_optimizer={use_distributed_optimizer}, but the model chunks were "
                         f"{'' if sharded else 'not '}wrapped in DistributedDataParallel with "
                         "use_distributed_optimizer=True")
    lr = config.lr if config.lr is not None else 0.0
    param_groups = get_param_groups(model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult,
                                    lr=lr, weight_decay=config.weight_decay)
    optimizer = _build_torch_optimizer(config, param_groups)
    groups = _norm_groups(param_groups)
    if sharded:
        return DistributedOptimizer(optimizer, config, _build_grad_scaler(config), model_chunks, *groups)
    if config.fp16 or config.bf16:
        return Float16OptimizerWithFloat16Params(optimizer, config, _build_grad_scaler(config), *groups)
    return FP32Optimizer(optimizer, config, *groups)


def _norm_groups(param_groups: list[dict[str, Any]]) -> tuple[Any, Any, bool]:
    """(model-parallel group, expert tensor-model-pipeline group or None, whether any pipeline
    stage holds expert params): the groups the grad norm, zero count and found_inf reduce over."""
    local = any(group["is_expert_parallel"] for group in param_groups)
    has_experts = expert_params_on_any_stage(local)
    expert_group = parallel_state.get_expert_tensor_model_pipeline_parallel_group() if has_experts else None
    return parallel_state.get_model_parallel_group(), expert_group, has_experts
