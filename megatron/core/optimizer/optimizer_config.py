"""OptimizerConfig: everything the optimizer needs, with Megatron's field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class OptimizerConfig:
    """Optimizer, precision and loss-scaling settings (built from the CLI by
    megatron.training.arguments.optimizer_config_from_args)."""

    optimizer: str = "adam"
    """'adam' (AdamW when decoupled_weight_decay) or 'sgd'."""
    lr: float | None = None
    """Initial learning rate; the OptimizerParamScheduler overwrites it every step."""
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    loss_scale: float | None = None
    """Constant loss scale; None = dynamic loss scaling (fp16 only)."""
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    clip_grad: float = 1.0
    """Clip on the global L2 norm of the gradients; 0 disables clipping."""
    log_num_zeros_in_grad: bool = False
    decoupled_weight_decay: bool = True
    """Adam with decoupled weight decay (torch AdamW), as apex FusedAdam's adam_w_mode."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 are mutually exclusive")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"loss_scale must be positive, got {self.loss_scale}")
        if self.lr is not None and self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
