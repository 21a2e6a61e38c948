"""Pretrain a GPT model.

    python pretrain_gpt.py --num-layers 2 --hidden-size 64 ... --data-path PREFIX_text_document
    torchrun --nproc-per-node 1 pretrain_gpt.py ...

The three functions handed to pretrain() are the whole recipe; write your own in the same
shape for a custom loss or batch layout (docs/training.md shows an example):

    model_provider(pre_process, post_process) -> the model
    train_valid_test_datasets_provider([n_train, n_valid, n_test]) -> (train, valid, test) datasets
    forward_step(data_iterator, model) -> (output tensor, loss function of that tensor)
"""

from functools import partial
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from megatron.core import device, parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.training.global_vars import get_args, get_timers, get_tokenizer_or_build
from megatron.training.gpt_builders import gpt_builder
from megatron.model import GPTModel
from megatron.model.packed_seq import PackedSeqParams
from megatron.training.training import pretrain
from megatron.training.utils import get_batch_on_this_cp_rank, print_rank_0


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None) -> GPTModel:
    """A GPTModel shaped by the flags (megatron/training/gpt_builders.py)."""
    return gpt_builder(get_args(), pre_process, post_process, vp_stage=vp_stage)


def get_batch(data_iterator: Optional[Iterator]) -> Tuple[torch.Tensor, ...]:
    """(tokens, labels, loss_mask, attention_mask or None, position_ids) of the next micro-batch.

    Tensor-parallel rank 0 reads the batch; the other TP ranks (data_iterator None) receive it
    by broadcast, so every rank of a TP group works on the same tokens. Under context parallelism
    each CP rank then keeps its load-balanced share of the sequence (get_batch_on_this_cp_rank). Only the first pipeline
    stage (tokens) and the last (labels, loss mask) need a batch; middle stages get Nones.
    """
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    if not (parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()):
        return None, None, None, None, None  # a middle stage takes its input from the previous one
    data: Optional[Dict[str, torch.Tensor]] = next(data_iterator) if data_iterator is not None else None
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        with_mask = get_args().create_attention_mask_in_dataloader  # the same on every rank
        if data is not None:
            data = {key: value for key, value in data.items() if key in keys or key == "attention_mask"}
            data.update({key: data[key].to(torch.int64) for key in ("tokens", "labels", "position_ids")})
            data["loss_mask"] = data["loss_mask"].float()
            if with_mask:
                data["attention_mask"] = data["attention_mask"].to(torch.uint8)
        received = tensor_parallel.broadcast_data(["tokens", "labels", "position_ids"], data, torch.int64)
        received.update(tensor_parallel.broadcast_data(["loss_mask"], data, torch.float32))
        if with_mask:
            mask = tensor_parallel.broadcast_data(["attention_mask"], data, torch.uint8)["attention_mask"]
            received["attention_mask"] = mask.bool()
        data = received
    target = device.get_device()
    batch = {key: data[key].to(target, non_blocking=True) for key in keys}
    attention_mask = data.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(target, non_blocking=True)  # [b, 1, s, s], True = masked
    if parallel_state.get_context_parallel_world_size() > 1:
        # The causal mask is implied (validation refuses --reset-attention-mask with CP): the
        # attention computes it from the real positions of each CP rank's chunks.
        attention_mask = None
        batch = get_batch_on_this_cp_rank(batch)  # [b, s/N] each, chunks r and 2N-1-r
    return batch["tokens"], batch["labels"], batch["loss_mask"], attention_mask, batch["position_ids"]


def get_sft_batch(data_iterator: Optional[Iterator]) -> Tuple[torch.Tensor, ...]:
    """(tokens, labels, loss_mask, position_ids, cu_seqlens [b, s + 1]) of the next packed SFT micro-batch.

    Every pipeline stage reads it (each needs the conversation boundaries for its attention
    masks and rotary positions); tensor-parallel rank 0 reads, the other TP ranks receive it.
    Under context parallelism each CP rank keeps its load-balanced chunks of the [b, s] tensors
    and the whole row's cu_seqlens (get_batch_on_this_cp_rank).
    """
    keys = ("tokens", "labels", "position_ids", "cu_seqlens")
    data: Optional[Dict[str, torch.Tensor]] = next(data_iterator) if data_iterator is not None else None
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        if data is not None:
            data = {**{key: data[key].to(torch.int64) for key in keys}, "loss_mask": data["loss_mask"].float()}
        received = tensor_parallel.broadcast_data(list(keys), data, torch.int64)
        received.update(tensor_parallel.broadcast_data(["loss_mask"], data, torch.float32))
        data = received
    target = device.get_device()
    batch = {key: data[key].to(target, non_blocking=True)
             for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens")}
    batch = get_batch_on_this_cp_rank(batch)  # [b, s/N] each under CP; cu_seqlens whole
    return tuple(batch.values())


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of the per-token losses under loss_mask, the token count, and the reported [sum, count].

    The schedule turns the sum into a mean per micro-batch (Megatron's default) or, with
    --calculate-per-token-loss, into a mean over every token of the global batch.
    """
    losses = output_tensor.float()  # [b, s]
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1) * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting_loss = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": reporting_loss}


def forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """Forward one micro-batch; returns the per-token losses and the loss function to apply."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    if get_args().sft:
        tokens, labels, loss_mask, position_ids, cu_seqlens = get_sft_batch(data_iterator)
        timers("batch-generator", log_level=2).stop()
        output_tensor = model(tokens, position_ids, None, labels=labels,
                              packed_seq_params=PackedSeqParams(cu_seqlens))
        return output_tensor, partial(loss_func, loss_mask)
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator", log_level=2).stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank() -> bool:
    """Tensor-parallel rank 0 of the first and last pipeline stages reads the data (with --sft: of
    every stage, which all need the conversation boundaries)."""
    if get_args().sft:
        return parallel_state.get_tensor_model_parallel_rank() == 0
    return ((parallel_state.is_pipeline_first_stage(ignore_virtual=True)
             or parallel_state.is_pipeline_last_stage(ignore_virtual=True))
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def train_valid_test_datasets_provider(train_val_test_num_samples: List[int]):
    """GPT datasets for --data-path / --split (or the per-split paths, or --mock-data)."""
    from megatron.training.arguments import gpt_dataset_config_from_args
    from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.data.gpt_dataset import GPTDataset

    args = get_args()
    if args.sft:
        return _sft_datasets(args, train_val_test_num_samples)
    config = gpt_dataset_config_from_args(args, get_tokenizer_or_build())
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, train_val_test_num_samples, is_dataset_built_on_rank,
                                             config).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


def _sft_datasets(args, train_val_test_num_samples: List[int]):
    """--sft: chat conversations from JSON lines (megatron/data/sft_dataset.py), blended and split as GPT data."""
    from megatron.training.config_builders import sft_dataset_config_from_args
    from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.data.sft_dataset import SFTDataset

    config = sft_dataset_config_from_args(args, get_tokenizer_or_build())
    print_rank_0(f"> building train, validation, and test SFT datasets "
                 f"(prompt format {args.sft_tokenizer_prompt_format}) ...")
    datasets = BlendedMegatronDatasetBuilder(SFTDataset, train_val_test_num_samples, is_dataset_built_on_rank,
                                             config).build()
    print_rank_0("> finished creating SFT datasets ...")
    return datasets


def pretrain_arguments() -> dict:
    """pretrain()'s arguments for this recipe (main and megatron.training.api.pretrain use them)."""
    return dict(train_valid_test_dataset_provider=train_valid_test_datasets_provider, model_provider=model_provider,
                model_type=ModelType.encoder_or_decoder, forward_step_func=forward_step,
                args_defaults={"tokenizer_type": "GPT2BPETokenizer"})


def main(argv: Optional[List[str]] = None, record_history: bool = False):
    """Train with the flags in argv (None: sys.argv); returns megatron.training.training.TrainingResult."""
    return pretrain(**pretrain_arguments(), argv=argv, record_history=record_history)
