"""Pre-flight plan of a pretrain_gpt.py run: per-rank memory, communication, step time and MFU.

    python tools/plan.py [pretrain_gpt.py flags] [--device-memory-gb 80 --devices-per-node 8 ...] \\
        --world-size 64 [--search [--top 10] [--search-micro-batch-sizes 1 2 4]
                         [--search-context-parallel-sizes 1 2 4]]

Takes pretrain_gpt.py's flags (data flags optional: --mock-data is assumed when none is given) and
the device flags (megatron/planner/plan.py's Device); --world-size stands for torchrun's
WORLD_SIZE. --search lists the best TP/PP/DP/VPP/recompute/SP/distributed-optimizer layouts (and
EP/ETP for an MoE model; CP with --search-context-parallel-sizes) of that many devices that fit, by
predicted step time. docs/planner.md explains the model.
"""

import argparse
import contextlib
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.arguments import parse_args, validate_args  # noqa: E402
from megatron.training.arguments_validation import ArgsError  # noqa: E402
from megatron.planner.model import PlanError  # noqa: E402
from megatron.planner.report import format_plan, plan_from_args, search_from_args  # noqa: E402

DATA_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--mock-data")


def _plan_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="tools/plan.py")
    group.add_argument("--world-size", type=int, default=None, dest="plan_world_size",
                       help="Devices of the run (default: WORLD_SIZE, else TP x PP).")
    group.add_argument("--search", action="store_true", help="List the best layouts of --world-size devices.")
    group.add_argument("--top", type=int, default=10, help="Layouts --search lists.")
    group.add_argument("--search-micro-batch-sizes", type=int, nargs="+", default=None,
                       help="Micro-batch sizes --search tries (default: --micro-batch-size only).")
    group.add_argument("--search-context-parallel-sizes", type=int, nargs="+", default=None,
                       help="Context-parallel sizes --search tries, each with p2p, allgather and a2a "
                            "(default: 1 only; worth it for a long --seq-length).")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(arg.split("=")[0] in DATA_FLAGS for arg in argv):
        argv.append("--mock-data")  # the plan needs no data
    args = parse_args(_plan_args, argv=argv)
    args.world_size = args.plan_world_size or int(os.environ.get("WORLD_SIZE", 0)) or \
        args.tensor_model_parallel_size * args.context_parallel_size * args.pipeline_model_parallel_size
    args.rank = 0
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the argument block
            validate_args(args, {})
        lines = search_from_args(args, args.top, args.search_micro_batch_sizes,
                                 args.search_context_parallel_sizes) if args.search else \
            format_plan(plan_from_args(args))
    except (PlanError, ArgsError) as error:
        print(f"tools/plan.py: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
