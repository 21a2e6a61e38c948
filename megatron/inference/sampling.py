"""Choosing the next token from logits, as Megatron-LM's text generation does.

    sample(logits, top_k=0, top_p=0.0, temperature=1.0, vocab_size=None, generator=None) -> tokens [b]
    next_top_p(top_p, top_p_decay, top_p_bound) -> the top_p of the next step

Megatron's rules: top_k == 1 is greedy (argmax, no randomness). Otherwise the logits are divided by
the temperature, then filtered by top-k (keep the k largest) or by top-p (keep the smallest set of
the most likely tokens whose probability reaches top_p; the token that crosses top_p is kept), never
both, and a token is drawn from the softmax of what is left. top_k == 0 and top_p == 0.0 samples
from the whole (tempered) distribution. Ids at or above vocab_size (the padding rows of the output
layer) are never chosen: their logits are masked before anything else, where Megatron clamps the
drawn id instead. With top_p_decay, top_p shrinks after each generated token (top_p * decay, not
below top_p_bound).

Bad parameters raise ValueError naming the parameter (the server turns it into a 400).
"""

from __future__ import annotations

from typing import Optional

import torch


def check_sampling(top_k: int = 0, top_p: float = 0.0, temperature: float = 1.0,
                   vocab_size: Optional[int] = None) -> None:
    """ValueError naming the first parameter out of range (Megatron's combinations)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0, got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be a number in [0, 1], got {top_p!r}")
    if top_k > 0 and top_p > 0.0:
        raise ValueError(f"top_k ({top_k}) and top_p ({top_p}) cannot both be set")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0.0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if vocab_size is not None and top_k > vocab_size:
        raise ValueError(f"top_k ({top_k}) is larger than the vocabulary ({vocab_size})")


def greedy(logits: torch.Tensor, vocab_size: Optional[int] = None) -> torch.Tensor:
    """argmax over the first vocab_size ids: [b, v] -> [b] int64."""
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    return torch.argmax(logits, dim=-1)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """-inf everywhere but each row's top_k largest logits (ties at the k-th value kept), in place."""
    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
    return logits.masked_fill_(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """-inf outside each row's nucleus: the most likely tokens until their probability reaches top_p
    (the one that crosses it included), in place."""
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    drop = cumulative > top_p
    drop[:, 1:] = drop[:, :-1].clone()  # keep the token that crosses top_p
    drop[:, 0] = False  # and always the most likely one
    return logits.masked_fill_(drop.scatter(1, order, drop), float("-inf"))


def sample(logits: torch.Tensor, top_k: int = 0, top_p: float = 0.0, temperature: float = 1.0,
           vocab_size: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The next token of each row of logits [b, v] (see the module docstring): [b] int64."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocabulary], got shape {tuple(logits.shape)}")
    check_sampling(top_k, top_p, temperature, vocab_size if vocab_size is not None else logits.shape[-1])
    if top_k == 1:
        return greedy(logits, vocab_size)
    logits = logits.float().clone()
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits[:, vocab_size:] = float("-inf")
    if temperature != 1.0:
        logits.div_(temperature)
    if top_k > 1:
        top_k_filter(logits, top_k)
    elif top_p > 0.0:
        top_p_filter(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(-1)


def next_top_p(top_p: float, top_p_decay: float = 0.0, top_p_bound: float = 0.0) -> float:
    """Megatron's decay of top_p after each generated token: top_p * top_p_decay, at least top_p_bound."""
    if top_p > 0.0 and top_p_decay > 0.0:
        top_p = top_p * top_p_decay
        if top_p_bound > 0.0:
            top_p = max(top_p, top_p_bound)
    return top_p
