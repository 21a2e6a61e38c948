"""Flags and model set-up for scoring with lm-evaluation-harness's conventions.

tools/lm_eval_harness.py (local JSONL tasks) and the `megatron_compat` model of lm_eval's own
command line (lm_eval_adapter.py) both start here: `initialize(argv)` runs initialize_megatron
with the scoring flags, `build_harness_lm(args)` loads this rank's model into a HarnessLM.
"""

import argparse
from typing import List

from megatron.inference.checkpoint_model import ServerFlagError, build_model, initialize_for_inference


def add_harness_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="lm-evaluation-harness scoring")
    group.add_argument("--task-data", nargs="+", default=None, metavar="FILE",
                       help="JSONL task files (one task each, named after the file).")
    group.add_argument("--eval-batch-size", type=int, default=8, help="Requests per forward (lm-eval's --batch_size).")
    group.add_argument("--max-length", type=int, default=None,
                       help="Longest model input in tokens (default: --max-position-embeddings).")
    group.add_argument("--max-gen-toks", type=int, default=256,
                       help="New tokens of a generate_until request that gives no max_gen_toks.")
    group.add_argument("--target-delimiter", default=" ", help="Put before each multiple-choice choice.")
    group.add_argument("--output-path", default=None, help="Write the results and per-line samples here (JSON).")
    return parser


def initialize(argv: List[str]) -> argparse.Namespace:
    """initialize_megatron for scoring (no data, no optimizer); the checked args."""
    argv = list(argv)
    if not any(arg.split("=")[0] in ("--ckpt-format", "--auto-detect-ckpt-format") for arg in argv):
        argv.append("--auto-detect-ckpt-format")  # --use-checkpoint-args reads either format, as the load does
    args = initialize_for_inference(argv, add_harness_args)
    if args.load is None and args.load_hf is None:
        raise ServerFlagError("a checkpoint is required: --load CKPT or --load-hf HF_DIR")
    args.max_length = args.max_length or args.max_position_embeddings
    if args.max_length is None or args.max_length < 2 or args.eval_batch_size < 1 or args.max_gen_toks < 1:
        raise ServerFlagError("--max-length must be at least 2 (or give --max-position-embeddings), "
                              "--eval-batch-size and --max-gen-toks at least 1")
    return args


def build_harness_lm(args: argparse.Namespace) -> "HarnessLM":  # noqa: F821 - imported lazily
    """This rank's model, loaded (--load or --load-hf), as a HarnessLM."""
    from megatron.evaluation.lm_harness import HarnessLM
    from megatron.training.global_vars import get_tokenizer

    return HarnessLM(build_model(args), get_tokenizer(), args.max_length, args.eval_batch_size, args.max_gen_toks)
