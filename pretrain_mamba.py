"""Pretrain a Mamba-2 or hybrid model: Megatron-LM's entry point, `python pretrain_mamba.py [flags]` or under torchrun.

The recipe (model_provider, forward_step, train_valid_test_datasets_provider, main) and its
documentation are in megatron/training/recipes/mamba.py; this script imports them.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron.training.recipes.mamba import (  # noqa: E402,F401
    model_provider,
    mamba_builder,
    get_batch,
    loss_func,
    forward_step,
    is_dataset_built_on_rank,
    train_valid_test_datasets_provider,
    main,
    ModelType,
)

if __name__ == "__main__":
    from megatron.training.cli import run_cli

    run_cli(main, "pretrain_mamba.py")  # bad input: one line and exit status 1 (MEGATRON_DEBUG=1: traceback)
