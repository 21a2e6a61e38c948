"""finetune(): Megatron's BERT fine-tuning loop (tasks/finetune_utils.py), on our training machinery.

    datasets            train_valid_datasets_provider() -> (train, valid); --epochs x the batches
                        of an epoch gives train_iters (set before the LR schedule is built)
    model, optimizer    megatron.training.training.setup_model_and_optimizer (--load resumes exactly:
                        weights, optimizer, scheduler, RNG, and the epoch/batch position)
    --pretrained-checkpoint   loaded when --load holds no checkpoint (iteration 0): the BERT trunk's
                        weights only (no optimizer, scheduler or RNG); the task head starts new
    each epoch          the batches in DistributedSampler order (shuffled with seed --seed + epoch),
                        train_step per batch with Megatron's log line (`lm loss`), --save-interval,
                        --eval-interval (the loss on --valid-data), --exit-interval; at the end of the
                        epoch a checkpoint (--save) and then the accuracy on each --valid-data set;
                        <save>/best_checkpoint.json names the iteration of the best overall accuracy
    --epochs 0          evaluation only: the accuracy at "epoch -1", and the predictions written to
                        --load (as Megatron means to: its own path asserts)

As Megatron: one micro-batch per step (--global-batch-size = --micro-batch-size x data-parallel
size), no batch-size ramp-up, --keep-last keeps the last (incomplete) training batch. Where we
differ: the batches are collated in the main process (no DataLoader workers: a DataLoader draws from
the global RNG at every epoch start, which a run resumed mid-epoch could not repeat), and a
checkpoint already written at the epoch's last iteration (--save-interval) is not written twice.
"""

from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate
from torch.utils.data.distributed import DistributedSampler

from megatron.training.arguments_validation import ArgsError
from megatron.core import communication, device, parallel_state
from megatron.core.enums import ModelType
from megatron.training.global_vars import get_args, get_num_microbatches, get_timers
from megatron.training.training import (
    IterationRecord,
    TrainingResult,
    _Loop,
    setup_model_and_optimizer,
    train_step_report,
)
from megatron.training.training_log import Progress, num_floating_point_operations
from megatron.training.utils import print_rank_0


@dataclass
class FinetuneResult:
    """What finetune() did: every iteration (losses as computed) and every accuracy line."""

    iteration: int = 0
    exit_reason: str = "completed"
    history: List[IterationRecord] = field(default_factory=list)
    # (epoch, dataset name, correct, total); name "overall" for the sum over the sets
    accuracy: List[Tuple[int, str, int, int]] = field(default_factory=list)


def process_batch(batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """(tokens, types, labels, padding mask) of a collated batch, on the device."""
    target = device.get_device()
    tokens = batch["text"].long().to(target).contiguous()
    types = batch["types"].long().to(target).contiguous()
    labels = batch["label"].long().to(target).contiguous()
    attention_mask = batch["padding_mask"].long().to(target).contiguous()
    return tokens, types, labels, attention_mask


def _next_batch(batch_or_iterator) -> Dict[str, torch.Tensor]:
    """A batch itself (train_step passes one) or the next of an iterator (evaluation's)."""
    if isinstance(batch_or_iterator, dict):
        return batch_or_iterator
    return next(batch_or_iterator)


def cross_entropy_loss_func(labels: torch.Tensor, output_tensor: torch.Tensor):
    loss = torch.nn.functional.cross_entropy(output_tensor.contiguous().float(), labels)
    return loss, {"lm loss": loss.detach()}  # Megatron's name; the loop averages it over DP


def cross_entropy_forward_step(batch, model: torch.nn.Module):
    """Forward one batch (every pipeline stage reads it: each needs the padding mask)."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, types, labels, attention_mask = process_batch(_next_batch(batch))
    timers("batch-generator", log_level=2).stop()
    output_tensor = model(tokens, attention_mask, tokentype_ids=types)
    return output_tensor, partial(cross_entropy_loss_func, labels)


class EpochBatches:
    """Megatron's build_data_loader: DistributedSampler (over the data-parallel group, shuffled,
    seed 0, set_epoch(e)) batched by micro_batch_size, the last incomplete batch dropped when
    drop_last. Collated in this process; batches(start=k) skips k batches without reading them."""

    def __init__(self, dataset: Dataset, micro_batch_size: int, drop_last: bool) -> None:
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.drop_last = drop_last
        self.sampler = DistributedSampler(dataset, num_replicas=parallel_state.get_data_parallel_world_size(),
                                          rank=parallel_state.get_data_parallel_rank())

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.micro_batch_size if self.drop_last else math.ceil(n / self.micro_batch_size)

    def batches(self, epoch: Optional[int] = None, start: int = 0) -> Iterator[Dict[str, torch.Tensor]]:
        if epoch is not None:
            self.sampler.set_epoch(epoch)
        indices = list(self.sampler)
        for b in range(start, len(self)):
            chunk = indices[b * self.micro_batch_size:(b + 1) * self.micro_batch_size]
            yield default_collate([self.dataset[i] for i in chunk])

    def forever(self) -> Iterator[Dict[str, torch.Tensor]]:
        """Megatron's _build_infinite_size_dataloader: the same order again and again."""
        if len(self) == 0:
            raise ArgsError(f"--valid-data holds {len(self.dataset)} samples: not one batch of "
                            f"{self.micro_batch_size} per data-parallel rank for --eval-interval (give --keep-last)")
        while True:
            yield from self.batches()


def _build_train_valid_batches(train_dataset: Dataset, valid_dataset: Dataset) -> Tuple[EpochBatches, Iterator]:
    """The loaders, train_iters from --epochs, and the batch sizes scaled by sample_multiplier."""
    args = get_args()
    print_rank_0("building train and validation dataloaders ...")
    train = EpochBatches(train_dataset, args.micro_batch_size, drop_last=not args.keep_last)
    args.train_iters_per_epoch = len(train)
    args.train_iters = args.epochs * args.train_iters_per_epoch
    if args.train_iters_per_epoch == 0:
        raise ArgsError(f"--train-data holds {len(train_dataset)} samples: not one batch of --micro-batch-size "
                        f"{args.micro_batch_size} per data-parallel rank (give --keep-last for the incomplete one)")
    valid = EpochBatches(valid_dataset, args.micro_batch_size, drop_last=not args.keep_last).forever()
    # The model sees sample_multiplier rows per sample (RACE: one per choice): the pipeline's
    # tensor shapes and the LR schedule's sample counts follow (Megatron's).
    args.orig_micro_batch_size = args.micro_batch_size
    args.orig_global_batch_size = args.global_batch_size
    multiplier = getattr(train_dataset, "sample_multiplier", 1)
    args.micro_batch_size *= multiplier
    args.global_batch_size *= multiplier
    return train, valid


def load_pretrained_checkpoint(model: List[torch.nn.Module], optimizer: Any, args: argparse.Namespace) -> None:
    """The model's weights from --pretrained-checkpoint (torch or torch_dist), as --finetune loads them:
    no optimizer, scheduler, RNG or iteration; keys the task model lacks or adds are its load_state_dict's
    business (megatron/model/classification.py)."""
    from megatron.training.checkpointing import load_checkpoint

    pretrained = copy.copy(args)
    pretrained.finetune, pretrained.no_load_optim, pretrained.no_load_rng = True, True, True
    saved = _torch_dist_names(args.pretrained_checkpoint)
    if saved is not None:  # torch_dist reads into the model's tensors: the key check is here
        _check_torch_dist_names(model, saved, args.pretrained_checkpoint)
    load_checkpoint(model, None, None, load_arg="pretrained_checkpoint", strict=False, args=pretrained)
    optimizer.reload_model_params()  # the fp32 main copies follow the loaded weights


def _torch_dist_names(load_dir: str) -> Optional[set]:
    """The tensor names of the torch_dist checkpoint the tracker in load_dir names (None: another format)."""
    import os

    from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename, read_metadata
    from megatron.dist_checkpointing.common import DCP_METADATA
    from megatron.dist_checkpointing.dcp_io import read_dcp_metadata

    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        return None
    iteration, release = read_metadata(tracker)
    path = os.path.join(get_checkpoint_name(load_dir, iteration, release, return_base_dir=True), DCP_METADATA)
    return set(read_dcp_metadata(path).state_dict_metadata) if os.path.isfile(path) else None


def _check_torch_dist_names(model: List[torch.nn.Module], saved: set, load_dir: str) -> None:
    from megatron.training.checkpointing import CheckpointError
    from megatron.dist_checkpointing.layout import model_layouts

    names = [layout.name for layout, _ in model_layouts(model)]  # global names (layer numbers across stages)
    inner = model[0]
    while hasattr(inner, "module"):
        inner = inner.module
    fill = getattr(inner, "fill_new_keys", None)
    if fill is None:
        return
    try:
        fill(saved, names)
    except RuntimeError as error:
        raise CheckpointError(f"--pretrained-checkpoint {load_dir}: {error}") from None


def _check_flags(args: argparse.Namespace) -> None:
    if args.rampup_batch_size is not None:
        raise ArgsError("--rampup-batch-size: batch size scaling is not supported for finetuning")
    if get_num_microbatches() != 1:
        raise ArgsError(f"finetuning takes one micro-batch per step (Megatron's): --global-batch-size "
                        f"{args.global_batch_size} must be --micro-batch-size x data-parallel size "
                        f"({args.micro_batch_size} x {args.data_parallel_size})")
    if args.epochs is None:
        raise ArgsError("--epochs is required for fine-tuning (0: evaluation only)")
    if args.epochs == 0 and args.load is None:
        raise ArgsError("--epochs 0 (evaluation only) writes its predictions to --load: give --load "
                        "(the fine-tuned checkpoint)")
    if args.epochs > 0 and not args.train_data:
        raise ArgsError("--train-data is required with --epochs > 0")
    if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
        raise ArgsError("the interleaved pipeline schedule is not supported for downstream tasks")


def _train(loop: _Loop, forward_step: Callable, train: EpochBatches, valid: Iterator,
           end_of_epoch_callback: Optional[Callable], history: bool) -> None:
    """Megatron's finetune _train: epochs of train_step from the resumed (epoch, batch) position."""
    args = get_args()
    model = loop.model
    for chunk in model:
        chunk.train()
    start_epoch = args.iteration // args.train_iters_per_epoch
    start_iteration = args.iteration % args.train_iters_per_epoch
    iteration = args.iteration
    progress = Progress(iteration, args.train_iters)
    get_timers()("interval-time").start()
    for epoch in range(start_epoch, args.epochs):
        print_rank_0(f"working on epoch {epoch + 1} ...")
        for batch in train.batches(args.seed + epoch, start=start_iteration):
            start_iteration = 0
            losses, skipped, grad_norm, num_zeros = train_step_report(forward_step, batch, model, loop.optimizer,
                                                                      loop.opt_param_scheduler)
            iteration += 1
            loop.result.iteration = iteration
            batch_size = args.micro_batch_size * args.data_parallel_size
            args.consumed_train_samples += batch_size
            loop.result.num_floating_point_operations_so_far += num_floating_point_operations(args, batch_size)
            if history:
                loop.result.history.append(IterationRecord(
                    iteration, dict(losses), skipped, grad_norm, loop.optimizer.param_groups[0]["lr"],
                    float(loop.optimizer.get_loss_scale()), batch_size))
            loop._log(iteration, losses, skipped, grad_norm, num_zeros, batch_size, progress)
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                loop.save()
            if args.eval_interval and iteration % args.eval_interval == 0:
                loop.evaluate_and_print(f"iteration {iteration}", valid)
            if args.exit_interval and iteration % args.exit_interval == 0:
                if args.save and loop.last_saved_iteration != iteration:
                    loop.save()
                if torch.distributed.is_initialized():
                    communication.barrier()
                print_rank_0(f"exiting program at iteration {iteration}")
                loop.result.exit_reason = "interval"
                return
        if args.save and loop.last_saved_iteration != iteration:
            loop.save()  # the end of each epoch
        if end_of_epoch_callback is not None:
            end_of_epoch_callback(model, epoch)
            if args.save:
                keep_best(args.save, epoch, iteration, getattr(end_of_epoch_callback, "records", []))


BEST_CHECKPOINT = "best_checkpoint.json"


def keep_best(save_dir: str, epoch: int, iteration: int, records: List[Tuple[int, str, int, int]]) -> None:
    """Name the best checkpoint: when this epoch's overall validation accuracy beats the one in
    <save>/best_checkpoint.json (or there is none), that file is rewritten with this epoch's
    iteration, whose checkpoint was just saved (ours: Megatron keeps every epoch's checkpoint and
    names none). Checkpoints are never deleted, so the best one is kept; to load it, point
    latest_checkpointed_iteration.txt at its iteration."""
    import json
    import os

    overall = [(correct, total) for e, name, correct, total in records if e == epoch and name == "overall"]
    if not overall or not overall[-1][1]:
        return
    correct, total = overall[-1]
    accuracy = correct / total
    path = os.path.join(save_dir, BEST_CHECKPOINT)
    best = None
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            best = json.load(handle)
    if best is None or accuracy > best["overall_accuracy"]:
        best = {"iteration": iteration, "epoch": epoch, "overall_accuracy": accuracy}
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            from megatron.core.atomic_io import atomic_write

            atomic_write(path, lambda f: f.write(json.dumps(best).encode()))
    print_rank_0(f" >> best checkpoint: iteration {best['iteration']} (epoch {best['epoch']}), overall accuracy "
                 f"{100 * best['overall_accuracy']:.4f} % ({BEST_CHECKPOINT})")


def finetune(train_valid_datasets_provider: Callable, model_provider: Callable,
             model_type: ModelType = ModelType.encoder_or_decoder, forward_step: Callable = cross_entropy_forward_step,
             end_of_epoch_callback_provider: Optional[Callable] = None, record_history: bool = False) -> FinetuneResult:
    """Megatron's finetune(): see the module docstring. Returns what it did (FinetuneResult)."""
    args = get_args()
    _check_flags(args)
    train = valid = None
    if args.epochs > 0:
        train, valid = _build_train_valid_batches(*train_valid_datasets_provider())
    else:
        args.train_iters = 0
    end_of_epoch_callback = end_of_epoch_callback_provider() if end_of_epoch_callback_provider is not None else None

    lengths = args.train_iters
    args.train_iters = max(args.train_iters, 1)  # the LR schedule needs a length; evaluation only has none
    # --load first (a resumed run); the pretrained model only when that found nothing (Megatron's
    # order), loaded here: a task model takes the BERT trunk of it, not the pretraining heads.
    pretrained, args.pretrained_checkpoint = args.pretrained_checkpoint, None
    no_load_optim = args.no_load_optim
    if args.epochs == 0:
        args.no_load_optim = True  # nothing is trained: the weights only (its LR schedule would not fit)
    try:
        model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type)
    finally:
        args.pretrained_checkpoint, args.no_load_optim = pretrained, no_load_optim
    args.train_iters = lengths
    if args.iteration == 0 and args.pretrained_checkpoint is not None:
        load_pretrained_checkpoint(model, optimizer, args)
    print_rank_0("done with setups ...")
    print_rank_0("training ...")

    training = TrainingResult(iteration=args.iteration,
                              num_floating_point_operations_so_far=args.num_floating_point_operations_so_far)
    loop = _Loop(forward_step, model, optimizer, opt_param_scheduler, training, record_history)
    if args.epochs > 0:
        _train(loop, forward_step, train, valid, end_of_epoch_callback, record_history)
    elif end_of_epoch_callback is not None:
        print_rank_0("evaluation only mode, setting epoch to -1")
        end_of_epoch_callback(model, epoch=-1, output_predictions=True)
    result = FinetuneResult(training.iteration, training.exit_reason, training.history,
                            list(getattr(end_of_epoch_callback, "records", [])))
    print_rank_0("done :-)")
    return result
