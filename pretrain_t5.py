"""Pretrain a T5 model: Megatron-LM's entry point, `python pretrain_t5.py [flags]` or under torchrun.

The recipe (model_provider, forward_step, train_valid_test_datasets_provider, main) and its
documentation are in megatron/training/recipes/t5.py; this script imports them.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron.training.recipes.t5 import (  # noqa: E402,F401
    BATCH_KEYS,
    T5_ARGS_DEFAULTS,
    model_provider,
    get_batch,
    forward_step,
    is_dataset_built_on_rank,
    train_valid_test_datasets_provider,
    add_t5_args,
    main,
)

if __name__ == "__main__":
    from megatron.training.cli import run_cli

    run_cli(main, "pretrain_t5.py")  # bad input: one line and exit status 1 (MEGATRON_DEBUG=1: traceback)
