"""Predicted vs measured per-rank memory of the planner's 16 layouts (12 dense, 4 MoE) on 4 gloo ranks (docs/planner.md).

    PYTHONPATH=$PWD python bench/plan_memory.py

Every rank builds each layout as pretrain_gpt.py does and measures (megatron/planner/measure.py):
parameters, gradients and optimizer state exactly after one step, activations as the saved
tensors of one forward per model chunk times the micro-batches the schedule keeps in flight; the
last column is the peak of the saved tensors during one real train_step (full recompute: the
plan's peak with one layer rerun, an upper bound); the last two the plan's peak (with the largest
transient of the forward, the loss and the backward) against the most live bytes of PyTorch's CPU
allocator over 2 more train_steps.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.planner.measure import measure_layouts, table_rows  # noqa: E402
from tests.parallel.harness import DistributedPool  # noqa: E402


def _mib(n: float) -> str:
    return f"{n / 2**20:8.3f}"


def main() -> None:
    pool = DistributedPool(4)
    try:
        per_rank = pool.run(measure_layouts)
    finally:
        pool.close()
    print("| layout | ranks | stage | params + grads + optimizer, MiB (pred / meas) | activations, MiB (pred / meas) "
          "| total, MiB (pred / meas) | diff | schedule peak of activations, MiB (pred / meas) "
          "| allocator peak, MiB (pred / meas) | diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst, worst_peak, groups = 0.0, 0.0, {}
    for name, rank, stage, measured, predicted, diff, _, _, peak, allocated in table_rows(per_rank):
        # ranks of a stage group together when their allocator peaks agree to 0.1%
        key = (name, stage, tuple(measured.values()), tuple(predicted.values()), round(allocated / 2**20, 3))
        groups.setdefault(key, []).append(rank)
        worst = max(worst, abs(diff))
        worst_peak = max(worst_peak, abs(peak - allocated) / allocated)
    static = lambda d: d["total"] - d["activations"]  # noqa: E731
    for (name, stage, _, _, _), ranks in groups.items():
        rank = ranks[0]
        r = next(row for row in table_rows(per_rank) if row[0] == name and row[1] == rank)
        measured, predicted, diff = r[3], r[4], r[5]
        print(f"| {name} | {','.join(map(str, ranks))} | {stage} "
              f"| {_mib(static(predicted))} / {_mib(static(measured))} "
              f"| {_mib(predicted['activations'])} / {_mib(measured['activations'])} "
              f"| {_mib(predicted['total'])} / {_mib(measured['total'])} | {diff:+.4%} "
              f"| {_mib(r[6])} / {_mib(r[7])} | {_mib(r[8])} / {_mib(r[9])} | {(r[8] - r[9]) / r[9]:+.2%} |")
    print(f"\nlargest |difference| over every rank: totals {worst:.4%}, peaks {worst_peak:.2%}")


if __name__ == "__main__":
    main()
