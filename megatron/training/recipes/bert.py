"""Pretrain a BERT model (masked LM + the binary sentence-order head).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix bert --vocab-file vocab.txt \
        --tokenizer-type BertWordPieceLowerCase --split-sentences
    python pretrain_bert.py --num-layers 2 --hidden-size 64 ... --data-path bert_text_sentence \
        --vocab-file vocab.txt [--bert-no-binary-head] [--mask-prob 0.15] [--short-seq-prob 0.1]

The same machinery as pretrain_gpt.py (TP, SP, PP, DP, the distributed optimizer); the recipe:

    model_provider: BertModel (bidirectional attention under the padding mask, tokentype
        embeddings, the LM head tied to the word embeddings, the pooler and binary head unless
        --bert-no-binary-head)
    train_valid_test_datasets_provider: BERTMaskedWordPieceDataset over `_text_sentence` data
    forward_step: the masked-LM loss averaged over the masked tokens, plus the sentence-order loss,
        logged as `lm loss` and `sop loss` (Megatron's names)
"""

from functools import partial
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from megatron.core import device, parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.training.global_vars import get_args, get_timers, get_tokenizer, get_tokenizer_or_build
from megatron.model import BertModel
from megatron.model.bert_model import bert_loss
from megatron.training.training import pretrain
from megatron.training.utils import print_rank_0

BATCH_KEYS = ("text", "types", "labels", "is_random", "loss_mask", "padding_mask")


def model_provider(pre_process: bool = True, post_process: bool = True) -> BertModel:
    """A BertModel shaped by the flags (Megatron's: two tokentypes with the binary head, none without)."""
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    print_rank_0("building BERT model ...")
    config = core_transformer_config_from_args(args)
    binary_head = args.bert_binary_head
    return BertModel(config, vocab_size=args.padded_vocab_size, num_tokens=get_tokenizer().vocab_size,
                     max_sequence_length=args.max_position_embeddings, num_tokentypes=2 if binary_head else 0,
                     add_binary_head=binary_head,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     pre_process=pre_process, post_process=post_process,
                     post_layernorm=args.bert_post_layernorm)


def get_batch(data_iterator: Optional[Iterator]) -> Tuple[torch.Tensor, ...]:
    """(tokens, types, sentence_order, loss_mask, lm_labels, padding_mask) of the next micro-batch.

    Tensor-parallel rank 0 of every pipeline stage reads the batch (every stage needs the padding
    mask for its attention) and broadcasts it over its TP group."""
    data: Optional[Dict[str, torch.Tensor]] = next(data_iterator) if data_iterator is not None else None
    if data is not None:
        data = {key: torch.as_tensor(data[key]).to(torch.int64) for key in BATCH_KEYS}
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        data = tensor_parallel.broadcast_data(list(BATCH_KEYS), data, torch.int64)
    target = device.get_device()
    data = {key: value.to(target, non_blocking=True) for key, value in data.items()}
    return (data["text"], data["types"], data["is_random"], data["loss_mask"].float(), data["labels"],
            data["padding_mask"])


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor):
    """Megatron's BERT loss: (lm loss + sop loss, {"lm loss", "sop loss"}) of one micro-batch; the
    schedule averages over micro-batches and the training loop over data-parallel replicas."""
    lm_loss, binary_logits = output_tensor
    return bert_loss(lm_loss, binary_logits, loss_mask, sentence_order)


def forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """Forward one micro-batch; returns (per-token lm loss, binary logits) and the loss function."""
    args = get_args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, types, sentence_order, loss_mask, lm_labels, padding_mask = get_batch(data_iterator)
    timers("batch-generator", log_level=2).stop()
    if not args.bert_binary_head:
        types = None  # no tokentype table without the binary head (Megatron's)
    output_tensor = model(tokens, padding_mask, tokentype_ids=types, lm_labels=lm_labels)
    return output_tensor, partial(loss_func, loss_mask, sentence_order)


def is_dataset_built_on_rank() -> bool:
    """Tensor-parallel rank 0 of every pipeline stage reads the data (each stage needs the padding mask)."""
    return parallel_state.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples: List[int]):
    """BERT datasets for --data-path / --split (sentence-split `_text_sentence` data)."""
    from megatron.data.bert_dataset import BERTMaskedWordPieceDataset
    from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.training.dataset_configs import bert_dataset_config_from_args

    args = get_args()
    config = bert_dataset_config_from_args(args, get_tokenizer_or_build())
    print_rank_0("> building train, validation, and test datasets for BERT ...")
    datasets = BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, train_val_test_num_samples,
                                             is_dataset_built_on_rank, config).build()
    print_rank_0("> finished creating BERT datasets ...")
    return datasets


def pretrain_arguments() -> dict:
    """pretrain()'s arguments for this recipe (main and megatron.training.api.pretrain use them)."""
    return dict(train_valid_test_dataset_provider=train_valid_test_datasets_provider, model_provider=model_provider,
                model_type=ModelType.encoder_or_decoder, forward_step_func=forward_step,
                args_defaults={"tokenizer_type": "BertWordPieceLowerCase", "model_family": "BERT"})


def main(argv: Optional[List[str]] = None, record_history: bool = False):
    """Train with the flags in argv (None: sys.argv); returns megatron.training.training.TrainingResult."""
    return pretrain(**pretrain_arguments(), argv=argv, record_history=record_history)
