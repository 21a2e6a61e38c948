"""Number of micro-batches per iteration: constant, or growing with --rampup-batch-size.

    num_micro_batches = current_global_batch_size // (micro_batch_size * data_parallel_size)

With `--rampup-batch-size start incr ramp_samples` the global batch size starts at `start` and
grows by `incr` each time another ramp_samples / ((gbs - start) / incr) samples are consumed,
reaching --global-batch-size once more than ramp_samples samples have been consumed:

    gbs(consumed) = start + int(consumed / (ramp_samples / num_increments)) * incr   (consumed <= ramp)
                  = global_batch_size                                               (consumed >  ramp)

The process-wide calculator of a run sits here under Megatron-core's names
(init_num_microbatches_calculator, get_num_microbatches, update_num_microbatches, ...), so the
schedules and outside callers such as Accelerate read it without the framework's global args.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Optional

from megatron.core.utils import print_line


class NumMicroBatchesCalculator(ABC):
    """Holds the current global batch size and the number of micro-batches it makes."""

    def __init__(self) -> None:
        self.num_micro_batches: int = 0
        self.current_global_batch_size: int = 0

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    @abstractmethod
    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        """Recompute for the number of samples consumed so far."""


class ConstantNumMicroBatches(NumMicroBatchesCalculator):
    """global_batch_size / (micro_batch_size * data_parallel_size), fixed for the whole run."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> None:
        super().__init__()
        self.micro_batch_size = micro_batch_size
        micro_batch_times_data_parallel = micro_batch_size * data_parallel_size
        if micro_batch_times_data_parallel <= 0 or global_batch_size % micro_batch_times_data_parallel != 0:
            raise ValueError(
                f"global batch size ({global_batch_size}) is not divisible by micro batch size "
                f"({micro_batch_size}) times data parallel size ({data_parallel_size})")
        self.num_micro_batches = global_batch_size // micro_batch_times_data_parallel
        if self.num_micro_batches < 1:
            raise ValueError(f"number of micro-batches should be at least 1, got {self.num_micro_batches}")
        self.current_global_batch_size = global_batch_size

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        return None


class RampupBatchsizeNumMicroBatches(NumMicroBatchesCalculator):
    """Global batch size growing linearly in samples from start_batch_size to global_batch_size."""

    def __init__(self, start_batch_size: int, batch_size_increment: int, ramup_samples: int,
                 global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> None:
        super().__init__()
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        diff_batch_size = global_batch_size - start_batch_size
        checks = [
            (self.micro_batch_times_data_parallel_size > 0, "micro batch size times data parallel size must be positive"),
            (start_batch_size > 0, f"start batch size ({start_batch_size}) must be positive"),
            (diff_batch_size >= 0, f"start batch size ({start_batch_size}) exceeds global batch size ({global_batch_size})"),
            (batch_size_increment > 0, f"batch size increment ({batch_size_increment}) must be positive"),
            (ramup_samples >= 0, f"ramp-up samples ({ramup_samples}) must not be negative"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"--rampup-batch-size: {message}")
        if diff_batch_size % batch_size_increment != 0:
            raise ValueError(
                f"--rampup-batch-size: expected global batch size interval ({diff_batch_size}) to be "
                f"divisible by global batch size increment ({batch_size_increment})")
        self.start_batch_size = start_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        self.global_batch_size = global_batch_size
        num_increments = diff_batch_size // batch_size_increment
        # start == global: nothing to ramp (Megatron would divide by zero here).
        self.rampup_samples_per_increment: float | None = (
            ramup_samples / num_increments if num_increments > 0 else None)
        self.update(0, False)

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        # No increments, or ramp_samples == 0: the ramp is over before it starts.
        ramp_done = not self.rampup_samples_per_increment or consumed_samples > self.ramup_samples
        if ramp_done:
            self.current_global_batch_size = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            self.current_global_batch_size = min(
                self.start_batch_size + steps * self.batch_size_increment, self.global_batch_size)
        if consistency_check and self.current_global_batch_size % self.micro_batch_times_data_parallel_size != 0:
            raise ValueError(
                f"current global batch size ({self.current_global_batch_size}) is not divisible by "
                f"micro-batch-size ({self.micro_batch_size}) times data parallel size "
                f"({self.data_parallel_size})")
        self.num_micro_batches = self.current_global_batch_size // self.micro_batch_times_data_parallel_size


def _parse_rampup(rampup_batch_size: Sequence) -> list[int]:
    if len(rampup_batch_size) != 3:
        raise ValueError("expected the following format: --rampup-batch-size <start batch size> "
                         "<batch size incerement> <ramp-up samples>")
    return [int(value) for value in rampup_batch_size]


def build_num_microbatches_calculator(rank: int, rampup_batch_size: Sequence | None,
                                      global_batch_size: int, micro_batch_size: int,
                                      data_parallel_size: int) -> NumMicroBatchesCalculator:
    """A constant calculator, or a ramp-up one when rampup_batch_size = [start, incr, samples]."""
    if rampup_batch_size is None:
        calculator: NumMicroBatchesCalculator = ConstantNumMicroBatches(
            global_batch_size, micro_batch_size, data_parallel_size)
        if rank == 0:
            print_line(f"setting number of micro-batches to constant {calculator.get()}")
        return calculator
    start, increment, ramp_samples = _parse_rampup(rampup_batch_size)
    if rank == 0:
        print_line(f"will use batch size rampup starting from global batch size {start} to global batch "
                   f"size {global_batch_size} with batch size increments {increment} over {ramp_samples} "
                   "samples.")
    return RampupBatchsizeNumMicroBatches(start, increment, ramp_samples, global_batch_size,
                                          micro_batch_size, data_parallel_size)


def get_train_iters_for_samples(train_samples: int, rampup_batch_size: Sequence | None,
                                global_batch_size: int) -> int:
    """Iterations to train for --train-samples (Megatron's update_train_iters).

    Without ramp-up: train_samples // global_batch_size. With it: one iteration per ramp-up
    batch while the consumed samples are within both the ramp and train_samples (so the last
    ramp batch may overshoot train_samples, as in Megatron), then whole global batches only.
    """
    if rampup_batch_size is None:
        return train_samples // global_batch_size
    start, increment, ramp_samples = _parse_rampup(rampup_batch_size)
    # The batch-size sequence does not depend on micro-batch or data-parallel size.
    calculator = RampupBatchsizeNumMicroBatches(start, increment, ramp_samples, global_batch_size, 1, 1)
    iterations = 0
    consumed_samples = 0
    while consumed_samples <= ramp_samples and consumed_samples <= train_samples:
        calculator.update(consumed_samples, consistency_check=False)
        consumed_samples += calculator.get_current_global_batch_size()
        iterations += 1
    if train_samples > consumed_samples:
        # The partial last batch is thrown away.
        iterations += (train_samples - consumed_samples) // global_batch_size
    return iterations


_GLOBAL_NUM_MICROBATCHES_CALCULATOR: Optional[NumMicroBatchesCalculator] = None


def _calculator() -> NumMicroBatchesCalculator:
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise RuntimeError("micro-batch calculator is not initialized; call "
                           "megatron.training.initialize.initialize_megatron() (or init_num_microbatches_calculator) first")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def init_num_microbatches_calculator(rank: int, rampup_batch_size: Sequence | None, global_batch_size: int,
                                     micro_batch_size: int, data_parallel_size: int) -> None:
    """Set the process-wide calculator (build_num_microbatches_calculator's), replacing any earlier one."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size)


def unset_num_microbatches_calculator() -> None:
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def get_num_microbatches() -> int:
    return _calculator().get()


def get_current_global_batch_size() -> int:
    return _calculator().get_current_global_batch_size()


def get_micro_batch_size() -> int:
    return _calculator().micro_batch_size


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True) -> None:
    _calculator().update(consumed_samples, consistency_check)
