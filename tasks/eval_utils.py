"""Accuracy on each --valid-data set (Megatron's tasks/eval_utils.py): the end-of-epoch callback.

Printed on the last rank, as Megatron prints them:
     > |epoch: E| metrics for NAME: correct / total = C / T = P %, elapsed time (sec): S
     >> |epoch: E| overall: correct / total = C / T = P %
Each set is read in DistributedSampler order with micro-batches of --eval-micro-batch-size (default
the original --micro-batch-size)
(the last one incomplete unless data-parallel size > 1, where it is dropped); correct and total are
summed over the data-parallel group. With output_predictions (evaluation only, --epochs 0) the
softmaxes, labels and uids of every set go to --load/predictions_NAME1_NAME2...pt (torch.save of
[(name, (softmaxes, labels, uids))]), data-parallel size 1 only.
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Callable, Dict, List, Tuple

import torch

from megatron.training.arguments_validation import ArgsError
from megatron.core import communication, device, parallel_state
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.training.global_vars import get_args
from megatron.training.utils import is_last_rank, print_rank_last
from tasks.finetune_utils import EpochBatches, process_batch


class AccuracyCallback:
    """callback(model, epoch, output_predictions=False): the accuracy lines; records keeps
    (epoch, name, correct, total) for each set and "overall"."""

    def __init__(self, loaders: List[Tuple[str, EpochBatches]]) -> None:
        self.loaders = loaders
        self.records: List[Tuple[int, str, int, int]] = []

    def __call__(self, model, epoch: int, output_predictions: bool = False) -> None:
        args = get_args()
        print_rank_last("calculating metrics ...")
        if output_predictions and parallel_state.get_data_parallel_world_size() > 1:
            raise ArgsError("writing predictions (--epochs 0) needs data-parallel size 1")
        correct = total = 0
        named_predictions, names = [], "predictions"
        for name, loader in self.loaders:
            right, count, predictions = calculate_correct_answers(name, model, loader, epoch, output_predictions)
            correct, total = correct + right, total + count
            self.records.append((epoch, name, right, count))
            if output_predictions:
                named_predictions.append((name, predictions))
                names += "_" + name
        self.records.append((epoch, "overall", correct, total))
        if is_last_rank():
            percent = float(correct) * 100.0 / max(float(total), 1.0)
            print(f" >> |epoch: {epoch}| overall: correct / total = {correct} / {total} = {percent:.4f} %", flush=True)
        if output_predictions and is_last_rank():
            if args.load is None:
                raise ArgsError("evaluation only (--epochs 0) writes its predictions to --load: give --load")
            torch.save(named_predictions, os.path.join(args.load, names + ".pt"))


def accuracy_func_provider(single_dataset_provider: Callable) -> AccuracyCallback:
    """The callback over one dataset per --valid-data path (single_dataset_provider(path))."""
    args = get_args()
    micro_batch_size = (getattr(args, "eval_micro_batch_size", None)
                        or getattr(args, "orig_micro_batch_size", args.micro_batch_size))
    loaders = []
    for path in args.valid_data or []:
        dataset = single_dataset_provider(path)
        loaders.append((dataset.dataset_name, EpochBatches(
            dataset, micro_batch_size, drop_last=parallel_state.get_data_parallel_world_size() > 1)))
    return AccuracyCallback(loaders)


def _correct_answers_loss_func(output_predictions: bool, labels: torch.Tensor, uids: torch.Tensor,
                               output_tensor: torch.Tensor):
    predicted = torch.argmax(output_tensor, dim=-1)
    reported: Dict[str, object] = {"correct": (predicted == labels).sum().detach(), "total": labels.numel()}
    if output_predictions:
        reported["softmaxes"] = torch.softmax(output_tensor.float(), dim=-1).cpu().tolist()
        reported["labels"] = labels.cpu().tolist()
        reported["ids"] = uids.cpu().tolist()
    return torch.zeros((), device=output_tensor.device), reported


def calculate_correct_answers(name: str, model, loader: EpochBatches, epoch: int, output_predictions: bool):
    """(correct, total, (softmaxes, labels, ids) or ()) of one set; correct/total on every rank of the
    last stage (summed over data-parallel replicas), zero elsewhere."""
    args = get_args()
    forward_backward = get_forward_backward_func()
    start = time.time()
    for chunk in model:
        chunk.eval()
    multiplier = getattr(loader.dataset, "sample_multiplier", 1)
    correct, total = 0, 0
    softmaxes, labels, ids = [], [], []

    def forward_step(batch, model):
        tokens, types, labels_, attention_mask = process_batch(batch)
        output = model(tokens, attention_mask, tokentype_ids=types)
        return output, partial(_correct_answers_loss_func, output_predictions, labels_, batch["uid"])

    with torch.no_grad():
        for batch in loader.batches():
            actual = len(batch["label"])  # the last batch may be short: the pipeline's shapes follow it
            reported = forward_backward(forward_step_func=forward_step, data_iterator=batch, model=model,
                                        num_microbatches=1, seq_length=args.seq_length,
                                        micro_batch_size=actual * multiplier, forward_only=True)
            for values in reported:
                correct += int(values["correct"])
                total += int(values["total"])
                if output_predictions:
                    softmaxes += values["softmaxes"]
                    labels += values["labels"]
                    ids += values["ids"]
    for chunk in model:
        chunk.train()
    if not parallel_state.is_pipeline_last_stage():
        return 0, 0, ()
    counts = torch.tensor([correct, total], dtype=torch.long, device=device.get_device())
    group = parallel_state.get_data_parallel_group()
    if group is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        communication.all_reduce(counts, group=group)
    correct, total = int(counts[0]), int(counts[1])
    percent = float(correct) * 100.0 / max(float(total), 1.0)
    print_rank_last(f" > |epoch: {epoch}| metrics for {name}: correct / total = {correct} / {total} = "
                    f"{percent:.4f} %, elapsed time (sec): {time.time() - start:.3f}")
    return correct, total, (softmaxes, labels, ids)
