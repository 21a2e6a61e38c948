"""What the training loop reports: Megatron's log line, TensorBoard/W&B scalars, progress, FLOPs.

The log line (stdout of the last rank, every --log-interval iterations) is Megatron's, field for
field, with its local-time prefix (as Megatron-LM core_v0.13 prints it), e.g.

     [2025-06-01 12:00:00] iteration       10/     100 | consumed samples:           80 |
     elapsed time per iteration (ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 1.2 |
     learning rate: 1.000000E-03 | global batch size:     8 | lm loss: 5.123456E+00 |
     loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |
     number of nan iterations:   0 |

(one line in the real output). The throughput keeps Megatron's one decimal from 1 TFLOP/s up and
shows three significant digits below (0.000123 for a tiny model on a CPU), as a plain decimal.
Losses are averaged over the iterations of the interval whose update was applied; skipped
iterations (fp16 overflow) are counted instead, and iterations whose loss is inf/nan are counted as
nan iterations.

The progress line (iterations, rate, ETA) goes to stderr of the same rank, right after the log
line, as one complete line written at once, so that merged output (`2>&1 | tee log`) keeps every
line whole and parsers can skip lines starting with `progress:`.

training_log() is Megatron's function of the same name for callers that run their own loop
(Accelerate): it keeps the interval's sums in the caller's total_loss_dict and prints this log line.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.core import device
from megatron.model.transformer_config import moe_layer_numbers as _moe_layer_numbers
from megatron.training.config.architecture import ModelArchitecture
from megatron.training.global_vars import (
    get_args,
    get_num_microbatches,
    get_tensorboard_writer,
    get_timers,
    get_wandb_writer,
)
from megatron.training.utils import print_rank_last, report_memory, timestamp


def num_floating_point_operations(args: argparse.Namespace, batch_size: int) -> float:
    """Model FLOPs of one training iteration (forward + backward) on batch_size sequences: Megatron-LM
    core_v0.13's count (ModelArchitecture.num_floating_point_operations says how it is made up); a
    hybrid model (pretrain_mamba.py) by hybrid_flops, Megatron's count per layer kind."""
    if args.is_hybrid_model:
        return hybrid_flops(args, batch_size)
    return ModelArchitecture.from_args(args).num_floating_point_operations(batch_size)


def hybrid_flops(args: argparse.Namespace, batch_size: int) -> float:
    """Model FLOPs of one training iteration of a hybrid model, as Megatron-LM core_v0.13 counts them
    (3 x the forward; per sequence of s tokens, d_in = 2h, nh = --mamba-num-heads or d_in / hd):

        Mamba layer      2 s h (2 d_in + 2 ng n + nh)  in_proj,  7 s d_in n  the scan,  2 s d_in h  out_proj
        attention layer  4 s h p (h + h g / a + s / 2), p = kv channels x a / h, g groups (a without GQA)
        MLP layer        4 s h^2 (f / h) m, m = 3/2 with --swiglu
        MoE layer        4 s h m (f_moe k + f_shared), the experts a token runs (k = --moe-router-topk,
                         f_moe = --moe-ffn-hidden-size, f_shared = --moe-shared-expert-intermediate-size)
        logits           2 s h V
    """
    from megatron.training.config_builders import hybrid_pattern_from_args

    pattern = hybrid_pattern_from_args(args) or "M" * args.num_layers
    s, h = args.seq_length, args.hidden_size
    d_in, n, ng = 2 * h, args.mamba_state_dim, args.mamba_num_groups
    nh = args.mamba_num_heads or d_in // args.mamba_head_dim
    mamba = 2 * s * h * (2 * d_in + 2 * ng * n + nh) + 7 * s * d_in * n + 2 * s * d_in * h
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    p = args.kv_channels * heads / h if args.kv_channels else 1
    attention = 4 * s * h * p * (h + h * groups / heads + s / 2)
    mlp = 4 * s * h * args.ffn_hidden_size * (1.5 if args.swiglu else 1.0)
    moe = 0.0
    if "E" in pattern:
        moe_ffn = (args.moe_ffn_hidden_size or args.ffn_hidden_size) * args.moe_router_topk
        moe = 4 * s * h * (moe_ffn + (args.moe_shared_expert_intermediate_size or 0)) * (1.5 if args.swiglu else 1.0)
    forward = (pattern.count("M") * mamba + pattern.count("*") * attention + pattern.count("-") * mlp
               + pattern.count("E") * moe
               + 2 * s * h * args.padded_vocab_size)
    return 3 * batch_size * forward


def _is_bad(value: float) -> bool:
    return math.isinf(value) or math.isnan(value)


@dataclass
class IntervalStats:
    """Sums over the iterations since the last log line."""

    losses: Dict[str, float] = field(default_factory=dict)
    iterations: int = 0
    advanced: int = 0
    skipped: int = 0
    nan: int = 0

    def add(self, loss_dict: Dict[str, float], skipped: bool) -> None:
        self.iterations += 1
        bad = any(_is_bad(v) for v in loss_dict.values())
        self.nan += int(bad)
        self.skipped += int(skipped)
        if skipped or bad:
            return
        self.advanced += 1
        for key, value in loss_dict.items():
            self.losses[key] = self.losses.get(key, 0.0) + value

    def averages(self) -> Dict[str, float]:
        return {key: total / max(self.advanced, 1) for key, total in self.losses.items()}


def format_tflops(value: float) -> str:
    """The throughput field: Megatron's '{:.1f}' from 1 TFLOP/s up; below, enough decimals for three
    significant digits (never an exponent), so that a CPU or a tiny model does not read 0.0.

    12.34 -> '12.3', 0.0123 -> '0.0123', 0.000123 -> '0.000123'; 0, nan and inf as '{:.1f}' prints them."""
    if not math.isfinite(value) or value <= 0 or value >= 1:
        return "{:.1f}".format(value)
    decimals = min(2 - math.floor(math.log10(value)), 12)  # 3 significant digits; 1e-12 TFLOP/s is 1 FLOP/s
    return "{:.{}f}".format(value, decimals)


def format_log_line(*, iteration: int, train_iters: int, consumed_samples: int, ms_per_iteration: float,
                    tflops_per_gpu: float, learning_rate: float, global_batch_size: int,
                    losses: Dict[str, float], loss_scale: float, grad_norm: Optional[float],
                    num_zeros_in_grad: Optional[int], params_norm: Optional[float],
                    skipped: int, nan: int, now: Optional[str] = None) -> str:
    """Megatron's training log line; now is its ' [YYYY-MM-DD HH:MM:SS]' prefix (default: the local time)."""
    line = " [{}]".format(now if now is not None else timestamp())
    line += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    line += " consumed samples: {:12d} |".format(consumed_samples)
    line += " elapsed time per iteration (ms): {:.1f} |".format(ms_per_iteration)
    line += " throughput per GPU (TFLOP/s/GPU): {} |".format(format_tflops(tflops_per_gpu))
    line += " learning rate: {:.6E} |".format(learning_rate)
    line += " global batch size: {:5d} |".format(global_batch_size)
    for key, value in losses.items():
        line += " {}: {:.6E} |".format(key, value)
    line += " loss scale: {:.1f} |".format(loss_scale)
    if grad_norm is not None:
        line += " grad norm: {:.3f} |".format(grad_norm)
    if num_zeros_in_grad is not None:
        line += " num zeros: {:.1f} |".format(num_zeros_in_grad)
    if params_norm is not None:
        line += " params norm: {:.3f} |".format(params_norm)
    line += " number of skipped iterations: {:3d} |".format(skipped)
    line += " number of nan iterations: {:3d} |".format(nan)
    return line


def format_communication_stats(summary: Dict[Tuple[str, str], Tuple[int, int]], iterations: int) -> str:
    """' communication per iteration: all_reduce tp: 8 calls, 65536 bytes | ...' (--log-communication-stats).

    summary: {(op, group): (calls, bytes)} over `iterations` iterations; bytes are those of the
    full tensors (the input of an all-reduce or reduce-scatter, the output of an all-gather).
    """
    parts = [f"{op} {group}: {calls / iterations:g} calls, {nbytes / iterations:.0f} bytes"
             for (op, group), (calls, nbytes) in summary.items()]
    return " communication per iteration: " + (" | ".join(parts) if parts else "none")


def format_validation_line(prefix: str, losses: Dict[str, float]) -> str:
    """'validation loss at <prefix> | lm loss value: X | lm loss PPL: Y | ' (PPL of min(loss, 20))."""
    line = f" validation loss at {prefix} | "
    for key, value in losses.items():
        line += "{} value: {:.6E} | ".format(key, value)
        line += "{} PPL: {:.6E} | ".format(key, math.exp(min(20.0, value)))
    return line


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Iterations done, rate and ETA, for a person watching: one line on the last rank's stderr.

    report() is called right after the log line on every rank; only the last rank (the one that
    prints the log line) writes, terminal or not, the whole line in one write.
    """

    def __init__(self, start_iteration: int, train_iters: int, stream: Any = None) -> None:
        self.start_iteration = start_iteration
        self.train_iters = train_iters
        self.start_time = time.time()
        self.stream = stream  # None: sys.stderr at the time of the report

    def line(self, iteration: int) -> str:
        elapsed = time.time() - self.start_time
        done = iteration - self.start_iteration
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.train_iters - iteration) / rate if rate > 0 else float("inf")
        percent = 100.0 * iteration / max(self.train_iters, 1)
        eta_text = _clock(eta) if math.isfinite(eta) else "?"
        return (f"progress: {iteration}/{self.train_iters} iterations ({percent:.1f}%) | "
                f"elapsed {_clock(elapsed)} | ETA {eta_text} | {rate:.2f} it/s")

    def report(self, iteration: int) -> None:
        print_rank_last(self.line(iteration), stream=self.stream or sys.stderr)


def write_scalars(writer: Any, wandb: Any, scalars: Dict[str, float], iteration: int,
                  consumed_samples: int) -> None:
    """TensorBoard scalars by iteration and, as Megatron, '<name> vs samples'; W&B by iteration."""
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, iteration)
            writer.add_scalar(f"{name} vs samples", value, consumed_samples)
    if wandb is not None:
        wandb.log(dict(scalars), step=iteration)


def log_validation(prefix: str, losses: Dict[str, float], iteration: int, consumed_samples: int,
                   writer: Any = None, wandb: Any = None) -> None:
    """Print the validation block (dashes, line, dashes) and write the scalars."""
    line = format_validation_line(prefix, losses)
    dashes = "-" * (len(line) + 1)
    print_rank_last(dashes)
    print_rank_last(line)
    print_rank_last(dashes)
    scalars = {}
    for key, value in losses.items():
        scalars[f"{key} validation"] = value
        scalars[f"{key} validation ppl"] = math.exp(min(20.0, value))
    write_scalars(writer, wandb, scalars, iteration, consumed_samples)


def log_timers_and_memory(iteration: int, iterations: int) -> None:
    """--timing-log-level >= 1: Megatron's timers block (the mean over `iterations`);
    --log-timers-to-tensorboard and --log-memory-to-tensorboard."""
    args = get_args()
    timers = get_timers()
    names = ("forward-backward", "optimizer")
    if args.timing_log_level >= 1:
        seconds = {name: timers(name, log_level=1).elapsed(reset=True) / iterations for name in names}
        print_rank_last("(min, max) time across ranks (ms):\n" + "\n".join(
            f"    {name + ' ':.<40}: ({1000 * t:.2f}, {1000 * t:.2f})" for name, t in seconds.items()))
        if args.log_timers_to_tensorboard:
            write_scalars(get_tensorboard_writer(), get_wandb_writer(),
                          {f"{name}-time": t for name, t in seconds.items()}, iteration, args.consumed_train_samples)
    if args.log_memory_to_tensorboard:  # accelerator memory; a CPU has none to report
        stats = device.memory_stats()
        write_scalars(get_tensorboard_writer(), get_wandb_writer(),
                      {f"mem-{key}": float(value) for key, value in stats.items()}, iteration,
                      args.consumed_train_samples)


# ------------------------------------------------------------------------------ Megatron's training_log

# The counters Megatron keeps in total_loss_dict beside the loss sums.
ADVANCED_ITERS, SKIPPED_ITERS, NAN_ITERS = "advanced iterations", "skipped iterations", "nan iterations"


def _accumulate(total_loss_dict: Dict[str, Any], loss_dict: Dict[str, Any], skipped: bool) -> None:
    """Add one iteration to the interval's sums, as IntervalStats does: a skipped iteration or one
    with an inf/nan loss is counted (skipped / nan) and its losses left out of the averages."""
    values = {key: float(torch.as_tensor(value).float().sum()) for key, value in loss_dict.items()}
    bad = any(_is_bad(v) for v in values.values())
    for key in (ADVANCED_ITERS, SKIPPED_ITERS, NAN_ITERS):
        total_loss_dict.setdefault(key, 0)
    total_loss_dict[SKIPPED_ITERS] += int(bool(skipped))
    total_loss_dict[NAN_ITERS] += int(bad)
    if skipped or bad:
        return
    total_loss_dict[ADVANCED_ITERS] += 1
    for key, value in values.items():
        total_loss_dict[key] = total_loss_dict.get(key, 0.0) + value


def training_log(loss_dict: Dict[str, Any], total_loss_dict: Dict[str, Any], learning_rate: Optional[float],
                 iteration: int, loss_scale: float, report_memory_flag: bool, skipped_iter: int,
                 grad_norm: Optional[float], params_norm: Optional[float], num_zeros_in_grad: Optional[int],
                 max_attention_logit: Optional[float] = None, pg_collection: Any = None,
                 is_first_iteration: bool = False) -> bool:
    """Megatron's training_log (core_v0.16+ arguments, which Accelerate 1.16 passes positionally up to
    num_zeros_in_grad); returns report_memory_flag, False once memory was reported.

    Adds the iteration to total_loss_dict (Megatron's 'advanced / skipped / nan iterations' counters
    and a sum per loss name), writes the TensorBoard / W&B scalars every --tensorboard-log-interval,
    and every --log-interval (and on is_first_iteration, without resetting) prints this project's log
    line with the interval's averages, then Megatron's memory report once while report_memory_flag
    is set, and the timers block. The interval's time is the 'interval-time' timer's, which Megatron's
    train() starts before its loop; a caller that did not start it has it started at its first call.
    max_attention_logit is written to TensorBoard when given; pg_collection (Megatron's process groups
    object) has no counterpart here: the groups are parallel_state's.
    """
    args = get_args()
    timer = get_timers()("interval-time")
    if not timer.running:
        timer.start()
    _accumulate(total_loss_dict, loss_dict, bool(skipped_iter))
    batch_size = args.micro_batch_size * args.data_parallel_size * get_num_microbatches()
    writer, wandb = get_tensorboard_writer(), get_wandb_writer()
    if (writer is not None or wandb is not None) and iteration % args.tensorboard_log_interval == 0:
        scalars = {"learning-rate": learning_rate, "batch-size": float(batch_size), "loss-scale": loss_scale}
        scalars.update({key: float(torch.as_tensor(value).float().sum()) for key, value in loss_dict.items()})
        optional = {"grad-norm": grad_norm, "num-zeros": num_zeros_in_grad, "params-norm": params_norm,
                    "max_attention_logit": max_attention_logit}
        scalars.update({name: float(value) for name, value in optional.items() if value is not None})
        write_scalars(writer, wandb, {k: v for k, v in scalars.items() if v is not None and not _is_bad(v)},
                      iteration, args.consumed_train_samples)
    if iteration % args.log_interval != 0 and not is_first_iteration:
        return report_memory_flag
    reset = not is_first_iteration
    iterations = max(total_loss_dict[ADVANCED_ITERS] + total_loss_dict[SKIPPED_ITERS], 1)
    seconds = timer.elapsed(reset=reset) / iterations
    flops = num_floating_point_operations(args, batch_size)
    advanced = max(total_loss_dict[ADVANCED_ITERS], 1)
    losses = {key: value / advanced for key, value in total_loss_dict.items()
              if key not in (ADVANCED_ITERS, SKIPPED_ITERS, NAN_ITERS)}
    print_rank_last(format_log_line(
        iteration=iteration, train_iters=args.train_iters, consumed_samples=args.consumed_train_samples,
        ms_per_iteration=seconds * 1000.0,
        tflops_per_gpu=flops / (seconds * 1e12 * args.world_size) if seconds > 0 else 0.0,
        learning_rate=learning_rate if learning_rate is not None else 0.0, global_batch_size=batch_size,
        losses=losses, loss_scale=loss_scale, grad_norm=grad_norm, num_zeros_in_grad=num_zeros_in_grad,
        params_norm=params_norm, skipped=total_loss_dict[SKIPPED_ITERS], nan=total_loss_dict[NAN_ITERS]))
    if reset:  # the next interval starts empty (Megatron zeroes its sums and hides zero averages)
        for key in list(total_loss_dict):
            if key in (ADVANCED_ITERS, SKIPPED_ITERS, NAN_ITERS):
                total_loss_dict[key] = 0
            else:
                del total_loss_dict[key]
    if report_memory_flag:
        report_memory(f"(after {iteration} iterations)")
        report_memory_flag = False
    log_timers_and_memory(iteration, iterations)
    return report_memory_flag


# ------------------------------------------------------------------------------ mixture of experts

def moe_loss_names(args: argparse.Namespace) -> List[str]:
    """The balancing losses an MoE run records and logs (Megatron's names), in a fixed order."""
    names = []
    if args.moe_aux_loss_coeff and args.moe_router_load_balancing_type == "aux_loss":
        names.append("load_balancing_loss")
    if args.moe_aux_loss_coeff and args.moe_router_load_balancing_type == "seq_aux_loss":
        names.append("seq_load_balancing_loss")
    if args.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def moe_layer_numbers(args: argparse.Namespace) -> List[int]:
    """The 1-based numbers of the MoE layers (--moe-layer-freq; a hybrid model's E layers), as the model
    places them."""
    if args.is_hybrid_model:
        from megatron.training.config_builders import hybrid_pattern_from_args

        pattern = hybrid_pattern_from_args(args) or ""
        return [i + 1 for i, symbol in enumerate(pattern) if symbol == "E"]
    return _moe_layer_numbers(args.moe_layer_freq, args.num_layers)


@dataclass
class MoEInterval:
    """Per-layer sums since the last log line: losses (each iteration's value) and token counts."""

    iterations: int = 0
    losses: Dict[str, Any] = field(default_factory=dict)  # name -> [L] tensor
    routed: Any = None  # [L, E]
    kept: Any = None

    def add(self, stats: Any) -> None:
        self.iterations += 1
        for name, values in stats.losses.items():
            self.losses[name] = values.clone() if name not in self.losses else self.losses[name] + values
        if stats.routed is not None:
            self.routed = stats.routed.clone() if self.routed is None else self.routed + stats.routed
            self.kept = stats.kept.clone() if self.kept is None else self.kept + stats.kept


def moe_log_lines(interval: MoEInterval, layers: List[int], per_layer: bool, drop_threshold: float) -> List[str]:
    """The per-layer lines (--moe-per-layer-logging) and the warnings: an expert that got no token in
    the interval, a layer that dropped more than drop_threshold of its routed tokens."""
    lines = []
    n = max(interval.iterations, 1)
    for layer in layers:
        i = layer - 1
        routed = interval.routed[i] if interval.routed is not None else None
        kept = interval.kept[i] if interval.kept is not None else None
        if per_layer:
            line = f" moe layer {layer}:"
            for name, values in interval.losses.items():
                line += " {}: {:.6E} |".format(name, float(values[i]) / n)
            if routed is not None:
                dropped = 1.0 - float(kept.sum()) / max(float(routed.sum()), 1.0)
                line += " tokens per expert: [{}] | dropped: {:.2%} |".format(
                    ", ".join(str(int(v)) for v in routed.tolist()), dropped)
            lines.append(line)
        if routed is None:
            continue
        starved = [e for e, v in enumerate(routed.tolist()) if v == 0]
        if starved:
            lines.append(f"WARNING: MoE layer {layer}: expert(s) {starved} received no tokens in the last {n} "
                         "iteration(s)")
        total = float(routed.sum())
        dropped = 1.0 - float(kept.sum()) / total if total else 0.0
        if dropped > drop_threshold:
            lines.append(f"WARNING: MoE layer {layer} dropped {dropped:.1%} of its routed tokens in the last {n} "
                         f"iteration(s) (over --moe-drop-warning-threshold {drop_threshold})")
    return lines
