"""generate_tokens: batched autoregressive decoding with a key/value cache, Megatron-LM's loop.

Prompts of different lengths come right-padded in one [b, max_prompt] tensor; every row is
extended to max_prompt + tokens_to_generate positions. As in Megatron, decoding starts at the
shortest prompt's length: the first forward (the prefill) runs positions [0, min_len), then one
position per step; at each step a row whose prompt is longer keeps its prompt token and only the
rows past their prompt take the sampled one. Since the mask is causal and padding sits only to
the right of a row's prompt, no position ever attends to a padding token.

output_log_probs[:, t] is log_softmax(logits at position t)[token t + 1] (Megatron's
output_log_probs, over the true vocabulary: the output layer's padding rows are dropped).
Under tensor parallelism every rank runs the loop on the same tokens: the vocab-parallel logits
are gathered and the chosen tokens broadcast from the group's first rank. Under pipeline
parallelism each stage keeps the K/V of its own layers; a step's activations go stage to stage
(p2p_communication), the last stage chooses the tokens and broadcasts them (and, at the end, the
log-probs) over the pipeline group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron.core import device as device_helper
from megatron.core import communication, parallel_state
from megatron.core.pipeline_parallel import p2p_communication
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.inference.context import InferenceContext
from megatron.inference.sampling import next_top_p, sample


@dataclass
class GenerationOutput:
    """tokens [b, L] (prompt + generated, L <= max_prompt + tokens_to_generate); lengths [b]: a row's
    tokens end there (after its stop token, or at L); output_log_probs [b, L - 1] or None;
    top_log_probs (values, ids), each [b, L - 1, k], or None: at column t the k most likely next
    tokens after position t and their log-probs, for the columns whose logits decided a token (the
    decoding steps; the prompt's other columns hold -inf and id -1)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    output_log_probs: torch.Tensor | None = None
    top_log_probs: tuple[torch.Tensor, torch.Tensor] | None = None


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(model, "num_tokens") and hasattr(model, "module"):  # DDP / Float16Module wrappers
        model = model.module
    return model


def vocab_logits(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The model's logits [b, s, vocab/t or vocab] -> fp32 [b, s, num_tokens] (whole, true vocabulary)."""
    gpt = _unwrapped(model)
    if logits.shape[-1] != gpt.vocab_size:
        logits = gather_from_tensor_model_parallel_region(logits)  # [b, s, vocab/t] -> [b, s, vocab]
    return logits[..., :gpt.num_tokens].float()


def stage_forward(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                   context: InferenceContext | None) -> torch.Tensor | None:
    """This pipeline stage's forward of tokens [b, s]: it receives the previous stage's activations
    [s, b, h] and sends its own on; the last stage returns the logits [b, s, v] (fp32, true
    vocabulary), the others None. Each stage's layers keep their K/V in the same context."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return vocab_logits(model, model(tokens, positions, None, inference_context=context))
    config = _unwrapped(model).config
    shape = (tokens.shape[1], tokens.shape[0], config.hidden_size)  # [s, b, h]
    if not parallel_state.is_pipeline_first_stage():
        model.set_input_tensor(p2p_communication.recv_forward(shape, config.params_dtype))
    output = model(tokens, positions, None, inference_context=context)  # mask None: causal (legacy models need it)
    if not parallel_state.is_pipeline_last_stage():
        p2p_communication.send_forward(output, shape, config.params_dtype)  # [s, b, h]
        return None
    return vocab_logits(model, output)


def from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's tensor on every stage (a broadcast over the pipeline group)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        communication.broadcast(tensor, parallel_state.get_pipeline_model_parallel_last_rank(),
                                group=parallel_state.get_pipeline_model_parallel_group())
    return tensor


def _choose(logits: torch.Tensor, top_k: int, top_p: float, temperature: float,
            generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row of logits [b, v]; the same on every tensor-parallel rank."""
    tokens = sample(logits, top_k=top_k, top_p=top_p, temperature=temperature, generator=generator)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:  # unseeded draws may differ by rank
        communication.broadcast(tokens, parallel_state.get_tensor_model_parallel_src_rank(),
                                group=parallel_state.get_tensor_model_parallel_group())
    return tokens


@torch.no_grad()
def generate_tokens(model: torch.nn.Module, tokens: torch.Tensor, lengths: torch.Tensor, tokens_to_generate: int,
                    *, top_k: int = 0, top_p: float = 0.0, top_p_decay: float = 0.0, top_p_bound: float = 0.0,
                    temperature: float = 1.0, random_seed: int | None = None, stop_token: int | None = None,
                    eod: int | None = None, prevent_newline_after_colon: bool = False,
                    colon_token: int | None = None, newline_token: int | None = None,
                    stop_on_eol: bool = False, stop_on_double_eol: bool = False,
                    double_newline_token: int | None = None,
                    return_output_log_probs: bool = False, use_cache: bool = True,
                    on_step: Callable[[int, torch.Tensor], None] | None = None,
                    top_logprobs: int = 0, stop_early: bool = True) -> GenerationOutput:
    """Extend each row's prompt (tokens [b, >= max(lengths)] int64, right-padded; lengths [b]) to
    max(lengths) + tokens_to_generate tokens; stop early once every row has produced its
    termination token (stop_token, else eod; None: never). prevent_newline_after_colon forbids
    newline_token right after colon_token. Megatron's stop_on_eol ends a row at a newline_token (or
    double_newline_token), stop_on_double_eol at a double_newline_token or a second newline_token in a
    row; either replaces the termination token. use_cache=False reruns the whole prefix each step.
    top_k == 1 is greedy; random_seed seeds the draws (the same on every rank). top_logprobs = k keeps
    each step's k most likely tokens (top_log_probs). on_step(step, new [b])
    is called after each step's tokens are written to column `step` (rows still in their prompt keep theirs).
    stop_early=False runs all tokens_to_generate steps but still ends each row's length at its first
    termination (Megatron's use_eod_token_for_early_termination=False). Every tensor is made on
    tokens' device (the model's)."""
    if tokens_to_generate < 0:
        raise ValueError(f"tokens_to_generate must be >= 0, got {tokens_to_generate}")
    if prevent_newline_after_colon and (colon_token is None or newline_token is None):
        raise ValueError("prevent_newline_after_colon needs colon_token and newline_token")
    if (stop_on_eol or stop_on_double_eol) and newline_token is None:
        raise ValueError("stop_on_eol and stop_on_double_eol need newline_token")
    b, device = tokens.shape[0], tokens.device
    lengths = lengths.to(device=device, dtype=torch.int64)
    min_len, total = int(lengths.min()), int(lengths.max()) + tokens_to_generate
    if min_len < 1:
        raise ValueError("every prompt needs at least one token")
    gpt = _unwrapped(model)
    if getattr(gpt, "position_embedding_type", None) == "learned_absolute" and total > gpt.max_sequence_length:
        raise ValueError(f"the longest prompt + tokens_to_generate is {total} tokens, more than the model's "
                         f"{gpt.max_sequence_length} learned positions (--max-position-embeddings)")
    padded = torch.zeros(b, total, dtype=torch.int64, device=device)  # [b, L]
    width = min(tokens.shape[1], total)
    padded[:, :width] = tokens[:, :width]
    tokens = padded
    positions = torch.arange(total, device=device).expand(b, total)  # [b, L]
    termination = stop_token if stop_token is not None else eod
    generator = torch.Generator(device=device).manual_seed(random_seed) if random_seed is not None else None
    # Without log-probs only each forward's last position is sampled: the model computes no other logits.
    context = InferenceContext(b, total, materialize_only_last_token_logits=not return_output_log_probs) \
        if use_cache else None
    output_log_probs = torch.zeros(b, total - 1, device=device) if return_output_log_probs else None
    if top_logprobs < 0:
        raise ValueError(f"top_logprobs must be >= 0, got {top_logprobs}")
    top_values = torch.full((b, total - 1, top_logprobs), float("-inf"), device=device) if top_logprobs else None
    top_ids = torch.full((b, total - 1, top_logprobs), -1, dtype=torch.int64, device=device) if top_logprobs else None
    out_lengths = torch.full((b,), total, dtype=torch.int64, device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    prev, end = 0, total  # positions [0, prev) have had their logits used; tokens [0, end) are returned
    for step in range(min_len, total):
        start = prev if use_cache else 0
        logits = stage_forward(model, tokens[:, start:step], positions[:, start:step], context)  # [b, s, v] or None
        new = torch.zeros(b, dtype=torch.int64, device=device)
        if logits is not None:  # the last pipeline stage chooses
            last = logits[:, -1, :].clone()  # [b, v]
            if prevent_newline_after_colon:
                last[tokens[:, step - 1] == colon_token, newline_token] = -1e10
            new = _choose(last, top_k, top_p, temperature, generator)  # [b]
            if top_values is not None:  # the model's distribution at the step (before temperature and filters)
                top = torch.log_softmax(logits[:, -1, :], dim=-1).topk(min(top_logprobs, logits.shape[-1]), dim=-1)
                top_values[:, step - 1, :top.values.shape[1]] = top.values
                top_ids[:, step - 1, :top.indices.shape[1]] = top.indices
        new = from_last_stage(new)
        started = lengths <= step  # rows past their prompt take the new token
        tokens[started, step] = new[started]
        if on_step is not None:  # streaming: the step's tokens [b], the same on every rank
            on_step(step, new)
        if output_log_probs is not None and logits is not None:
            log_probs = torch.log_softmax(logits[:, prev - start:], dim=-1)  # [b, step - prev, v]
            targets = tokens[:, prev + 1:step + 1]  # [b, step - prev]
            output_log_probs[:, prev:step] = log_probs.gather(2, targets.unsqueeze(2)).squeeze(2)
        if context is not None:
            context.increment(step - prev)
        prev = step
        top_p = next_top_p(top_p, top_p_decay, top_p_bound)
        if termination is not None or stop_on_eol or stop_on_double_eol:
            done = started & _hits_stop(new, tokens[:, step - 1], termination, stop_on_eol, stop_on_double_eol,
                                        newline_token, double_newline_token)
            out_lengths[done & ~finished] = step + 1
            finished |= done
            if stop_early and bool(finished.all()):
                end = step + 1
                break
    tokens = tokens[:, :end]
    if output_log_probs is not None:
        output_log_probs = from_last_stage(output_log_probs)[:, :end - 1]
    top_log_probs = None
    if top_values is not None:
        top_log_probs = (from_last_stage(top_values)[:, :end - 1], from_last_stage(top_ids)[:, :end - 1])
    return GenerationOutput(tokens, out_lengths.clamp(max=end), output_log_probs, top_log_probs)


def _hits_stop(new: torch.Tensor, previous: torch.Tensor, termination: int | None, stop_on_eol: bool,
               stop_on_double_eol: bool, newline: int | None, double_newline: int | None) -> torch.Tensor:
    """Rows whose new token [b] ends their generation (Megatron's rules; previous [b]: the token before)."""
    double = new == double_newline if double_newline is not None else torch.zeros_like(new, dtype=torch.bool)
    if stop_on_double_eol:
        return double | ((new == newline) & (previous == newline))
    if stop_on_eol:
        return double | (new == newline)
    return new == termination


def cached_next_logits(model: torch.nn.Module, max_sequence_length: int):
    """beam_search's next_logits (megatron/inference/beam_search.py) with a key/value cache:
    next_logits(tokens [beams, n]) -> logits [beams, num_tokens] of position n - 1.

    When every row extends a row of the previous call by one token (a beam continuing its parent),
    the cache is reordered to the parents (swap_key_value_dict) and only the new tokens run;
    otherwise (the first call, another length) the whole prefix is prefilled. max_sequence_length:
    the longest sequence it will see (prompt + tokens_to_generate). Any TP x PP layout: the logits
    are gathered over TP and broadcast from the last pipeline stage, so every rank chooses the same beams.
    The model runs on its own device (model_device); the logits come back on the device of tokens.
    """
    state: dict = {"context": None, "tokens": None}
    device = model_device(model)

    @torch.no_grad()
    def next_logits(tokens: torch.Tensor) -> torch.Tensor:
        caller_device, tokens = tokens.device, tokens.to(device)
        beams, n = tokens.shape
        context, previous = state["context"], state["tokens"]
        parents = _parent_rows(previous, tokens) if context is not None else None
        if parents is None or beams > context.max_batch_size:
            context = InferenceContext(beams, max_sequence_length, materialize_only_last_token_logits=True)
            start = 0
        else:
            context.swap_key_value_dict(parents)
            start = n - 1
        positions = torch.arange(start, n, device=device).expand(beams, n - start)
        logits = stage_forward(model, tokens[:, start:], positions, context)  # [beams, n - start, v] or None
        context.increment(n - start)
        state["context"], state["tokens"] = context, tokens.clone()
        if logits is None:  # not the last pipeline stage: it receives the last stage's logits
            logits = torch.zeros(beams, 1, _unwrapped(model).num_tokens, device=device)
        return from_last_stage(logits[:, -1, :].contiguous()).to(caller_device)  # [beams, v], the same on every stage

    return next_logits


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's parameters (the project's device when it has none)."""
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else device_helper.get_device()


def _parent_rows(previous: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor | None:
    """For each row of tokens [B, n], the index of a row of previous [B0, n - 1] that is its prefix; None
    unless every row has one."""
    if previous is None or previous.shape[1] != tokens.shape[1] - 1:
        return None
    match = (tokens[:, None, :-1] == previous[None]).all(dim=-1)  # [B, B0]
    if not bool(match.any(dim=1).all()):
        return None
    return match.to(torch.int8).argmax(dim=1)  # [B]
