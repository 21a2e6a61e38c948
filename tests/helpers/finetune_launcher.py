"""Run a fine-tuning task in this process: tasks/main.py's main(argv) where this checkout has it,
else a stand-in doing what it does (initialize_megatron with Megatron's task flags and the task
module's ARGS_DEFAULTS, then module.main(args)).

The stand-in serves until tasks/main.py (helper evalzs) is merged: it declares the task flags
itself, takes --pretrained-checkpoint out of argv while the flag is still refused, and adds
--mock-data for the data check of pretraining runs."""
from __future__ import annotations

import argparse
import importlib
import os
from typing import List

from tests.helpers.paths import ROOT

MODULES = {"MNLI": "tasks.glue.finetune", "QQP": "tasks.glue.finetune", "RACE": "tasks.race.finetune"}


def task_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="tasks")
    group.add_argument("--task", type=str, required=True)
    group.add_argument("--epochs", type=int, default=None)
    group.add_argument("--keep-last", action="store_true")
    group.add_argument("--train-data", nargs="+", default=None)
    group.add_argument("--valid-data", nargs="*", default=None)
    return parser


def _pretrained_flag_refused() -> bool:
    from megatron.training.arguments_megatron import REFUSED

    return any("--pretrained-checkpoint" in row.names for row in REFUSED)


def run_task(argv: List[str]):
    """The task's result (tasks.finetune_utils.FinetuneResult)."""
    if os.path.isfile(os.path.join(ROOT, "tasks", "main.py")):
        from tasks.main import main

        return main(list(argv))
    from megatron.training.initialize import initialize_megatron

    argv = list(argv)
    module = importlib.import_module(MODULES[argv[argv.index("--task") + 1]])
    pretrained = None
    if "--pretrained-checkpoint" in argv and _pretrained_flag_refused():
        i = argv.index("--pretrained-checkpoint")
        pretrained = argv[i + 1]
        del argv[i:i + 2]
    args = initialize_megatron(task_args, dict(module.ARGS_DEFAULTS), argv=argv + ["--mock-data"])
    if not hasattr(args, "pretrained_checkpoint") or pretrained is not None:
        args.pretrained_checkpoint = pretrained
    return module.main(args)
