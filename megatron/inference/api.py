"""generate() and score(): text in, Megatron's REST response body out.

    generate(model, tokenizer, ["Hello"], tokens_to_generate=16, top_k=1, logprobs=True)
    -> {"text": ["Hello ..."], "segments": [["Hello", " ..."]], "logprobs": [[...]], "tokens": [[...]]}

text is prompt + generation (Megatron's prompts_plus_generations), cut after the stop token;
segments the text of each token; logprobs[i][j] the log-probability of token j + 1 (None unless
logprobs=True); tokens the ids. Prompts are tokenized with tokenizer.tokenize, prefixed with
tokenizer.eod when add_BOS (Megatron uses the end-of-document token as BOS), and padded with eod.
tokenizer is one of megatron.training.tokenizer's (tokenize, detokenize, eod).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from megatron.core import parallel_state
from megatron.inference import beam_search as beam
from megatron.inference.generation import (GenerationOutput, from_last_stage, stage_forward, cached_next_logits,
                                           generate_tokens)


def tokenize_prompts(tokenizer, prompts: Sequence[str], add_BOS: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [b, max_len] (padding eod) and lengths [b]."""
    if not prompts:
        raise ValueError("prompts must not be empty")
    ids = [([tokenizer.eod] if add_BOS else []) + list(tokenizer.tokenize(prompt)) for prompt in prompts]
    if any(len(row) == 0 for row in ids):
        raise ValueError("every prompt needs at least one token (an empty prompt needs add_BOS)")
    width = max(len(row) for row in ids)
    tokens = torch.full((len(ids), width), tokenizer.eod, dtype=torch.int64)
    for i, row in enumerate(ids):
        tokens[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
    return tokens, torch.tensor([len(row) for row in ids])


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer.tokenize(text)
    return ids[0] if len(ids) == 1 else None


def _response(tokenizer, tokens: torch.Tensor, lengths: torch.Tensor, log_probs: torch.Tensor | None,
              top_log_probs: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, Any]:
    rows = [row[:n] for row, n in zip(tokens.tolist(), lengths.tolist())]
    response = {
        "text": [tokenizer.detokenize(row) for row in rows],
        "segments": [[tokenizer.detokenize([token]) for token in row] for row in rows],
        "logprobs": None if log_probs is None else [lp[:len(row) - 1] for lp, row in zip(log_probs.tolist(), rows)],
        "tokens": rows,
    }
    if top_log_probs is not None:  # per position j: [[token j + 1 candidate id, log-prob], ...] or None
        values, ids = (t.tolist() for t in top_log_probs)
        response["top_logprobs"] = [
            [[[i, v] for i, v in zip(id_row, value_row) if i >= 0] or None
             for id_row, value_row in zip(ids[r][:len(row) - 1], values[r][:len(row) - 1])]
            for r, row in enumerate(rows)]
    return response


def generate(model: torch.nn.Module, tokenizer, prompts: Sequence[str], tokens_to_generate: int = 64, *,
             logprobs: bool = False, top_k: int = 0, top_p: float = 0.0, top_p_decay: float = 0.0,
             top_p_bound: float = 0.0, temperature: float = 1.0, add_BOS: bool = False,
             stop_on_double_eol: bool = False, stop_on_eol: bool = False, prevent_newline_after_colon: bool = False,
             random_seed: int | None = None, stop_token: int | None = None,
             use_cache: bool = True, on_step=None, top_logprobs: int = 0) -> dict[str, Any]:
    """Continue each prompt by tokens_to_generate tokens (Megatron's generate_and_post_process);
    tokens_to_generate == 0 scores the prompts instead (score). Generation ends for a row at
    stop_token, else the tokenizer's eod (or at a newline with stop_on_eol / stop_on_double_eol).
    on_step(step, new_tokens [b]) is called after each decoding step (streaming; see generate_tokens).
    top_logprobs = k adds "top_logprobs": per row and position j, the k most likely tokens j + 1 as
    [id, log-prob] pairs (None where the position decided no token: inside the prompt)."""
    if tokens_to_generate == 0:
        return score(model, tokenizer, prompts, add_BOS=add_BOS)
    model.eval()
    tokens, lengths = tokenize_prompts(tokenizer, prompts, add_BOS)
    newline = colon = double_newline = None
    if prevent_newline_after_colon or stop_on_eol or stop_on_double_eol:
        newline, double_newline = _single_token(tokenizer, "\n"), _single_token(tokenizer, "\n\n")
        if newline is None:
            raise ValueError("the tokenizer has no single newline token (prevent_newline_after_colon, stop_on_eol)")
    if prevent_newline_after_colon:
        colon = _single_token(tokenizer, ":")
    out: GenerationOutput = generate_tokens(
        model, tokens, lengths, tokens_to_generate, top_k=top_k, top_p=top_p, top_p_decay=top_p_decay,
        top_p_bound=top_p_bound, temperature=temperature, random_seed=random_seed, stop_token=stop_token,
        eod=tokenizer.eod, prevent_newline_after_colon=prevent_newline_after_colon and colon is not None,
        colon_token=colon, newline_token=newline, stop_on_eol=stop_on_eol, stop_on_double_eol=stop_on_double_eol,
        double_newline_token=double_newline, return_output_log_probs=logprobs,
        use_cache=use_cache, on_step=on_step, top_logprobs=top_logprobs)
    return _response(tokenizer, out.tokens, out.lengths, out.output_log_probs, out.top_log_probs)


@torch.no_grad()
def score(model: torch.nn.Module, tokenizer, prompts: Sequence[str], *, add_BOS: bool = False,
          return_logits: bool = False) -> dict[str, Any]:
    """One forward over the prompts: the response dict with logprobs[i][j] = log p(token j + 1 | tokens
    0 .. j), on every rank; with return_logits also "logits", each row's [length, vocab] fp32 tensor
    (true vocabulary; under pipeline parallelism on the last stage, None elsewhere)."""
    model.eval()
    tokens, lengths = tokenize_prompts(tokenizer, prompts, add_BOS)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = stage_forward(model, tokens, positions, None)  # [b, s, v] on the last pipeline stage, else None
    log_probs = torch.zeros(tokens.shape[0], tokens.shape[1] - 1)
    if logits is not None:
        log_probs = logits[:, :-1].log_softmax(-1).gather(2, tokens[:, 1:, None])[..., 0]  # [b, s - 1]
    response = _response(tokenizer, tokens, lengths, from_last_stage(log_probs))
    if return_logits:  # on the last pipeline stage only (None on the others)
        response["logits"] = None if logits is None else [row[:n] for row, n in zip(logits, lengths.tolist())]
    return response


def beam_search(model: torch.nn.Module, tokenizer, prompts: Sequence[str], tokens_to_generate: int, beam_width: int,
                *, stop_token: int | None = None, num_return_gen: int = 1, length_penalty: float = 1.0,
                add_BOS: bool = False, use_cache: bool = True) -> dict[str, Any]:
    """Megatron's beam_search_and_post_process for one prompt: {"text", "segments", "scores"} of the
    num_return_gen best hypotheses (prompt + generation, stop token included; scores length-penalised).
    stop_token defaults to the tokenizer's eod. Under tensor and pipeline parallelism every rank
    searches the same logits (gathered over TP, broadcast from the last stage: cached_next_logits);
    use_cache=False (the whole prefix rerun, beam_search.model_next_logits) is TP = PP = 1 only."""
    if len(prompts) != 1:
        raise ValueError(f"beam search takes one prompt, got {len(prompts)}")
    if not 1 <= num_return_gen <= beam_width:
        raise ValueError(f"num_return_gen ({num_return_gen}) must be in [1, beam_width ({beam_width})]")
    if not use_cache and (parallel_state.get_pipeline_model_parallel_world_size() > 1
                          or parallel_state.get_tensor_model_parallel_world_size() > 1):
        raise ValueError("beam search with use_cache=False needs TP = PP = 1")
    model.eval()
    tokens, _ = tokenize_prompts(tokenizer, prompts, add_BOS)
    prompt = tokens[0].tolist()
    if use_cache:
        next_logits = cached_next_logits(model, len(prompt) + tokens_to_generate)
    else:
        next_logits = beam.model_next_logits(model)
    result = beam.beam_search(next_logits, prompt, beam_width, tokens_to_generate,
                              stop_token=tokenizer.eod if stop_token is None else stop_token,
                              length_penalty=length_penalty, vocab_size=_num_tokens(model))
    rows = result.tokens[:num_return_gen]
    return {"text": [tokenizer.detokenize(row) for row in rows],
            "segments": [[tokenizer.detokenize([token]) for token in row] for row in rows],
            "scores": result.scores[:num_return_gen]}


def _num_tokens(model: torch.nn.Module) -> int:
    while not hasattr(model, "num_tokens") and hasattr(model, "module"):
        model = model.module
    return model.num_tokens
