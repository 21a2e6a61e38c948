"""Learning-rate warmup/decay and weight-decay increment, with Megatron's semantics.

Steps are counted in samples: the trainer calls step(increment=global_batch_size) once per
iteration, and the warmup/decay lengths are given in samples too.

    num_steps <= warmup (warmup > 0)  lr = init_lr + (max_lr - init_lr) * num_steps / warmup
    constant                          lr = max_lr
    num_steps > decay_steps           lr = min_lr
    inverse-square-root               lr = max(min_lr, max_lr * sqrt(max(warmup, 1)) / sqrt(num_steps))
    otherwise, with r = (num_steps - warmup) / (decay_steps - warmup):
        linear  coeff = 1 - r             cosine  coeff = (cos(pi r) + 1) / 2
        WSD     coeff = 1 until decay_steps - wsd_decay_steps, then with the annealing ratio a:
                exponential 2 * 0.5**a - 1, linear 1 - a, cosine (cos(pi a) + 1) / 2, minus_sqrt 1 - sqrt(a)
        lr = min_lr + coeff * (max_lr - min_lr)

Weight decay goes from start_wd to end_wd over wd_incr_steps (constant | linear | cosine).
Each param group gets lr * group['lr_mult'] and wd * group['wd_mult'].
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

_LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
_WD_INCR_STYLES = ("constant", "linear", "cosine")


def _print_rank_0(message: str) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(message, flush=True)


class OptimizerParamScheduler:
    """Anneals the learning rate and weight decay of an optimizer's param groups."""

    def __init__(self, optimizer: Any, init_lr: float, max_lr: float, min_lr: float,
                 lr_warmup_steps: int, lr_decay_steps: int, lr_decay_style: str,
                 start_wd: float, end_wd: float, wd_incr_steps: int, wd_incr_style: str,
                 use_checkpoint_opt_param_scheduler: bool = True,
                 override_opt_param_scheduler: bool = False,
                 wsd_decay_steps: int | None = None,
                 lr_wsd_decay_style: str | None = None) -> None:
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.num_steps = 0
        self.lr_decay_steps = lr_decay_steps
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.lr_decay_style = lr_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self._validate()
        # Set the learning rate for step 0.
        self.step(0)
        _print_rank_0(f"> learning rate decay style: {self.lr_decay_style}")

    def _validate(self) -> None:
        checks = [
            (self.min_lr >= 0.0, f"min_lr ({self.min_lr}) must be >= 0"),
            (self.max_lr >= self.min_lr, f"max_lr ({self.max_lr}) must be >= min_lr ({self.min_lr})"),
            (self.init_lr <= self.max_lr, f"init_lr ({self.init_lr}) must be <= max_lr ({self.max_lr})"),
            (self.lr_decay_steps > 0, f"lr_decay_steps ({self.lr_decay_steps}) must be positive"),
            (self.lr_warmup_steps < self.lr_decay_steps,
             f"lr_warmup_steps ({self.lr_warmup_steps}) must be < lr_decay_steps ({self.lr_decay_steps})"),
            (self.lr_decay_style in _LR_DECAY_STYLES,
             f"lr_decay_style {self.lr_decay_style!r} is not one of {_LR_DECAY_STYLES}"),
            (self.start_wd >= 0.0, f"start_wd ({self.start_wd}) must be >= 0"),
            (self.end_wd >= self.start_wd, f"end_wd ({self.end_wd}) must be >= start_wd ({self.start_wd})"),
            (self.wd_incr_style in _WD_INCR_STYLES,
             f"wd_incr_style {self.wd_incr_style!r} is not one of {_WD_INCR_STYLES}"),
            (self.wd_incr_style != "constant" or self.start_wd == self.end_wd,
             f"wd_incr_style 'constant' needs start_wd == end_wd ({self.start_wd} != {self.end_wd})"),
            (not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
             "both override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are set"),
        ]
        if self.lr_decay_style == "WSD":
            checks += [
                (self.wsd_decay_steps is not None and 0 < self.wsd_decay_steps <= self.lr_decay_steps,
                 (f"WSD needs 0 < wsd_decay_steps ({self.wsd_decay_steps}) <= lr_decay_steps "
                  f"({self.lr_decay_steps})")),
                (self.lr_wsd_decay_style in _WSD_DECAY_STYLES,
                 f"lr_wsd_decay_style {self.lr_wsd_decay_style!r} is not one of {_WSD_DECAY_STYLES}"),
            ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"OptimizerParamScheduler: {message}")

    def get_wd(self) -> float:
        """Weight decay at the current step."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = incr_ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def _wsd_coeff(self) -> float:
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if self.num_steps <= anneal_start:
            return 1.0
        ratio = float(self.num_steps - anneal_start) / float(self.wsd_decay_steps)
        if self.lr_wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.lr_wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.lr_wsd_decay_style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        return 1.0 - math.sqrt(ratio)  # minus_sqrt

    def get_lr(self, param_group: dict[str, Any]) -> float:
        """Learning rate at the current step (before the group's lr_mult); a group may carry
        its own 'max_lr' / 'min_lr'."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            return max(min_lr, max_lr * warmup_steps ** 0.5 / num_steps ** 0.5)
        decay_ratio = float(self.num_steps - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD
            coeff = self._wsd_coeff()
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        """Advance by `increment` samples and set every group's 'lr' and 'weight_decay'."""
        self.num_steps += increment
        new_wd = self.get_wd()
        for param_group in self.optimizer.param_groups:
            new_lr = self.get_lr(param_group)
            param_group["lr"] = new_lr * param_group.get("lr_mult", 1.0)
            param_group["weight_decay"] = new_wd * param_group.get("wd_mult", 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value: Any, sd_value: Any, name: str) -> Any:
        """Megatron's rule: --override-opt_param-scheduler keeps the class (command-line) value;
        otherwise the checkpoint's value is used, and unless --use-checkpoint-opt_param-scheduler
        is set the two must agree."""
        if self.override_opt_param_scheduler:
            _print_rank_0(f" > overriding {name} value to {cls_value}")
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(
                f"OptimizerParamScheduler: class input value {cls_value} and checkpoint value "
                f"{sd_value} for {name} do not match (use --override-opt_param-scheduler or "
                f"--use-checkpoint-opt_param-scheduler to choose)")
        _print_rank_0(f" > using checkpoint value {sd_value} for {name}")
        return sd_value

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from a checkpoint (also reads the keys of older Megatron versions)."""
        sd = state_dict
        max_lr = sd["start_lr"] if "start_lr" in sd else sd["max_lr"]
        self.max_lr = self._check_and_set(self.max_lr, max_lr, "learning rate")
        self.min_lr = self._check_and_set(self.min_lr, sd["min_lr"], "minimum learning rate")
        warmup = sd.get("warmup_iter", sd.get("warmup_steps", sd.get("lr_warmup_steps")))
        self.lr_warmup_steps = self._check_and_set(self.lr_warmup_steps, warmup, "warmup iterations")
        decay = sd.get("end_iter", sd.get("decay_steps", sd.get("lr_decay_steps")))
        self.lr_decay_steps = self._check_and_set(self.lr_decay_steps, decay, "total number of iterations")
        style = sd["decay_style"] if "decay_style" in sd else sd["lr_decay_style"]
        self.lr_decay_style = self._check_and_set(self.lr_decay_style, style, "learning rate decay style")
        if "start_wd" in sd:
            self.start_wd = self._check_and_set(self.start_wd, sd["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, sd["end_wd"], "end weight decay")
            self.wd_incr_steps = self._check_and_set(self.wd_incr_steps, sd["wd_incr_steps"],
                                                     "total number of weight decay iterations")
            self.wd_incr_style = self._check_and_set(self.wd_incr_style, sd["wd_incr_style"],
                                                     "weight decay incr style")
        num_steps = sd["num_iters"] if "num_iters" in sd else sd["num_steps"]
        # Replay from 0 so the groups get the lr/wd of the restored step.
        self.num_steps = 0
        self.step(increment=num_steps)
