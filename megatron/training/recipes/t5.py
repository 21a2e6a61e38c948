"""Pretrain a T5 model (span corruption: the encoder reads the text with a sentinel per masked
span, the decoder writes the spans).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix t5 --vocab-file vocab.txt \
        --tokenizer-type BertWordPieceLowerCase --split-sentences
    python pretrain_t5.py --num-layers 2 --hidden-size 64 ... --encoder-seq-length 512 \
        --decoder-seq-length 128 --max-position-embeddings 512 --vocab-extra-ids 100 \
        --data-path t5_text_sentence --vocab-file vocab.txt [--position-embedding-type relative]

The same machinery as pretrain_gpt.py (TP, SP, DP, the distributed optimizer) and Megatron's
encoder-decoder pipelines (--pipeline-model-parallel-split-rank S: stages [0, S) the encoder,
[S, PP) the decoder; docs/parallelism.md); the recipe:

    model_provider: T5Model (shared embeddings, bidirectional encoder, causal decoder with
        cross-attention, the LM head tied to the embeddings with its own bias); learned absolute
        positions (Megatron's default) or --position-embedding-type relative (T5's buckets,
        --relative-attention-num-buckets / --relative-attention-max-distance)
    train_valid_test_datasets_provider: T5MaskedWordPieceDataset over `_text_sentence` data
    forward_step: the per-token LM loss of the labels, averaged over loss_mask (pretrain_gpt's
        loss_func, as Megatron's pretrain_t5.py), logged as `lm loss`

Lengths: --seq-length (Megatron's --encoder-seq-length) is the encoder's, --decoder-seq-length the
decoder's; --max-position-embeddings must cover both with learned positions.
"""

from functools import partial
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from megatron.core import device, parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.training.global_vars import get_args, get_timers, get_tokenizer, get_tokenizer_or_build
from megatron.model import T5Model
from megatron.model.t5_model import t5_attention_masks
from megatron.training.training import pretrain
from megatron.training.utils import print_rank_0
from megatron.training.recipes.gpt import loss_func  # Megatron's pretrain_t5.py takes GPT's loss too

BATCH_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask")
# The model family marks the T5 rules of validate_args (arguments_model.is_t5): relative positions,
# --decoder-seq-length and --vocab-extra-ids required, the T5 flags read.
# "T5" is the converter's mark too (megatron/convert/t5.py), so a checkpoint of this script is a T5 one.
T5_ARGS_DEFAULTS = {"tokenizer_type": "BertWordPieceLowerCase", "model_family": "T5"}


def model_provider(pre_process: bool = True, post_process: bool = True, add_encoder: bool = True,
                   add_decoder: bool = True) -> T5Model:
    """A T5Model shaped by the flags; the four stage flags go to the model as Megatron's. The T5
    choices a converted HF checkpoint's args carry (activation, attention scale, output scale:
    megatron/convert/t5.py) apply with --use-checkpoint-args; without them it is Megatron's T5."""
    import dataclasses

    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.convert.t5 import t5_model_kwargs, t5_transformer_config_kwargs

    args = get_args()
    print_rank_0("building T5 model ...")
    config = dataclasses.replace(core_transformer_config_from_args(args), **t5_transformer_config_kwargs(args))
    return T5Model(config, vocab_size=args.padded_vocab_size, parallel_output=True,
                   num_tokens=get_tokenizer().vocab_size, pre_process=pre_process, post_process=post_process,
                   add_encoder=add_encoder, add_decoder=add_decoder, **t5_model_kwargs(args))


def get_batch(data_iterator: Optional[Iterator]) -> Tuple[torch.Tensor, ...]:
    """(tokens_enc, tokens_dec, loss_mask, labels, enc_mask, dec_mask, enc_dec_mask) of the next
    micro-batch; the masks bool [b, 1, sq, sk], True = masked out (t5_attention_masks).

    Tensor-parallel rank 0 of every pipeline stage reads the batch (every stage needs the masks)
    and broadcasts it over its TP group."""
    data: Optional[Dict[str, torch.Tensor]] = next(data_iterator) if data_iterator is not None else None
    if data is not None:
        data = {key: torch.as_tensor(data[key]).to(torch.int64) for key in BATCH_KEYS}
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        data = tensor_parallel.broadcast_data(list(BATCH_KEYS), data, torch.int64)
    target = device.get_device()
    data = {key: value.to(target, non_blocking=True) for key, value in data.items()}
    enc_mask, dec_mask, enc_dec_mask = t5_attention_masks(data["enc_mask"], data["dec_mask"])
    return (data["text_enc"], data["text_dec"], data["loss_mask"].float(), data["labels"], enc_mask, dec_mask,
            enc_dec_mask)


def forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """Forward one micro-batch; returns the per-token losses [b, s_dec] and the loss function."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens_enc, tokens_dec, loss_mask, labels, enc_mask, dec_mask, enc_dec_mask = get_batch(data_iterator)
    timers("batch-generator", log_level=2).stop()
    # The labels are -1 on the decoder padding (Megatron's); its loss, at a stand-in id, is masked out.
    output_tensor = model(tokens_enc, tokens_dec, enc_mask, dec_mask, enc_dec_mask, lm_labels=labels.clamp(min=0))
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank() -> bool:
    """Tensor-parallel rank 0 of every pipeline stage reads the data (each stage needs the masks)."""
    return parallel_state.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples: List[int]):
    """T5 datasets for --data-path / --split (sentence-split `_text_sentence` data)."""
    from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.data.t5_dataset import T5MaskedWordPieceDataset
    from megatron.training.dataset_configs import t5_dataset_config_from_args

    args = get_args()
    config = t5_dataset_config_from_args(args, get_tokenizer_or_build())
    print_rank_0("> building train, validation, and test datasets for T5 ...")
    datasets = BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, train_val_test_num_samples,
                                             is_dataset_built_on_rank, config).build()
    print_rank_0("> finished creating T5 datasets ...")
    return datasets


def add_t5_args(parser):
    """pretrain_t5.py's own flag (Megatron's extra_args_provider)."""
    group = parser.add_argument_group(title="T5 span corruption")
    group.add_argument("--mean-noise-span-length", type=float, default=None,
                       help="Ours (T5's name): the mean length of a masked span, in words, before the cap of 10; "
                            "spans are geometric with p = 1 / L. Default: Megatron's p = 0.2 (SpanBERT's; about "
                            "4.5 words); 3 gives T5's setting.")
    return parser


def pretrain_arguments() -> dict:
    """pretrain()'s arguments for this recipe (main and megatron.training.api.pretrain use them)."""
    return dict(train_valid_test_dataset_provider=train_valid_test_datasets_provider, model_provider=model_provider,
                model_type=ModelType.encoder_and_decoder, forward_step_func=forward_step,
                extra_args_provider=add_t5_args, args_defaults=dict(T5_ARGS_DEFAULTS))


def main(argv: Optional[List[str]] = None, record_history: bool = False):
    """Train with the flags in argv (None: sys.argv); returns megatron.training.training.TrainingResult."""
    return pretrain(**pretrain_arguments(), argv=argv, record_history=record_history)
