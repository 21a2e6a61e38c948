"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel ranks.

The [s, b, v] logits are never gathered: each rank holds [s, b, v/t] and the softmax needs only
three scalars per token from the group -- the max (for a stable exp), the target's logit (held
by one rank), and the sum of exps -- each an all-reduce of [s, b] (a fourth, the sum of the
log-probabilities, with label smoothing). With t = 1 no collective is issued.

Padding: the padded vocabulary (a multiple of make_vocab_size_divisible_by x t) has ids the
tokenizer never produces. Their logits are set to -inf here, so they take no probability and
get no gradient: the loss is the same for any padding, i.e. for any t.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import communication, parallel_state
from megatron.core.tensor_parallel.utils import VocabUtility


def _all_reduce_tp(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return tensor
    return communication.all_reduce(tensor, group=parallel_state.get_tensor_model_parallel_group(), op=op)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, unpadded_vocab_size):
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        partition_vocab = vocab_parallel_logits.size(-1)
        first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(partition_vocab, rank, world_size)
        vocab_size = partition_vocab * world_size if unpadded_vocab_size is None else unpadded_vocab_size
        # Columns [0, num_real) of this slice are real ids; the rest (if any) padding.
        num_real = min(max(vocab_size - first, 0), partition_vocab)

        logits = vocab_parallel_logits.clone()  # [s, b, v/t], not modified in place in the caller
        if num_real < partition_vocab:
            logits[..., num_real:] = float("-inf")

        # Subtract the global max so exp cannot overflow; -inf padding stays -inf (exp -> 0).
        logits_max = _all_reduce_tp(logits.max(dim=-1)[0], op=dist.ReduceOp.MAX)  # [s, b]
        logits -= logits_max.unsqueeze(-1)

        # The target's logit lives on exactly one rank; the others contribute 0 to the sum.
        target_outside = (target < first) | (target >= last)  # [s, b]
        local_target = (target - first).masked_fill(target_outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [s, b]
        predicted = _all_reduce_tp(predicted.masked_fill(target_outside, 0.0))

        exp_logits = logits.exp()  # [s, b, v/t]
        sum_exp = _all_reduce_tp(exp_logits.sum(dim=-1))  # [s, b]
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - predicted  # -log p(target), [s, b]

        if label_smoothing > 0.0:
            # PyTorch's definition: (1 - eps) * nll + eps * mean over the V real ids of -log p_k.
            sum_log_probs = logits[..., :num_real].sum(dim=-1) - num_real * log_sum_exp  # local part
            sum_log_probs = _all_reduce_tp(sum_log_probs)
            loss = (1.0 - label_smoothing) * loss - label_smoothing * sum_log_probs / vocab_size

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))  # [s, b, v/t], 0 on padding
        ctx.save_for_backward(softmax, target_outside, local_target)
        ctx.label_smoothing, ctx.vocab_size, ctx.num_real = label_smoothing, vocab_size, num_real
        return loss

    @staticmethod
    def backward(ctx, grad_output):  # grad_output [s, b]
        softmax, target_outside, local_target = ctx.saved_tensors
        # d loss / d logit_k = p_k - (1 - eps) [k = target] - eps / V [k real]
        grad_input = softmax.clone()  # [s, b, v/t]
        one_hot_weight = (1.0 - ctx.label_smoothing) * (~target_outside).to(grad_input.dtype)  # [s, b]
        grad_input.scatter_add_(-1, local_target.unsqueeze(-1), -one_hot_weight.unsqueeze(-1))
        if ctx.label_smoothing > 0.0:
            grad_input[..., : ctx.num_real] -= ctx.label_smoothing / ctx.vocab_size
        grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    unpadded_vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token loss [s, b] from this rank's logits [s, b, v/t] and global target ids [s, b].

    unpadded_vocab_size: ids from here up are padding, excluded from the softmax (None: none).
    label_smoothing follows torch.nn.functional.cross_entropy: the smoothing mass is spread
    over the real ids, the target included. Computed in the logits' dtype.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    total_vocab = vocab_parallel_logits.size(-1) * parallel_state.get_tensor_model_parallel_world_size()
    if unpadded_vocab_size is not None and not 0 < unpadded_vocab_size <= total_vocab:
        raise ValueError(
            f"unpadded_vocab_size ({unpadded_vocab_size}) must be in [1, padded vocabulary ({total_vocab})]"
        )
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, unpadded_vocab_size)
