"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel ranks.

The [s, b, v] logits are never gathered: each rank holds [s, b, v/t] and the softmax needs only
three scalars per token from the group -- the max (for a stable exp), the target's logit (held
by one rank), and the sum of exps -- each an all-reduce of [s, b] (a fourth, the sum of the
log-probabilities, with label smoothing). With t = 1 no collective is issued.

Padding: the padded vocabulary (a multiple of make_vocab_size_divisible_by x t) has ids the
tokenizer never produces. With unpadded_vocab_size = the tokenizer's size their logits are set
to -inf here, so they take no probability and get no gradient: the loss is the same for any
padding, i.e. for any t. With None (or the padded size) every id takes part: Megatron's loss,
which GPTModel computes under --include-padded-vocab-in-loss. Both paths below honour it.

compute_dtype: the softmax runs in this dtype (fp32 for half-precision logits unless Megatron's
--fp16-lm-cross-entropy), cast inside the function, and the gradient is returned in the
logits' own dtype: no [s, b, v] fp32 copy of the logits is made outside it, nor cast back
after it.

One rank (t = 1) without label smoothing, computing in fp32 (or fp64), takes a shorter path, a few thousand tokens at a time
so that the fp32 temporaries stay in cache: ATen's softmax (one exp per logit), the loss as
-log of the target's probability (logsumexp - logit, exactly, for the rare token whose
probability is below 1e-30), and -- when the logits need a gradient -- softmax -
one_hot(target) written at once in the logits' dtype; backward
only scales that by grad_output, in place. Against the general path (max, target logit, sum
of exps as separate [s, b, v] passes, each all-reduced over TP) that reads the logits once
and writes the gradient once. For half-precision logits the gradient is rounded to their
dtype before the scaling by grad_output and after it (the general path: once). Tests compare
the two. As in Megatron the saved buffer is scaled in place by backward: a second backward
through the same graph (retain_graph=True) raises instead of returning a wrong gradient.
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


_ROWS_PER_CHUNK_BYTES = 4 << 20  # fp32 probabilities of one chunk of tokens: stays in cache
_TINY_PROB = 1e-30  # above fp32's smallest normal (1.2e-38) by enough that -log(p) keeps ~7 digits


class _CrossEntropyOneRank(torch.autograd.Function):
    """t = 1, no label smoothing: loss = -log_softmax(logits)[target], see the module docstring."""

    @staticmethod
    def forward(ctx, logits, target, unpadded_vocab_size, compute_dtype):
        vocab = logits.size(-1)
        num_real = vocab if unpadded_vocab_size is None else unpadded_vocab_size
        rows = logits.reshape(-1, vocab)  # [n, v]
        labels = target.reshape(-1, 1)  # [n, 1]
        loss = torch.empty(rows.size(0), dtype=compute_dtype, device=logits.device)
        needs_grad = ctx.needs_input_grad[0]
        # softmax - one_hot(target), the gradient up to grad_output's per-token factor, in the logits' dtype
        grad = torch.empty_like(rows) if needs_grad else None
        # CPU: chunks whose fp32 probabilities stay in cache. Elsewhere one chunk: the check for
        # underflowing probabilities below synchronises with the device once per chunk.
        step = max(1, _ROWS_PER_CHUNK_BYTES // (4 * num_real)) if logits.device.type == "cpu" else rows.size(0)
        for start in range(0, rows.size(0), step):
            end = min(start + step, rows.size(0))
            chunk, chunk_labels = rows[start:end, :num_real], labels[start:end]  # padding excluded
            probs = torch.softmax(chunk, dim=-1, dtype=compute_dtype)  # one exp per logit
            target_probs = probs.gather(-1, chunk_labels).squeeze(-1)
            torch.neg(target_probs.log(), out=loss[start:end])
            # -log p loses precision as p nears the underflow threshold: those tokens (a
            # confidently wrong prediction, rare) get logsumexp - logit, computed exactly.
            tiny = (target_probs < _TINY_PROB).nonzero().squeeze(-1)
            if tiny.numel():
                exact = chunk[tiny].to(compute_dtype)
                loss[start + tiny] = exact.logsumexp(-1) - exact.gather(-1, chunk_labels[tiny]).squeeze(-1)
            if needs_grad:
                probs.scatter_add_(-1, chunk_labels, probs.new_full((1, 1), -1.0).expand(end - start, 1))
                grad[start:end, :num_real] = probs
        if needs_grad:
            grad[:, num_real:] = 0.0  # vocabulary padding: no probability, no gradient
            ctx.save_for_backward(grad)
        ctx.shape, ctx.consumed = logits.shape, False
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):  # grad_output [s, b]
        if ctx.consumed:
            raise RuntimeError("vocab_parallel_cross_entropy: backward ran twice through the same graph "
                               "(retain_graph=True); its saved gradient is consumed by the first backward")
        ctx.consumed = True
        (grad,) = ctx.saved_tensors
        # In place, as Megatron scales its saved softmax; in the gradient's dtype (a bf16 tensor times
        # an fp32 one takes ATen's slow mixed-dtype loop: 30x slower here).
        grad.mul_(grad_output.reshape(-1, 1).to(grad.dtype))
        return grad.view(ctx.shape), None, None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, unpadded_vocab_size, compute_dtype):
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        partition_vocab = vocab_parallel_logits.size(-1)
        first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(partition_vocab, rank, world_size)
        vocab_size = partition_vocab * world_size if unpadded_vocab_size is None else unpadded_vocab_size
        # Columns [0, num_real) of this slice are real ids; the rest (if any) padding.
        num_real = min(max(vocab_size - first, 0), partition_vocab)

        ctx.logits_dtype = vocab_parallel_logits.dtype
        # [s, b, v/t] in compute_dtype, a copy: the caller's logits are not modified in place
        logits = vocab_parallel_logits.to(compute_dtype, copy=True)
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
        return grad_input.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    unpadded_vocab_size: int | None = None,
    compute_dtype: torch.dtype | None = None,
    one_rank_fast_path: bool = True,
) -> torch.Tensor:
    """Per-token loss [s, b] (in compute_dtype) from this rank's logits [s, b, v/t] and global target ids [s, b].

    unpadded_vocab_size: ids from here up are padding, excluded from the softmax (None: none).
    label_smoothing follows torch.nn.functional.cross_entropy: the smoothing mass is spread
    over the real ids, the target included. Computed in compute_dtype (None: the logits'
    dtype); the logits' gradient comes back in their own dtype. one_rank_fast_path=False keeps
    the general path on one rank too (the model's plain path, --fused-kernels-cpu-impl reference).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    total_vocab = vocab_parallel_logits.size(-1) * parallel_state.get_tensor_model_parallel_world_size()
    if unpadded_vocab_size is not None and not 0 < unpadded_vocab_size <= total_vocab:
        raise ValueError(
            f"unpadded_vocab_size ({unpadded_vocab_size}) must be in [1, padded vocabulary ({total_vocab})]"
        )
    compute_dtype = compute_dtype or vocab_parallel_logits.dtype
    # The short path takes -log p, which needs fp32's range (an fp16 softmax underflows at 6e-8).
    if (one_rank_fast_path and label_smoothing == 0.0 and compute_dtype in (torch.float32, torch.float64)
            and parallel_state.get_tensor_model_parallel_world_size() == 1):
        return _CrossEntropyOneRank.apply(vocab_parallel_logits, target, unpadded_vocab_size, compute_dtype)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, unpadded_vocab_size,
                                            compute_dtype)
