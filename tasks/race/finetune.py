"""RACE fine-tuning (Megatron's tasks/race/finetune.py): the MultipleChoice head on a BERT.

    python tasks/main.py --task RACE --train-data RACE/train/middle RACE/train/high \\
        --valid-data RACE/dev/middle RACE/dev/high --pretrained-checkpoint bert_ckpt --epochs 3 \\
        --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt --seq-length 512 ...

A validation set is named from its path as Megatron names it: what follows "RACE", "/" stripped
from the ends, the other "/" made "-" (dev-middle).
"""

from __future__ import annotations

import argparse
from typing import Optional

from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.utils import print_rank_0
from tasks.eval_utils import accuracy_func_provider
from tasks.finetune_utils import FinetuneResult, finetune
from tasks.race.data import RaceDataset

# tasks/main.py hands these to initialize_megatron (Megatron's args_defaults: only flags left unset):
# pretraining's validation asks for a length and for --save an interval, which finetune() replaces by
# --epochs (train_iters) and the end-of-epoch checkpoints (no interval save is ever reached).
ARGS_DEFAULTS = {"tokenizer_type": "BertWordPieceLowerCase", "train_iters": 1, "save_interval": 2**62}


def train_valid_datasets_provider():
    args = get_args()
    tokenizer = get_tokenizer()
    return (RaceDataset("training", args.train_data, tokenizer, args.seq_length),
            RaceDataset("validation", args.valid_data, tokenizer, args.seq_length))


def model_provider(pre_process: bool = True, post_process: bool = True):
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.model.multiple_choice import MultipleChoice

    args = get_args()
    print_rank_0("building multichoice model for RACE ...")
    return MultipleChoice(core_transformer_config_from_args(args), args.padded_vocab_size,
                          args.max_position_embeddings, num_tokentypes=2, pre_process=pre_process,
                          post_process=post_process, num_tokens=get_tokenizer().vocab_size,
                          post_layernorm=getattr(args, "bert_post_layernorm", False))


def metrics_func_provider():
    def single_dataset_provider(datapath: str):
        name = datapath.split("RACE")[-1].strip("/").replace("/", "-")
        return RaceDataset(name, [datapath], get_tokenizer(), get_args().seq_length)
    return accuracy_func_provider(single_dataset_provider)


def main(args: Optional[argparse.Namespace] = None, record_history: bool = True) -> FinetuneResult:
    """Fine-tune on RACE with the initialized global args."""
    return finetune(train_valid_datasets_provider, model_provider,
                    end_of_epoch_callback_provider=metrics_func_provider, record_history=record_history)
