"""What Megatron-LM's legacy classes read from the global args (they take no sizes of their own)."""

from __future__ import annotations

from argparse import Namespace
from typing import Any, Optional

from megatron.training import global_vars


def legacy_args(what: str) -> Namespace:
    """The global args; one line naming `what` needs them when initialize_megatron() has not run."""
    try:
        return global_vars.get_args()
    except RuntimeError:
        raise RuntimeError(f"{what} reads its sizes from Megatron's global args (as Megatron-LM's legacy classes "
                           "do): call megatron.training.initialize.initialize_megatron() first (Accelerate's "
                           "accelerator.prepare does)") from None


def global_tokenizer() -> Optional[Any]:
    """The global tokenizer, or None when none was built (Accelerate sets the args without one)."""
    try:
        return global_vars.get_tokenizer()
    except RuntimeError:
        return None


def model_vocab_sizes(args: Namespace, what: str) -> tuple[int, Optional[int]]:
    """(padded vocabulary, the tokenizer's ids) as pretrain_*.py pass them: vocab_size=args.padded_vocab_size,
    num_tokens the global tokenizer's size, else args.orig_vocab_size (Accelerate's), else None (all rows)."""
    padded = args.padded_vocab_size
    if padded is None:
        raise ValueError(f"{what}: the global args have no padded_vocab_size (set by the tokenizer, or by "
                         "Accelerate from orig_vocab_size)")
    tokenizer = global_tokenizer()
    num_tokens = tokenizer.vocab_size if tokenizer is not None else args.orig_vocab_size
    return int(padded), None if num_tokens is None else int(num_tokens)
