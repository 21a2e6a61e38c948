"""GLUE fine-tuning (Megatron's tasks/glue/finetune.py): MNLI (3 classes) and QQP (2) with the
Classification head on a BERT, through tasks/finetune_utils.finetune.

    python tasks/main.py --task MNLI --train-data MNLI/train.tsv \\
        --valid-data MNLI/dev_matched.tsv MNLI/dev_mismatched.tsv --pretrained-checkpoint bert_ckpt \\
        --epochs 3 --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt --seq-length 128 ...

A validation set is named from its path as Megatron names it: what follows "MNLI" (or "QQP"), the
characters of ".tsv" stripped from its ends, then "/" stripped and "_" made "-" (dev-matched).
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.utils import print_rank_0
from tasks.eval_utils import accuracy_func_provider
from tasks.finetune_utils import FinetuneResult, finetune

# tasks/main.py hands these to initialize_megatron (Megatron's args_defaults: only flags left unset):
# pretraining's validation asks for a length and for --save an interval, which finetune() replaces by
# --epochs (train_iters) and the end-of-epoch checkpoints (no interval save is ever reached).
ARGS_DEFAULTS = {"tokenizer_type": "BertWordPieceLowerCase", "train_iters": 1, "save_interval": 2**62}


def classification_model_provider(num_classes: int) -> Callable:
    def model_provider(pre_process: bool = True, post_process: bool = True):
        from megatron.training.arguments import core_transformer_config_from_args
        from megatron.model.classification import Classification

        args = get_args()
        print_rank_0(f"building classification model for {args.task} ...")
        return Classification(core_transformer_config_from_args(args), num_classes, args.padded_vocab_size,
                              args.max_position_embeddings, num_tokentypes=2, pre_process=pre_process,
                              post_process=post_process, num_tokens=get_tokenizer().vocab_size,
                              post_layernorm=getattr(args, "bert_post_layernorm", False))
    return model_provider


def glue_classification(num_classes: int, dataset_class, name_from_datapath: Callable[[str], str],
                        record_history: bool = True) -> FinetuneResult:
    def train_valid_datasets_provider():
        args = get_args()
        tokenizer = get_tokenizer()
        return (dataset_class("training", args.train_data, tokenizer, args.seq_length),
                dataset_class("validation", args.valid_data, tokenizer, args.seq_length))

    def metrics_func_provider():
        def single_dataset_provider(datapath: str):
            return dataset_class(name_from_datapath(datapath), [datapath], get_tokenizer(), get_args().seq_length)
        return accuracy_func_provider(single_dataset_provider)

    return finetune(train_valid_datasets_provider, classification_model_provider(num_classes),
                    end_of_epoch_callback_provider=metrics_func_provider, record_history=record_history)


def _name_after(marker: str) -> Callable[[str], str]:
    def name(datapath: str) -> str:
        return datapath.split(marker)[-1].strip(".tsv").strip("/").replace("_", "-")
    return name


def main(args: Optional[argparse.Namespace] = None, record_history: bool = True) -> FinetuneResult:
    """Fine-tune for args.task (MNLI or QQP); args default to the initialized global args."""
    args = args if args is not None else get_args()
    if args.task == "MNLI":
        from tasks.glue.mnli import MNLIDataset

        return glue_classification(3, MNLIDataset, _name_after("MNLI"), record_history)
    if args.task == "QQP":
        from tasks.glue.qqp import QQPDataset

        return glue_classification(2, QQPDataset, _name_after("QQP"), record_history)
    raise NotImplementedError(f"GLUE task {args.task} is not implemented.")
