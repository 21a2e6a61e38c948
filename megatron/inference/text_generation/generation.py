"""Megatron-LM's text-generation loops (megatron.inference.text_generation.generation, the interface of
Megatron-LM core_v0.4-0.8 that Accelerate calls), over megatron.inference's generate_tokens and
beam_search:

    generate_tokens_probs_and_return_on_first_stage(model, tokens, lengths, return_output_log_probs=False,
        top_k=0, top_p=0.0, top_p_decay=0.0, top_p_bound=0.0, temperature=1.0,
        use_eod_token_for_early_termination=True, stop_on_double_eol=False, stop_on_eol=False,
        prevent_newline_after_colon=True) -> (tokens [b, <= s], lengths [b], output_log_probs [b, <= s - 1] or None)
    beam_search_and_return_on_first_stage(model, tokens, lengths, beam_size, stop_token, num_return_gen,
        length_penalty, prevent_newline_after_colon=True) -> (tokens [n, s], scores [n])

tokens [b, s] holds each prompt (lengths [b]) followed by anything (padding): Megatron's callers pad
every row to s = the longest prompt + tokens_to_generate, and the loop fills the columns from each
row's length up to s. model is the model of this pipeline stage, or a list holding it (one chunk: no
interleaving, as in Megatron); any TP x PP layout. Megatron returns on the first stage; here every
rank returns the results (on the model's device).

Megatron's rules kept: top_k == 1 is greedy; top_k == 0 and top_p == 0.0 samples from the whole
(tempered) distribution; termination is args.eos_id if set, else the tokenizer's eod; stop_on_eol /
stop_on_double_eol use the tokenizer's "\\n" and "\\n\\n" ids (Megatron hard-codes GPT-2's 198 and 628,
the same ids there); prevent_newline_after_colon masks "\\n" right after ":" (skipped when the
tokenizer has no single-token ":" and "\\n"); s must not exceed --max-position-embeddings (nor b * s
--max-tokens-to-oom when that flag exists). Draws use torch's default generator (callers seed it,
as Accelerate does with torch.random.manual_seed). Beam search is megatron.inference.beam_search's
(transformers' rules; see docs/generation.md for how they differ from Megatron's).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from megatron.inference import beam_search as beam
from megatron.inference.generation import _unwrapped, cached_next_logits, generate_tokens, model_device
from megatron.training import global_vars


def _one_chunk(model: torch.nn.Module | Sequence[torch.nn.Module]) -> torch.nn.Module:
    """The model of this stage from a module or a list of one chunk."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"text generation takes one model chunk per pipeline stage, got {len(model)} "
                             "(virtual pipeline parallelism / interleaving is not supported, as in Megatron-LM)")
        model = model[0]
    return model


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Generate without dropout, then give the model back in the mode it came in (training goes on)."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def _global_args() -> Any | None:
    try:
        return global_vars.get_args()
    except RuntimeError:
        return None


def global_tokenizer() -> Any:
    """The global tokenizer; when none was built (Accelerate >= 1.13 sets the args with
    build_tokenizer=False), the one the global args describe, built once."""
    if _global_args() is None:
        raise RuntimeError("text generation needs Megatron's global args and tokenizer: call "
                           "megatron.training.initialize.initialize_megatron() first")
    return global_vars.get_tokenizer_or_build()


def single_token(tokenizer: Any, text: str) -> int | None:
    """The id of text when the tokenizer makes it one token, else None (also when it cannot tokenize it)."""
    try:
        ids = tokenizer.tokenize(text)
    except (ValueError, KeyError, TypeError):  # e.g. NullTokenizer reads only integers
        return None
    return int(ids[0]) if len(ids) == 1 else None


def termination_id(args: Any | None, tokenizer: Any) -> int:
    """Megatron's: args.eos_id when set, else the tokenizer's eod (or eos_id)."""
    if args is not None and args.eos_id is not None:
        return int(args.eos_id)
    for name in ("eod", "eos_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise AttributeError("no termination token: set --eos-id or use a tokenizer with an eod")


def _check_length(args: Any | None, batch: int, length: int) -> None:
    if args is None:
        return
    limit = args.max_position_embeddings
    if limit is not None and length > limit:
        raise ValueError(f"Length of prompt + tokens_to_generate longer than allowed ({length} > "
                         f"--max-position-embeddings {limit})")
    oom = args.max_tokens_to_oom
    if oom is not None and batch * length > oom:
        raise ValueError(f"Too many tokens.  {batch * length} is greater than {oom}")


def _colon_and_newline(tokenizer: Any, wanted: bool) -> tuple[int | None, int | None]:
    """(":", "\\n") ids for prevent_newline_after_colon; (None, None) when not wanted or not single tokens."""
    if not wanted:
        return None, None
    colon, newline = single_token(tokenizer, ":"), single_token(tokenizer, "\n")
    return (colon, newline) if colon is not None and newline is not None else (None, None)


@torch.no_grad()
def generate_tokens_probs_and_return_on_first_stage(
        model, tokens: torch.Tensor, lengths: torch.Tensor, return_output_log_probs: bool = False,
        top_k: int = 0, top_p: float = 0.0, top_p_decay: float = 0.0, top_p_bound: float = 0.0,
        temperature: float = 1.0, use_eod_token_for_early_termination: bool = True,
        stop_on_double_eol: bool = False, stop_on_eol: bool = False, prevent_newline_after_colon: bool = True):
    """Extend each row of tokens [b, s] from its length to s (see the module docstring). Returns
    tokens [b, s'] (s' < s when every row hit the termination token early), generated_sequence_lengths
    [b] (prompt + generation, through the termination token; s' for rows without one) and
    output_log_probs [b, s' - 1] (log p(token t + 1), fp32) or None."""
    model = _one_chunk(model)
    args, tokenizer = _global_args(), global_tokenizer()
    batch, length = tokens.shape
    _check_length(args, batch, length)
    lengths = lengths.reshape(-1).to(torch.int64)
    longest = int(lengths.max())
    if longest > length:
        raise ValueError(f"a prompt length ({longest}) is longer than the tokens tensor ({length} columns)")
    device = model_device(model)
    colon, _ = _colon_and_newline(tokenizer, prevent_newline_after_colon)
    newline, double_newline = single_token(tokenizer, "\n"), single_token(tokenizer, "\n\n")
    with _eval_mode(model):
        out = generate_tokens(
            model, tokens.to(device), lengths.to(device), length - longest, top_k=top_k, top_p=top_p,
            top_p_decay=top_p_decay, top_p_bound=top_p_bound, temperature=temperature,
            stop_token=termination_id(args, tokenizer), prevent_newline_after_colon=colon is not None,
            colon_token=colon, newline_token=newline, stop_on_eol=stop_on_eol, stop_on_double_eol=stop_on_double_eol,
            double_newline_token=double_newline, return_output_log_probs=return_output_log_probs,
            stop_early=use_eod_token_for_early_termination)
    return out.tokens, out.lengths, out.output_log_probs


def _forbid_newline_after_colon(next_logits, colon: int, newline: int):
    def masked(tokens: torch.Tensor) -> torch.Tensor:
        logits = next_logits(tokens).clone()  # [beams, v]
        logits[tokens[:, -1] == colon, newline] = -1e10
        return logits

    return masked


@torch.no_grad()
def beam_search_and_return_on_first_stage(model, tokens: torch.Tensor, lengths: torch.Tensor, beam_size: int,
                                          stop_token: int | None, num_return_gen: int, length_penalty: float,
                                          prevent_newline_after_colon: bool = True):
    """Beam search over the one prompt tokens[0, :lengths[0]], generating up to column s = min(tokens
    width, --max-position-embeddings). Returns the min(num_return_gen, beam_size) best hypotheses as
    tokens [n, s] (the prompt, the generation through its stop token, then the input row's own
    padding) and their length-penalised scores [n] (fp32), best first."""
    model = _one_chunk(model)
    args, tokenizer = _global_args(), global_tokenizer()
    if tokens.shape[0] != 1:
        raise ValueError(f"beam search takes one prompt (batch size 1), got a batch of {tokens.shape[0]}")
    prompt_length = int(lengths.reshape(-1)[0])
    final_length = tokens.shape[1]
    if args is not None and args.max_position_embeddings is not None:
        final_length = min(final_length, args.max_position_embeddings)
    if prompt_length >= final_length:
        raise ValueError(f"context length + tokens_to_generate too large (the prompt has {prompt_length} "
                         f"tokens, the sequence may have {final_length})")
    device = model_device(model)
    next_logits = cached_next_logits(model, final_length)
    colon, newline = _colon_and_newline(tokenizer, prevent_newline_after_colon)
    if colon is not None:
        next_logits = _forbid_newline_after_colon(next_logits, colon, newline)
    with _eval_mode(model):
        result = beam.beam_search(next_logits, tokens[0, :prompt_length].tolist(), beam_size,
                                  final_length - prompt_length, stop_token=stop_token,
                                  length_penalty=length_penalty, vocab_size=_unwrapped(model).num_tokens)
    count = min(num_return_gen, len(result.tokens))
    rows = tokens[:1, :final_length].to(device).repeat(count, 1)  # [n, s]: the input row's padding after each
    for row, hypothesis in zip(rows, result.tokens[:count]):
        row[:len(hypothesis)] = torch.tensor(hypothesis, dtype=row.dtype, device=device)
    return rows, torch.tensor(result.scores[:count], dtype=torch.float32, device=device)
