"""GPT zero-shot evaluation: WikiText-103 perplexity and LAMBADA last-word accuracy (Megatron-LM's).

    tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens [--overlapping-eval 32] ...
    tasks/main.py --task LAMBADA --valid-data lambada_test.jsonl [--strict-lambada] ...

Each batch of samples (datasets.py) goes through the pipeline schedule's forward-only path, as
megatron/training/training.py's evaluation does, so TP, SP, PP and DP all work; every rank builds the same
dataset, data-parallel rank r takes samples r, r + dp, ..., and the sums are added over the
data-parallel group on the last stage. The last rank prints Megatron's lines:

    WIKITEXT103   loss = sum of the counted targets' losses / (T - 1)          T: detokenized tokens
                  ppl = exp(min(20, loss))
                  token ratio = (T - 1) / (W - 1)                              W: original words
                  adjusted ppl = exp(min(20, loss * token ratio))
    LAMBADA       a sample is correct when the greedy (argmax) prediction equals the target at
                  every target token; accuracy = correct / samples
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Dict, List

import numpy as np
import torch

from megatron.core import communication, device, parallel_state
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.utils import unwrap_model
from megatron.training.global_vars import get_tokenizer
from megatron.training.utils import print_rank_0, print_rank_last
from tasks.errors import TaskError
from tasks.zeroshot_gpt.datasets import build_lambada_dataset, build_wikitext103_dataset

METRICS = {"WIKITEXT103": "loss", "LAMBADA": "accuracy"}
# validate_args wants a training length and a learning rate; evaluation uses neither.
ARGS_DEFAULTS = {"train_iters": 1, "lr": 0.0}


def get_model_provider(eval_metric: str):
    """pretrain_gpt's GPT, with the full vocabulary gathered for accuracy (an argmax needs it)."""

    def model_provider(pre_process: bool = True, post_process: bool = True):
        from pretrain_gpt import model_provider as gpt_model_provider

        model = gpt_model_provider(pre_process, post_process)
        model.parallel_output = eval_metric == "loss"  # loss: the vocab-parallel cross entropy, no gather
        return model

    return model_provider


def load_model(args, eval_metric: str) -> List[torch.nn.Module]:
    """The model chunks of this rank with the weights of --load (or --pretrained-checkpoint, --load-hf)."""
    from megatron.training.checkpointing import CheckpointError, checkpoint_exists, load_checkpoint
    from megatron.training.load_hf import load_hf_instead, load_hf_weights
    from megatron.training.training import get_model

    if args.load is None and args.pretrained_checkpoint is None and args.load_hf is None:
        raise TaskError(f"--task {args.task} evaluates a trained model: pass --load CHECKPOINT_DIR "
                        "(with --no-load-optim --no-load-rng, as Megatron's commands) or --load-hf HF_DIR")
    model = get_model(get_model_provider(eval_metric))
    if load_hf_instead(args):
        load_hf_weights(model, args, get_tokenizer().vocab_size)
    else:
        if not checkpoint_exists(args.load) and args.pretrained_checkpoint is None:
            raise CheckpointError(f"--load {args.load}: no checkpoint there (no latest_checkpointed_iteration.txt)")
        load_checkpoint(model, None, None, args=args)
    return model


def _collate(dataset, indices: List[int]) -> Dict[str, torch.Tensor]:
    samples = [dataset[i] for i in indices]
    return {key: torch.from_numpy(np.stack([sample[key] for sample in samples])) for key in ("text", "pad_mask")}


def _loss_sum(loss_mask: torch.Tensor, losses: torch.Tensor):
    total = torch.sum(losses.float() * loss_mask)  # [b, s] per-token losses, the counted ones
    return total, {"loss": total.detach().double()}


def _num_correct(labels: torch.Tensor, loss_mask: torch.Tensor, vocab: int, logits: torch.Tensor):
    predicted = torch.argmax(logits[..., :vocab], dim=-1)  # [b, s]; the padded vocabulary's ids never win
    correct = (predicted == labels).float()
    correct[loss_mask == 0] = 1  # only the target tokens count, and all of them must be right
    total = correct.prod(dim=-1).sum()
    return total, {"accuracy": total.detach().double()}


def forward_step(data_iterator, model: torch.nn.Module, eval_metric: str):
    """One batch: {"text": [b, s + 1], "pad_mask": [b, s]} -> per-token losses or logits."""
    batch = next(data_iterator)
    target = device.get_device()
    text = batch["text"].to(target, dtype=torch.int64)
    loss_mask = batch["pad_mask"].to(target, dtype=torch.float32)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()  # [b, s] each
    position_ids = torch.arange(tokens.shape[1], device=target).unsqueeze(0).expand_as(tokens)
    if eval_metric == "loss":
        output = model(tokens, position_ids, None, labels=labels)  # [b, s] losses (causal: None mask)
        return output, partial(_loss_sum, loss_mask)
    output = model(tokens, position_ids, None)  # [b, s, vocab] gathered logits (last stage)
    return output, partial(_num_correct, labels, loss_mask, unwrap_model(model).loss_vocab_size)


def evaluate(dataset, model: List[torch.nn.Module], eval_metric: str, args) -> float:
    """The sum of the metric over the dataset (loss: of the counted targets; accuracy: correct samples)."""
    dp_size = parallel_state.get_data_parallel_world_size()
    indices = list(range(parallel_state.get_data_parallel_rank(), len(dataset), dp_size))
    batches = [indices[i:i + args.micro_batch_size] for i in range(0, len(indices), args.micro_batch_size)]
    forward_backward = get_forward_backward_func()
    for chunk in model:
        chunk.eval()
    total = torch.zeros((), dtype=torch.float64, device=device.get_device())
    with torch.no_grad():
        for iteration, batch in enumerate(batches):
            if iteration % args.log_interval == 0:
                print_rank_0(f"> working on iteration: {iteration}")
            reported = forward_backward(
                forward_step_func=partial(forward_step, eval_metric=eval_metric),
                data_iterator=iter([_collate(dataset, batch)]), model=model, num_microbatches=1,
                seq_length=args.seq_length, micro_batch_size=len(batch), forward_only=True)
            for values in reported:  # the last stage's; empty elsewhere
                total += values[eval_metric].to(total.device)
    if parallel_state.is_pipeline_last_stage():
        group = parallel_state.get_data_parallel_group()
        if group is not None and torch.distributed.get_world_size(group) > 1:
            communication.all_reduce(total, group=group)  # the replicas' disjoint samples
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # every rank returns the result
        communication.broadcast(total, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                group=parallel_state.get_pipeline_model_parallel_group())
    return float(total.item())


def wikitext_results(total_loss: float, num_tokenized_tokens: int, num_original_tokens: int) -> Dict[str, float]:
    """Megatron's WikiText numbers from the summed loss and the two token counts."""
    val_loss = total_loss / (num_tokenized_tokens - 1)
    token_ratio = (num_tokenized_tokens - 1) / (num_original_tokens - 1)
    return {"loss": val_loss, "ppl": math.exp(min(20, val_loss)), "token_ratio": token_ratio,
            "adjusted_ppl": math.exp(min(20, val_loss * token_ratio)), "loss_sum": total_loss,
            "num_tokenized_tokens": num_tokenized_tokens, "num_original_tokens": num_original_tokens}


def results_line(task: str, results: Dict[str, float]) -> str:
    """Megatron's ' validation results on TASK | ...' line."""
    string = f" validation results on {task} | "
    if "ppl" in results:
        string += "avg loss: {:.4E} | ".format(results["loss"])
        string += "ppl: {:.4E} | ".format(results["ppl"])
        string += "adjusted ppl: {:.4E} | ".format(results["adjusted_ppl"])
        string += "token ratio: {} |".format(results["token_ratio"])
    else:
        string += "number correct: {:.4E} | ".format(results["correct"])
        string += "total examples: {:.4E} | ".format(results["total"])
        string += "avg accuracy: {:.4E}".format(results["accuracy"])
    return string


def main(args) -> Dict[str, Any]:
    """Run --task WIKITEXT103 or LAMBADA; returns the numbers printed (the same on every rank)."""
    if args.task not in METRICS:
        raise TaskError(f"--task {args.task}: not a zero-shot GPT task (choices: {', '.join(METRICS)})")
    eval_metric = METRICS[args.task]
    tokenizer = get_tokenizer()
    build = build_wikitext103_dataset if args.task == "WIKITEXT103" else build_lambada_dataset
    dataset = build(args, tokenizer, log=print_rank_0)  # before the model: a bad file fails fast
    if args.task == "WIKITEXT103" and dataset.num_original_tokens < 2:
        raise TaskError(f"--valid-data {args.valid_data[0]}: {dataset.num_original_tokens} word(s); the token "
                        "ratio needs at least 2")
    model = load_model(args, eval_metric)
    total = evaluate(dataset, model, eval_metric, args)
    if eval_metric == "loss":
        results = wikitext_results(total, dataset.num_tokenized_tokens, dataset.num_original_tokens)
    else:
        results = {"correct": total, "total": len(dataset), "accuracy": total / len(dataset)}
    string = results_line(args.task, results)
    length = len(string) + 1
    print_rank_last("-" * length)
    print_rank_last(string)
    print_rank_last("-" * length)
    print_rank_0("done :-)")
    return {"task": args.task, **results}
