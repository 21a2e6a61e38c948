"""Evaluation and fine-tuning tasks, as Megatron-LM's tasks/main.py.

    python tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens --load CKPT \
        --no-load-optim --no-load-rng [model, tokenizer and batch flags]
    torchrun --nproc-per-node 4 tasks/main.py --task LAMBADA --strict-lambada --valid-data lambada.jsonl ...

| --task | module (imported when chosen) | what it does |
|---|---|---|
| WIKITEXT103, LAMBADA | tasks.zeroshot_gpt.evaluate | zero-shot GPT evaluation (docs/tasks.md) |
| MNLI, QQP | tasks.glue.finetune | BERT fine-tuning with a classification head |
| RACE | tasks.race.finetune | BERT fine-tuning with a multiple-choice head |

How a task module is called: initialize_megatron(get_tasks_args) first (the tokenizer, the
parallel state and the seeds exist), then `module.main(args)` with args = get_args() (the
validated Namespace, the task flags below included; a module may define ARGS_DEFAULTS, a dict
handed to initialize_megatron as Megatron's args_defaults: values for flags the user left
unset); main's return value is returned by
tasks.main.main(). A task raises tasks.errors.TaskError (or ArgsError / CheckpointError) for bad
input: run_cli prints it as one line and exits with status 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tasks.errors import TaskError  # noqa: E402

# --task -> the module whose main(args) runs it.
TASKS = {
    "WIKITEXT103": "tasks.zeroshot_gpt.evaluate",
    "LAMBADA": "tasks.zeroshot_gpt.evaluate",
    "MNLI": "tasks.glue.finetune",
    "QQP": "tasks.glue.finetune",
    "RACE": "tasks.race.finetune",
}
# Megatron's retrieval (ORQA) tasks: their flags parse, the tasks are refused by name.
NOT_SUPPORTED = ("ICT-ZEROSHOT-NQ", "RETRIEVER-EVAL", "RET-FINETUNE-NQ")


def get_tasks_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's task flags (names, types and defaults as in its tasks/main.py)."""
    group = parser.add_argument_group(title="tasks")
    group.add_argument("--task", type=str, required=True, help="Task name: " + ", ".join(TASKS) + ".")
    group.add_argument("--epochs", type=int, default=None,
                       help="Number of finetuning epochs. Zero results in evaluation only.")
    group.add_argument("--keep-last", action="store_true",
                       help="Keep the last batch (maybe incomplete) in the data loader.")
    group.add_argument("--train-data", nargs="+", default=None,
                       help="Whitespace separated paths or corpora names for training.")
    group.add_argument("--valid-data", nargs="*", default=None, help="Path(s) to the validation data.")
    group.add_argument("--overlapping-eval", type=int, default=32,
                       help="WIKITEXT103: the stride of the sliding window (tokens newly scored per window "
                            "after the first); --seq-length for non-overlapping windows.")
    group.add_argument("--strict-lambada", action="store_true",
                       help="LAMBADA: the target is the whole last word (all its tokens), not the last token.")
    group.add_argument("--eval-micro-batch-size", type=int, default=None,
                       help="Evaluation micro-batch size of the fine-tuning tasks (default --micro-batch-size).")
    # Megatron's retriever (ORQA) flags: parsed so its commands read, the tasks are refused.
    group.add_argument("--qa-data-dev", type=str, default=None, help="Retriever tasks (not supported yet).")
    group.add_argument("--qa-data-test", type=str, default=None, help="Retriever tasks (not supported yet).")
    group.add_argument("--faiss-use-gpu", action="store_true", help="Retriever tasks (not supported yet).")
    group.add_argument("--faiss-match", type=str, default="string", choices=["regex", "string"],
                       help="Retriever tasks (not supported yet).")
    group.add_argument("--faiss-topk-retrievals", type=int, default=100, help="Retriever tasks (not supported yet).")
    group.add_argument("--train-with-neg", action="store_true", help="Retriever tasks (not supported yet).")
    group.add_argument("--train-hard-neg", type=int, default=0, help="Retriever tasks (not supported yet).")
    group.add_argument("--val-av-rank-hard-neg", type=int, default=30, help="Retriever tasks (not supported yet).")
    group.add_argument("--val-av-rank-other-neg", type=int, default=30, help="Retriever tasks (not supported yet).")
    return parser


def task_module(task: str) -> Any:
    """The module that runs `task`, imported now; TaskError for an unknown or unavailable one."""
    if task in NOT_SUPPORTED:
        raise TaskError(f"--task {task}: Megatron's retrieval tasks are not supported yet "
                        f"(choices: {', '.join(TASKS)})")
    if task not in TASKS:
        raise TaskError(f"--task {task}: unknown task (choices: {', '.join(TASKS)})")
    name = TASKS[task]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is None or not name.startswith(error.name):
            raise  # a module the task imports is missing: a real problem, with its traceback
        raise TaskError(f"--task {task}: its module {name} is not available in this installation") from error


def main(argv: Optional[List[str]] = None) -> Any:
    """Parse the flags (argv None: sys.argv), initialize, run the task; returns its main's result."""
    from megatron.training.arguments_validation import ArgsError
    from megatron.training.global_vars import get_args
    from megatron.training.initialize import initialize_megatron

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--task", type=str, default=None)
    task = pre.parse_known_args(argv)[0].task
    module = task_module(task) if task is not None else None  # before any set-up (argparse names a missing --task)
    # A task reads the checkpoint it is given in the format it was saved in (torch or torch_dist).
    if "--auto-detect-ckpt-format" not in argv:
        argv.append("--auto-detect-ckpt-format")
    defaults = dict(getattr(module, "ARGS_DEFAULTS", {}))  # Megatron's args_defaults, the task's own
    initialize_megatron(extra_args_provider=get_tasks_args, args_defaults=defaults, argv=argv)
    args = get_args()
    if args.num_layers_per_virtual_pipeline_stage is not None or args.virtual_pipeline_model_parallel_size:
        raise ArgsError("--num-layers-per-virtual-pipeline-stage: the interleaved pipeline schedule is not "
                        "supported for downstream tasks (as in Megatron-LM); remove it")
    if module is None:
        module = task_module(args.task)
    return module.main(args)


if __name__ == "__main__":
    from megatron.training.cli import run_cli

    run_cli(main, "tasks/main.py")  # bad input: one line and exit status 1 (MEGATRON_DEBUG=1: traceback)
