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

Resuming (load_state_dict) follows Megatron: --override-opt_param-scheduler keeps this run's
values, --use-checkpoint-opt_param-scheduler takes the checkpoint's, and with neither the two
must agree; when they do not (typically a longer --train-iters, which moves the LR decay end),
SchedulerMismatchError lists every difference and the flags that resolve it. Unlike Megatron,
wd_incr_steps may differ under the constant weight-decay style, where it has no effect.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from megatron.core.utils import print_line

_LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
_WD_INCR_STYLES = ("constant", "linear", "cosine")


class SchedulerMismatchError(ValueError):
    """The checkpoint's schedule differs from this run's and no flag says which one to use."""


# Fields load_state_dict compares: (attribute, Megatron's name in its log lines, the flags that set it
# in iteration-based and in sample-based training).
_FIELDS = (
    ("max_lr", "learning rate", "--lr", "--lr"),
    ("min_lr", "minimum learning rate", "--min-lr", "--min-lr"),
    ("lr_warmup_steps", "warmup iterations", "--lr-warmup-iters or --lr-warmup-fraction",
     "--lr-warmup-samples or --lr-warmup-fraction"),
    ("lr_decay_steps", "total number of iterations", "--lr-decay-iters, which defaults to --train-iters",
     "--lr-decay-samples, which defaults to --train-samples"),
    ("lr_decay_style", "learning rate decay style", "--lr-decay-style", "--lr-decay-style"),
    ("start_wd", "start weight decay", "--start-weight-decay", "--start-weight-decay"),
    ("end_wd", "end weight decay", "--end-weight-decay", "--end-weight-decay"),
    ("wd_incr_steps", "total number of weight decay iterations", "--train-iters", "--train-samples"),
    ("wd_incr_style", "weight decay incr style", "--weight-decay-incr-style", "--weight-decay-incr-style"),
)
_STEP_FIELDS = ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def _print_rank_0(message: str) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print_line(message)


class OptimizerParamScheduler:
    """Anneals the learning rate and weight decay of an optimizer's param groups."""

    def __init__(self, optimizer: Any, init_lr: float, max_lr: float, min_lr: float,
                 lr_warmup_steps: int, lr_decay_steps: int, lr_decay_style: str,
                 start_wd: float, end_wd: float, wd_incr_steps: int, wd_incr_style: str,
                 use_checkpoint_opt_param_scheduler: bool = True,
                 override_opt_param_scheduler: bool = False,
                 wsd_decay_steps: int | None = None,
                 lr_wsd_decay_style: str | None = None,
                 samples_per_iteration: int | None = None) -> None:
        """Lengths are in samples. samples_per_iteration: the global batch size of iteration-based
        training (None: sample-based), used only to word the resume errors in iterations."""
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
        self.samples_per_iteration = samples_per_iteration
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
        """Megatron's rule: --override-opt_param-scheduler keeps the class (command-line) value,
        otherwise the checkpoint's value is used (load_state_dict has checked that they agree
        unless --use-checkpoint-opt_param-scheduler is set)."""
        if self.override_opt_param_scheduler:
            _print_rank_0(f" > overriding {name} value to {cls_value}")
            return cls_value
        _print_rank_0(f" > using checkpoint value {sd_value} for {name}")
        return sd_value

    @staticmethod
    def _saved_values(sd: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's schedule by attribute name (also from the keys of older Megatron versions)."""
        saved = {
            "max_lr": sd["start_lr"] if "start_lr" in sd else sd["max_lr"],
            "min_lr": sd["min_lr"],
            "lr_warmup_steps": sd.get("warmup_iter", sd.get("warmup_steps", sd.get("lr_warmup_steps"))),
            "lr_decay_steps": sd.get("end_iter", sd.get("decay_steps", sd.get("lr_decay_steps"))),
            "lr_decay_style": sd["decay_style"] if "decay_style" in sd else sd["lr_decay_style"],
        }
        if "start_wd" in sd:
            saved.update({key: sd[key] for key in ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")})
        return saved

    def _mismatches(self, saved: dict[str, Any]) -> list:
        """(attribute, this run's value, the checkpoint's) of every field that differs and matters."""
        constant_wd = self.wd_incr_style == saved.get("wd_incr_style", self.wd_incr_style) == "constant"
        return [(attr, getattr(self, attr), value) for attr, value in saved.items()
                if getattr(self, attr) != value and not (attr == "wd_incr_steps" and constant_wd)]

    def _steps(self, samples: Any) -> str:
        per_iteration = self.samples_per_iteration
        if per_iteration and isinstance(samples, (int, float)) and samples % per_iteration == 0:
            return f"{int(samples // per_iteration)} iterations ({samples} samples)"
        return f"{samples} samples"

    def _mismatch_message(self, mismatches: list) -> str:
        by_iterations = self.samples_per_iteration is not None
        parts, fixes = [], ["--use-checkpoint-opt_param-scheduler"]
        for attr, ours, theirs in mismatches:
            name, iteration_flags, sample_flags = next(row[1:] for row in _FIELDS if row[0] == attr)
            shown = self._steps if attr in _STEP_FIELDS else repr
            parts.append(f"{name}: {shown(theirs)} in the checkpoint, {shown(ours)} in this run "
                         f"({iteration_flags if by_iterations else sample_flags})")
            if attr == "lr_decay_steps":
                if by_iterations and theirs % self.samples_per_iteration == 0:
                    fixes.append(f"--lr-decay-iters {int(theirs // self.samples_per_iteration)}")
                elif not by_iterations:
                    fixes.append(f"--lr-decay-samples {theirs}")
        return ("the checkpoint's learning-rate schedule differs from this run's: " + "; ".join(parts)
                + f". To continue the checkpoint's schedule pass {' or '.join(fixes)}; to switch to this run's "
                "values from the checkpoint's step on, pass --override-opt_param-scheduler")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from a checkpoint (also reads the keys of older Megatron versions).

        Raises SchedulerMismatchError when a value differs and neither --override-opt_param-scheduler
        nor --use-checkpoint-opt_param-scheduler is set.
        """
        saved = self._saved_values(state_dict)
        if not (self.override_opt_param_scheduler or self.use_checkpoint_opt_param_scheduler):
            mismatches = self._mismatches(saved)
            if mismatches:
                raise SchedulerMismatchError(self._mismatch_message(mismatches))
        for attr, value in saved.items():
            name = next(row[1] for row in _FIELDS if row[0] == attr)
            setattr(self, attr, self._check_and_set(getattr(self, attr), value, name))
        sd = state_dict
        num_steps = sd["num_iters"] if "num_iters" in sd else sd["num_steps"]
        # Replay from 0 so the groups get the lr/wd of the restored step.
        self.num_steps = 0
        self.step(increment=num_steps)
