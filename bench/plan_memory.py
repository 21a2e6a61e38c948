"""Predicted vs measured per-rank memory of the planner's 10 layouts on 4 gloo ranks (docs/planner.md).

    PYTHONPATH=$PWD python bench/plan_memory.py

Every rank builds each layout as pretrain_gpt.py does and measures (megatron/planner/measure.py):
parameters, gradients and optimizer state exactly after one step, activations as the saved
tensors of one forward per model chunk times the micro-batches the schedule keeps in flight.
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
    print("| layout | rank | stage | params+grads+optimizer MiB (pred / meas) | activations MiB (pred / meas) "
          "| total MiB (pred / meas) | diff |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for name, rank, stage, measured, predicted, diff in table_rows(per_rank):
        static = lambda d: d["total"] - d["activations"]  # noqa: E731
        print(f"| {name} | {rank} | {stage} | {_mib(static(predicted))} / {_mib(static(measured))} "
              f"| {_mib(predicted['activations'])} / {_mib(measured['activations'])} "
              f"| {_mib(predicted['total'])} / {_mib(measured['total'])} | {diff:+.3%} |")
        worst = max(worst, abs(diff))
    print(f"\nlargest |difference|: {worst:.3%}")


if __name__ == "__main__":
    main()
