"""Run a fine-tuning task in this process as tasks/main.py will: initialize_megatron with
Megatron's task flags, then tasks.glue.finetune.main / tasks.race.finetune.main.

A stand-in until tasks/main.py (helper evalzs) lands on this branch: it declares the task flags
itself, takes --pretrained-checkpoint out of argv while this branch still refuses the flag, and
gives validate_args the --train-iters / --mock-data it asks of pretraining runs (finetune() sets
train_iters from --epochs)."""
from __future__ import annotations

import argparse
from typing import List


def task_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="tasks")
    group.add_argument("--task", type=str, required=True)
    group.add_argument("--epochs", type=int, default=None)
    group.add_argument("--keep-last", action="store_true")
    group.add_argument("--train-data", nargs="+", default=None)
    group.add_argument("--valid-data", nargs="*", default=None)
    return parser


def _pretrained_flag_refused() -> bool:
    from megatron.arguments_megatron import REFUSED

    return any("--pretrained-checkpoint" in row.names for row in REFUSED)


def run_task(argv: List[str], record_history: bool = True):
    from megatron.initialize import initialize_megatron

    argv = list(argv)
    pretrained = None
    if "--pretrained-checkpoint" in argv and _pretrained_flag_refused():
        i = argv.index("--pretrained-checkpoint")
        pretrained = argv[i + 1]
        del argv[i:i + 2]
    if "--train-iters" not in argv:
        argv += ["--train-iters", "1"]
    argv += ["--mock-data"]
    args = initialize_megatron(task_args, {"tokenizer_type": "BertWordPieceLowerCase"},
                               argv=argv)
    if not hasattr(args, "pretrained_checkpoint") or pretrained is not None:
        args.pretrained_checkpoint = pretrained
    if args.task == "RACE":
        from tasks.race.finetune import main
    else:
        from tasks.glue.finetune import main
    return main(args, record_history=record_history)
