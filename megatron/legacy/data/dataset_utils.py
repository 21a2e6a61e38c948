"""Megatron-LM's legacy build_train_valid_test_datasets for BERT and T5, over megatron/data's datasets.

    build_train_valid_test_datasets(data_prefix, splits_string, train_valid_test_num_samples,
                                    max_seq_length, seed, binary_head=False, max_seq_length_dec=None,
                                    dataset_type="standard_bert" | "t5") -> (train, valid, test)

The datasets are the ones pretrain_bert.py / pretrain_t5.py build (BERTMaskedWordPieceDataset,
T5MaskedWordPieceDataset over `_text_sentence` .bin/.idx data, BlendedMegatronDatasetBuilder's
--split of documents and sizes); the arguments given here replace the global args' --data-path,
--split, --seq-length / --encoder-seq-length, --seed, --bert-binary-head and --decoder-seq-length,
and the other data flags (--mask-prob, --short-seq-prob, --data-cache-path, ...) are the global
args'. None stands for a split with no data or no samples wanted. Sample fields, numpy int64:

    BERT  text, types, labels (-1 where not masked), is_random, loss_mask, padding_mask, truncated
          (megatron/data/bert_dataset.py's samples, unchanged)
    T5    text_enc, text_dec, labels (-1 on padding), loss_mask, truncated (T5MaskedWordPieceDataset's)
          and Megatron-LM's legacy 2-D masks, 1 = attend (query i, key j):
              enc_mask      [s_enc, s_enc]  both tokens real
              dec_mask      [s_dec, s_dec]  both real, and j <= i
              enc_dec_mask  [s_dec, s_enc]  decoder token i and encoder token j real
          which Accelerate's T5TrainStep turns into the model's masks with `< 0.5`.

The tokenizer is the global one; without one (Accelerate sets the args with build_tokenizer=False)
it is built from the global args' tokenizer flags, or a caller passes its own (`tokenizer=`).
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from megatron.data.bert_dataset import BERTMaskedWordPieceDataset
from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
from megatron.data.t5_dataset import T5MaskedWordPieceDataset
from megatron.legacy.global_args import global_tokenizer, legacy_args
from megatron.training.dataset_configs import bert_dataset_config_from_args, t5_dataset_config_from_args
from megatron.training.tokenizer import build_tokenizer

DSET_TYPE_BERT = "standard_bert"
DSET_TYPE_T5 = "t5"
DSET_TYPES = (DSET_TYPE_BERT, DSET_TYPE_T5)


class LegacyT5Dataset(torch.utils.data.Dataset):
    """A T5MaskedWordPieceDataset whose samples carry Megatron-LM's legacy 2-D masks (module docstring)
    in place of its 1-D enc_mask / dec_mask."""

    def __init__(self, dataset: T5MaskedWordPieceDataset) -> None:
        super().__init__()
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict:
        sample = dict(self.dataset[idx])
        enc, dec = sample["enc_mask"].astype(bool), sample["dec_mask"].astype(bool)  # [s_enc], [s_dec]
        history = np.tril(np.ones((dec.shape[0], dec.shape[0]), dtype=bool))  # [s_dec, s_dec], key <= query
        sample["enc_mask"] = (enc[:, None] & enc[None, :]).astype(np.int64)  # [s_enc, s_enc]
        sample["dec_mask"] = (dec[:, None] & dec[None, :] & history).astype(np.int64)  # [s_dec, s_dec]
        sample["enc_dec_mask"] = (dec[:, None] & enc[None, :]).astype(np.int64)  # [s_dec, s_enc]
        return sample


def _dataset_args(data_prefix: Union[str, Sequence[str]], splits_string: str, max_seq_length: int, seed: int,
                  binary_head: bool, max_seq_length_dec: Optional[int]):
    """A copy of the global args with this call's data, lengths and seed (the global args stay as they are)."""
    args = copy.copy(legacy_args("megatron.legacy.data.dataset_utils.build_train_valid_test_datasets"))
    args.data_path = [data_prefix] if isinstance(data_prefix, str) else list(data_prefix)
    args.train_data_path = args.valid_data_path = args.test_data_path = None
    args.mock_data = False
    args.split = splits_string
    args.seq_length = args.encoder_seq_length = max_seq_length
    args.decoder_seq_length = max_seq_length_dec
    args.seed = seed
    args.bert_binary_head = bool(binary_head)
    return args


def build_train_valid_test_datasets(data_prefix: Union[str, Sequence[str]], splits_string: str,
                                    train_valid_test_num_samples: Sequence[Optional[int]], max_seq_length: int,
                                    seed: int, binary_head: bool = False, max_seq_length_dec: Optional[int] = None,
                                    dataset_type: str = DSET_TYPE_BERT, *, tokenizer: Any = None) -> tuple:
    """(train, valid, test) BERT or T5 datasets (module docstring); data_prefix is Megatron's --data-path
    list (one prefix, or a blend 'w1 p1 w2 p2 ...', which megatron/data blends)."""
    if dataset_type not in DSET_TYPES:
        raise ValueError(f"megatron.legacy build_train_valid_test_datasets: dataset_type {dataset_type!r} is not "
                         f"supported (one of {', '.join(DSET_TYPES)})")
    args = _dataset_args(data_prefix, splits_string, max_seq_length, seed, binary_head, max_seq_length_dec)
    if tokenizer is None:
        tokenizer = global_tokenizer()
    if tokenizer is None:
        tokenizer = build_tokenizer(args)  # on the copy: the global args keep their padded_vocab_size
    if dataset_type == DSET_TYPE_T5:
        cls, config = T5MaskedWordPieceDataset, t5_dataset_config_from_args(args, tokenizer)
    else:
        cls, config = BERTMaskedWordPieceDataset, bert_dataset_config_from_args(args, tokenizer)
    datasets = BlendedMegatronDatasetBuilder(cls, list(train_valid_test_num_samples), None, config).build()
    if dataset_type == DSET_TYPE_T5:
        datasets = [None if dataset is None else LegacyT5Dataset(dataset) for dataset in datasets]
    return tuple(datasets)
