"""megatron_generate: Accelerate's MegatronEngine.megatron_generate (accelerate <= 1.12; 1.13+ dropped
it, its Megatron-LM guide still shows it) over this project's text generation.

    megatron_generate(model, inputs [b, n], attention_mask=None [b, n], max_length=None, max_new_tokens=None,
                      num_beams=None, temperature=None, top_k=None, top_p=None, length_penalty=None,
                      top_p_decay=0.0, top_p_bound=0.0, add_BOS=False, stop_token=eod, random_seed=0)
        -> tokens [b, L] (int64, on every rank)

Accelerate's behaviour: the same argument checks and messages; the row is the prompt (prefixed
with the tokenizer's eod when add_BOS), padded with eod so that its width L = prompt + max_new_tokens
(+ 1) is rounded up to a multiple of 4 (the extra columns are generated too); rank 0's inputs are
broadcast to every rank; torch's generator is seeded with random_seed; num_beams runs beam search
on a batch of one prompt (stop_token, length_penalty; the best hypothesis comes back), otherwise
generate_tokens_probs_and_return_on_first_stage samples (top_k == 1 greedy; top_k == 0 and top_p == 0
the whole distribution at the temperature, as in Megatron-LM) and ends early once every row has
produced the termination token. Each row's prompt length is attention_mask's row sum (right
padding, as transformers' GPT-2 tokenizer pads), else n.

Where it differs from Accelerate 1.12: tensors go to the project's device (no .cuda()); add_BOS counts
the BOS in the prompt lengths (Accelerate did not, and so overwrote each prompt's last token);
a beam search over a batch > 1 raises (Accelerate returned the message as a string); every rank
checks the arguments (Accelerate checked max_new_tokens on rank 0 only, leaving the others waiting).

model: Accelerate's MegatronEngine (its .module, a list of one chunk), a list of one chunk, or the
stage's module; wrappers (DDP, Float16Module) are stripped as Accelerate did. Args and tokenizer come
from Megatron's globals (megatron.training.get_args / get_tokenizer), the tokenizer built from the args
when none was (Accelerate >= 1.13 initializes without one).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.utils import unwrap_model
from megatron.inference.text_generation.communication import broadcast_int_list, broadcast_tensor
from megatron.inference.text_generation.generation import (_one_chunk, beam_search_and_return_on_first_stage,
                                                           generate_tokens_probs_and_return_on_first_stage,
                                                           global_tokenizer)
from megatron.training import global_vars


def _generation_model(model: Any) -> torch.nn.Module:
    """The stage's unwrapped model from a MegatronEngine, a list of one chunk or a module."""
    if isinstance(getattr(model, "module", None), (list, tuple)):  # accelerate's MegatronEngine
        model = model.module
    return unwrap_model(_one_chunk(model))


def _check_parallel_setup(args: Any) -> None:
    if args.model_type_name not in (None, "gpt"):
        raise NotImplementedError("Generate method is not implemented for this model")
    if args.data_parallel_size > 1:
        raise ValueError("Generate method requires data parallelism to be 1")
    if args.sequence_parallel:
        raise ValueError("Generate method requires sequence parallelism to be False")
    if args.recompute_granularity is not None:
        raise ValueError("Checkpoint activations cannot be set for inference")
    if args.vocab_file is None:
        raise ValueError("Vocab file is required for inference")


def _sampling(temperature, top_k, top_p, kwargs: dict) -> tuple[float, int, float, float, float]:
    """Accelerate's checks and defaults: (temperature, top_k, top_p, top_p_decay, top_p_bound)."""
    if temperature is None:
        temperature = 1.0
    elif not (0.0 < temperature <= 100.0):
        raise ValueError("temperature must be a positive number less than or equal to 100.0")
    if top_k is None:
        top_k = 0
    elif not (0 <= top_k <= 1000):
        raise ValueError("top_k must be a positive number less than or equal to 1000")
    if top_p is None:
        top_p = 0.0
    elif top_p > 0.0 and top_k > 0.0:
        raise ValueError("top_p and top_k sampling cannot be set together")
    elif not (0.0 <= top_p <= 1.0):
        raise ValueError("top_p must be less than or equal to 1.0")
    top_p_decay = kwargs.get("top_p_decay", 0.0)
    if not (0.0 <= top_p_decay <= 1.0):
        raise ValueError("top_p_decay must be less than or equal to 1.0")
    top_p_bound = kwargs.get("top_p_bound", 0.0)
    if not (0.0 <= top_p_bound <= 1.0):
        raise ValueError("top_p_bound must be less than or equal to 1.0")
    return temperature, top_k, top_p, top_p_decay, top_p_bound


def _padded_prompts(inputs: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int,
                    add_BOS: bool, eod: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Accelerate's rows: [eod if add_BOS] + inputs + eod padding, the width a multiple of 4; and the lengths."""
    batch, width = inputs.shape
    bos = 1 if add_BOS else 0
    total = 4 * math.ceil((width + bos + max_new_tokens) / 4)  # a multiple of 4 (for fused kernels, Accelerate says)
    tokens = torch.full((batch, total), eod, dtype=torch.int64, device=device.get_device())  # [b, L]
    tokens[:, bos:bos + width] = inputs.to(tokens.device)
    if attention_mask is None:
        lengths = torch.full((batch,), width, dtype=torch.int64, device=tokens.device)
    else:
        lengths = attention_mask.sum(dim=-1).to(device=tokens.device, dtype=torch.int64)
    return tokens, lengths + bos


def megatron_generate(model: Any, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      max_length: int | None = None, max_new_tokens: int | None = None, num_beams: int | None = None,
                      temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                      length_penalty: float | None = None, **kwargs: Any) -> torch.Tensor:
    """Generate for a batch of prompt ids (beam search: one prompt), as Accelerate's MegatronEngine did
    (see the module docstring). kwargs: top_p_decay, top_p_bound, add_BOS, stop_token (beam search's;
    default the tokenizer's eod), random_seed (default 0)."""
    args = global_vars.get_args()
    _check_parallel_setup(args)
    if max_length is None and max_new_tokens is None:
        raise ValueError("`max_length` or `max_new_tokens` are required for inference")
    temperature, top_k, top_p, top_p_decay, top_p_bound = _sampling(temperature, top_k, top_p, kwargs)
    add_BOS = kwargs.get("add_BOS", False)
    if not isinstance(add_BOS, bool):
        raise ValueError("add_BOS must be a boolean")
    beam_width = num_beams
    if beam_width is not None:
        if not isinstance(beam_width, int):
            raise ValueError("beam_width must be an integer")
        if beam_width < 1:
            raise ValueError("beam_width must be greater than 0")
        if inputs.shape[0] > 1:
            raise ValueError("When doing beam_search, batch size must be 1")
    tokenizer = global_tokenizer()
    stop_token = kwargs.get("stop_token", tokenizer.eod)
    if stop_token is not None and not isinstance(stop_token, int):
        raise ValueError("stop_token must be an integer")
    if length_penalty is None:
        length_penalty = 1.0
    if max_new_tokens is None:
        max_new_tokens = max_length - inputs.shape[1]
    if max_new_tokens <= 0:
        raise ValueError("max_new_tokens must be greater than 0")

    sizes_list = prompts = lengths = None
    if dist.get_rank() == 0:  # rank 0's prompts go to every rank
        prompts, lengths = _padded_prompts(inputs, attention_mask, max_new_tokens, add_BOS, tokenizer.eod)
        sizes_list = list(prompts.shape)  # [batch size, sequence length]
    sizes = broadcast_int_list(2, int_list=sizes_list, rank=0).tolist()
    prompts = broadcast_tensor(sizes, torch.int64, tensor=prompts, rank=0)
    lengths = broadcast_tensor(sizes[0], torch.int64, tensor=lengths, rank=0)

    torch.random.manual_seed(kwargs.get("random_seed", 0))
    chunk = _generation_model(model)
    if beam_width is not None:
        tokens, _ = beam_search_and_return_on_first_stage(chunk, prompts, lengths, beam_width, stop_token=stop_token,
                                                          num_return_gen=1, length_penalty=length_penalty)
    else:
        tokens, _, _ = generate_tokens_probs_and_return_on_first_stage(
            chunk, prompts, lengths, return_output_log_probs=False, top_k=top_k, top_p=top_p,
            top_p_decay=top_p_decay, top_p_bound=top_p_bound, temperature=temperature,
            use_eod_token_for_early_termination=True)
    return tokens
