"""Per-token cross entropy over a large vocabulary: loss = logsumexp(logits) - logits[label].

logits [..., V] (any float dtype, V need not be a power of two), labels [...] int64; returns
loss [...] in fp32 (computed in fp32 for fp16/bf16 logits). Tokens whose label is ignore_index
get loss 0 and no gradient; loss_mask [...] (optional, bool or float) multiplies each token's
loss and gradient. vocab_size < V marks columns vocab_size.. as vocabulary padding (Megatron
pads to a multiple of 128 x TP): they take no probability and get a zero gradient.

Memory: the forward keeps the logits (no copy) and logsumexp per token ([n] fp32); there is no
saved softmax (F.cross_entropy keeps an fp32 [n, V] log-softmax). The backward writes the one
[n, V] gradient it must return, (softmax - one_hot(label)) * d loss * mask, recomputing the
softmax from the logits and logsumexp in the same pass.

Labels outside [0, vocab_size) (other than ignore_index): the reference and compiled paths
raise (torch's index error); the Triton kernel cannot raise and returns NaN for those tokens.
Label smoothing and vocabulary split across tensor-parallel ranks are not handled here
(megatron.core.tensor_parallel.vocab_parallel_cross_entropy does both).

CPU fast path: "compiled" -- torch.compile fuses the logsumexp (no [n, V] exp temporary) and
the backward's exp, one-hot subtraction and scaling into one pass; measured 1.66x faster than
the reference, forward + backward, at n=2048, V=8192 (bench/fused_ops.py --threads 1
--clock cpu), and 1.31x faster than F.cross_entropy.

Triton: the forward runs one program per token, streaming its row in blocks of up to 4096 with
an online max / sum-of-exp; the backward runs (token, block) programs writing the gradient.
"""

from __future__ import annotations

import torch

from megatron.fused_kernels.dispatch import FusedOp, Kernels, cdiv, compiled, kernel, next_power_of_2, tl

_MAX_BLOCK = 4096


def _forward_reference(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None,
                       ignore_index: int, vocab_size: int):
    """logits [n, V], labels [n] -> (loss [n] fp32, logsumexp [n] fp32)."""
    x = logits[:, :vocab_size].to(torch.promote_types(logits.dtype, torch.float32))  # [n, vocab_size]
    lse = torch.logsumexp(x, dim=-1)
    valid = labels != ignore_index
    target = x.gather(-1, labels.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1)
    loss = torch.where(valid, lse - target, 0.0)
    if loss_mask is not None:
        loss = loss * loss_mask
    return loss, lse


def _backward_reference(grad_loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                        loss_mask: torch.Tensor | None, lse: torch.Tensor, ignore_index: int,
                        vocab_size: int) -> torch.Tensor:
    """d logits [n, V] in logits' dtype."""
    valid = labels != ignore_index
    coef = torch.where(valid, grad_loss, 0.0)  # [n]
    if loss_mask is not None:
        coef = coef * loss_mask
    x = logits[:, :vocab_size].to(torch.promote_types(logits.dtype, torch.float32))
    grad = torch.exp(x - lse.unsqueeze(-1))  # softmax, [n, vocab_size]
    grad.scatter_add_(-1, labels.masked_fill(~valid, 0).unsqueeze(-1), -torch.ones_like(grad[:, :1]))
    grad.mul_(coef.unsqueeze(-1))
    if vocab_size < logits.shape[-1]:
        grad = torch.nn.functional.pad(grad, (0, logits.shape[-1] - vocab_size))  # padding columns: 0
    return grad.to(logits.dtype)


@kernel
def _forward_kernel(logits_ptr, labels_ptr, mask_ptr, loss_ptr, lse_ptr, row_stride, vocab_size, ignore_index,
                    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    m = -float("inf")  # running max
    s = 0.0  # running sum of exp(x - m)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    label = tl.load(labels_ptr + row)
    in_range = (label >= 0) & (label < vocab_size)
    target = tl.load(row_ptr + label, mask=in_range, other=0.0).to(tl.float32)
    loss = tl.where(in_range, lse - target, float("nan"))  # a bad label shows as NaN
    loss = tl.where(label == ignore_index, 0.0, loss)
    if HAS_MASK:
        loss = loss * tl.load(mask_ptr + row)
    tl.store(loss_ptr + row, loss)


@kernel
def _backward_kernel(grad_loss_ptr, logits_ptr, labels_ptr, mask_ptr, lse_ptr, grad_ptr, row_stride, vocab_size,
                     ignore_index, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    label = tl.load(labels_ptr + row)
    coef = tl.where(label == ignore_index, 0.0, tl.load(grad_loss_ptr + row).to(tl.float32))
    if HAS_MASK:
        coef = coef * tl.load(mask_ptr + row)
    x = tl.load(logits_ptr + row * row_stride + cols, mask=cols < vocab_size, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.load(lse_ptr + row))  # softmax; 0 on padding columns
    grad = (p - tl.where(cols == label, 1.0, 0.0)) * coef
    grad = tl.where(cols < vocab_size, grad, 0.0)
    tl.store(grad_ptr + row * row_stride + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < row_stride)


def _forward_triton(logits, labels, loss_mask, ignore_index, vocab_size):
    n, padded = logits.shape
    logits = logits.contiguous()
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n > 0:
        _forward_kernel[(n,)](logits, labels, loss_mask if loss_mask is not None else loss, loss, lse, padded,
                              vocab_size, ignore_index, HAS_MASK=loss_mask is not None,
                              BLOCK=min(_MAX_BLOCK, next_power_of_2(vocab_size)), num_warps=8)
    return loss, lse


def _backward_triton(grad_loss, logits, labels, loss_mask, lse, ignore_index, vocab_size):
    n, padded = logits.shape
    logits, grad_loss = logits.contiguous(), grad_loss.contiguous()
    grad = torch.empty_like(logits)
    block = min(_MAX_BLOCK, next_power_of_2(padded))
    if n > 0:
        _backward_kernel[(n, cdiv(padded, block))](grad_loss, logits, labels,
                                                   loss_mask if loss_mask is not None else lse, lse, grad, padded,
                                                   vocab_size, ignore_index, HAS_MASK=loss_mask is not None,
                                                   BLOCK=block, num_warps=8)
    return grad


OP = FusedOp(
    name="cross_entropy",
    cpu_fast_path="compiled",
    implementations={
        "reference": Kernels(_forward_reference, _backward_reference),
        "native": Kernels(_forward_reference, _backward_reference),  # logsumexp, gather, exp: ATen's own
        "compiled": Kernels(compiled(_forward_reference), compiled(_backward_reference)),
        "triton": Kernels(_forward_triton, _backward_triton),
    },
)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, loss_mask, ignore_index, vocab_size, kernels):
        logits_2d = logits.reshape(-1, logits.shape[-1])  # [n, V]
        loss, lse = kernels.forward(logits_2d, labels.reshape(-1), loss_mask, ignore_index, vocab_size)
        ctx.save_for_backward(logits_2d, labels.reshape(-1), loss_mask, lse)
        ctx.meta = (logits.shape, ignore_index, vocab_size, kernels)
        return loss.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits_2d, labels, loss_mask, lse = ctx.saved_tensors
        shape, ignore_index, vocab_size, kernels = ctx.meta
        grad = kernels.backward(grad_loss.reshape(-1), logits_2d, labels, loss_mask, lse, ignore_index, vocab_size)
        return grad.view(shape), None, None, None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                  loss_mask: torch.Tensor | None = None, vocab_size: int | None = None,
                  impl: str | None = None) -> torch.Tensor:
    """Per-token loss [...] (fp32) from logits [..., V] and labels [...].

    ignore_index tokens: loss 0, no gradient. loss_mask [...]: multiplies each token's loss.
    vocab_size: columns from here on are padding (default: none). impl forces an implementation.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ in leading dims")
    if loss_mask is not None and loss_mask.shape != labels.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} must have the labels' shape {tuple(labels.shape)}")
    padded = logits.shape[-1]
    vocab_size = padded if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size ({vocab_size}) must be in [1, logits.shape[-1] ({padded})]")
    if loss_mask is not None:
        loss_mask = loss_mask.reshape(-1).to(torch.float32)
    kernels = OP.kernels(logits.device, impl)
    return _CrossEntropy.apply(logits, labels.long(), loss_mask, int(ignore_index), vocab_size, kernels)
