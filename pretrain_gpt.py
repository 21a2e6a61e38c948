"""Pretrain a GPT model.

    python pretrain_gpt.py --num-layers 2 --hidden-size 64 ... --data-path PREFIX_text_document
    torchrun --nproc-per-node 1 pretrain_gpt.py ...

The three functions handed to pretrain() are the whole recipe; write your own in the same
shape for a custom loss or batch layout (docs/training.md shows an example):

    model_provider(pre_process, post_process) -> the model
    train_valid_test_datasets_provider([n_train, n_valid, n_test]) -> (train, valid, test) datasets
    forward_step(data_iterator, model) -> (output tensor, loss function of that tensor)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the recipe lives in the package (megatron/training/recipes/gpt.py); this script is its entry point
from megatron.training.recipes.gpt import (  # noqa: E402,F401
    model_provider,
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

    run_cli(main, "pretrain_gpt.py")  # bad input: one line and exit status 1 (MEGATRON_DEBUG=1: traceback)
