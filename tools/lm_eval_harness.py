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

import json
import os
import sys
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.cli import run_cli  # noqa: E402
from megatron.evaluation.lm_harness import HarnessRequestError  # noqa: E402
from megatron.evaluation.lm_tasks import TaskFileError  # noqa: E402
from megatron.evaluation.harness_setup import add_harness_args, build_harness_lm, initialize  # noqa: E402,F401
from megatron.inference.checkpoint_model import ServerFlagError  # noqa: E402


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
