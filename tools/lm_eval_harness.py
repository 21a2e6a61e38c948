"""Zero-shot scoring of a GPT checkpoint on local JSONL tasks, with lm-evaluation-harness's conventions.

    python tools/lm_eval_harness.py --load-hf HF_DIR --task-data arc_tiny.jsonl requests.jsonl
    torchrun --nproc-per-node 2 tools/lm_eval_harness.py --load CKPT --use-checkpoint-args \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --tensor-model-parallel-size 2 --task-data requests.jsonl --output-path results.json

Each --task-data file is one task (named after the file) of JSONL lines: loglikelihood,
loglikelihood_rolling and generate_until requests, or multiple-choice questions (formats and
metrics: megatron/evaluation/lm_tasks.py; request rules: lm_harness.py). Rank 0 prints the
harness's results table; --output-path writes {"results", "samples", "config"} as JSON. The model
is built and loaded as tools/generate_text.py builds it (any TP / PP under torchrun). Named
lm_eval_harness.py, not lm_eval.py, so that it never shadows the lm_eval package on sys.path.
"""

import argparse
import json
import os
import sys
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.cli import run_cli  # noqa: E402
from megatron.evaluation.lm_harness import HarnessRequestError  # noqa: E402
from megatron.evaluation.lm_tasks import TaskFileError  # noqa: E402
from tools.run_text_generation_server import ServerFlagError, _DATA_FLAGS, build_model  # noqa: E402


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
    from megatron.training.initialize import initialize_megatron

    argv = list(argv)
    if not any(arg.split("=")[0] in _DATA_FLAGS for arg in argv):
        argv.append("--mock-data")  # the training checks want a data source; nothing is read
    if not any(arg.split("=")[0] in ("--ckpt-format", "--auto-detect-ckpt-format") for arg in argv):
        argv.append("--auto-detect-ckpt-format")  # --use-checkpoint-args reads either format, as the load does
    args = initialize_megatron(add_harness_args, argv=argv, args_defaults={
        "tokenizer_type": "GPT2BPETokenizer", "micro_batch_size": 1, "train_iters": 1, "lr": 0.0})
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


def main(argv: List[str] = None) -> None:
    from megatron.evaluation.lm_tasks import read_task, results_table, run_task

    args = initialize(sys.argv[1:] if argv is None else argv)
    if not args.task_data:
        raise ServerFlagError("give at least one --task-data FILE")
    max_length = args.max_length
    tasks = [read_task(path) for path in args.task_data]  # bad lines fail before the model loads
    names = [task.name for task in tasks]
    if len(set(names)) != len(names):
        raise ServerFlagError(f"--task-data: two files give the same task name ({', '.join(names)})")
    lm = build_harness_lm(args)
    results, samples = {}, {}
    for task in tasks:
        results[task.name], samples[task.name] = run_task(lm, task, args.target_delimiter)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    print(results_table(results), flush=True)
    if args.output_path:
        config = {"max_length": max_length, "batch_size": args.eval_batch_size, "max_gen_toks": args.max_gen_toks,
                  "target_delimiter": args.target_delimiter, "load": args.load, "load_hf": args.load_hf}
        with open(args.output_path, "w", encoding="utf-8") as handle:
            json.dump({"results": results, "samples": samples, "config": config}, handle, indent=1)


if __name__ == "__main__":
    run_cli(main, "lm_eval_harness.py", errors=(ServerFlagError, TaskFileError, HarnessRequestError))
