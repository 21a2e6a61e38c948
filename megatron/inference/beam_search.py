"""Beam search for one prompt, scored as HuggingFace transformers' beam search scores it.

    beam_search(next_logits, prompt, beam_width, tokens_to_generate, stop_token=None,
                length_penalty=1.0, vocab_size=None) -> BeamSearchResult

`next_logits(tokens [beams, length]) -> logits [beams, vocabulary]` gives each running sequence's
logits for its next token (model_next_logits builds it from a GPTModel, recomputing the prefix).

Each step extends every running beam by every token: the candidate's score is the beam's score plus
the token's log-probability (log_softmax over the first vocab_size ids). The best 2 x beam_width
candidates are kept, best first. A candidate has finished when its token is stop_token or it reaches
the length limit; the beam_width best unfinished candidates run on. A finished candidate among the
first beam_width enters the hypotheses with score / generated_length ** length_penalty (the
generated length counts the stop token, not the prompt), and the beam_width best hypotheses are
kept. The search ends when no candidate can continue, or when the hypotheses are full and the best
running beam, at its current length, scores no better than the worst hypothesis (transformers'
default `early_stopping=False` rule, which also stops improving hypotheses once it holds). Beams
start as the prompt once with score 0 and beam_width - 1 copies at -1e9, so the first step draws all
its candidates from the one real beam. These are transformers' rules, so that `num_beams` search
with the same length_penalty gives the same sequences (tests/unit/test_beam_search.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

_NEG = -1.0e9  # a score that never wins


@dataclass
class BeamSearchResult:
    tokens: List[List[int]]  # the hypotheses, best first: prompt + generated tokens (stop token included)
    scores: List[float]  # their length-penalised scores


def model_next_logits(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """next_logits of a GPTModel (TP = 1, PP = 1): the whole prefix recomputed at each step."""

    @torch.no_grad()
    def next_logits(tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        return model(tokens, positions)[:, -1, :].float()

    return next_logits


@torch.no_grad()
def beam_search(next_logits: Callable[[torch.Tensor], torch.Tensor], prompt: List[int], beam_width: int,
                tokens_to_generate: int, stop_token: Optional[int] = None, length_penalty: float = 1.0,
                vocab_size: Optional[int] = None) -> BeamSearchResult:
    """The beam_width best continuations of prompt (see the module docstring)."""
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width < 1:
        raise ValueError(f"beam_width must be an integer >= 1, got {beam_width!r}")
    if isinstance(tokens_to_generate, bool) or not isinstance(tokens_to_generate, int) or tokens_to_generate < 1:
        raise ValueError(f"tokens_to_generate must be an integer >= 1, got {tokens_to_generate!r}")
    if not prompt:
        raise ValueError("the prompt is empty")
    prompt_length, max_length = len(prompt), len(prompt) + tokens_to_generate
    keep = 2 * beam_width
    running = torch.tensor([prompt] * beam_width, dtype=torch.long)  # [beams, length]
    running_scores = torch.full((beam_width,), _NEG)
    running_scores[0] = 0.0
    hypotheses: List[List[int]] = [[] for _ in range(beam_width)]
    hypothesis_scores = torch.full((beam_width,), _NEG)
    filled = torch.zeros(beam_width, dtype=torch.bool)
    can_improve = True
    length = prompt_length
    while True:
        logits = next_logits(running)
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        log_probs = torch.log_softmax(logits.float(), dim=-1) + running_scores[:, None]
        vocab = log_probs.shape[-1]
        values, flat = torch.topk(log_probs.reshape(-1), k=min(keep, log_probs.numel()))
        beams, tokens = flat // vocab, flat % vocab
        candidates = torch.cat([running[beams], tokens[:, None]], dim=1)
        finished = torch.full_like(tokens, length + 1 >= max_length, dtype=torch.bool)
        if stop_token is not None:
            finished |= tokens == stop_token
        # the hypotheses: finished candidates among the first beam_width, length-penalised
        eligible = finished.clone()
        eligible[beam_width:] = False
        penalised = values / float(length + 1 - prompt_length) ** length_penalty
        penalised = torch.where(eligible & torch.tensor(can_improve), penalised, torch.full_like(penalised, _NEG))
        merged_scores = torch.cat([hypothesis_scores, penalised])
        merged = hypotheses + [row.tolist() for row in candidates]
        merged_filled = torch.cat([filled, eligible])
        best = torch.topk(merged_scores, k=beam_width).indices
        hypotheses = [merged[i] for i in best.tolist()]
        hypothesis_scores, filled = merged_scores[best], merged_filled[best]
        # the running beams: the best unfinished candidates
        open_scores = values + finished.float() * _NEG
        chosen = torch.topk(open_scores, k=beam_width).indices
        running, running_scores = candidates[chosen], open_scores[chosen]
        length += 1
        best_possible = running_scores[0] / float(length - prompt_length) ** length_penalty
        worst_kept = torch.where(filled, hypothesis_scores.min(), torch.tensor(_NEG))
        can_improve = can_improve and bool((best_possible > worst_kept).any())
        if not can_improve or bool(finished.all()):
            break
    order = [i for i in range(beam_width) if bool(filled[i])]
    return BeamSearchResult([hypotheses[i] for i in order], [float(hypothesis_scores[i]) for i in order])
