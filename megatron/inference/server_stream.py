"""Incremental server-sent events for POST /v1/completions with stream=true.

    backend.generate(request, on_step)  --each decoding step-->  on_step(step, new [b])
        row i (a choice) past its prompt: IncrementalText.add(new[i]) -> the text now final
        -> one `data: {...}` event per token that adds text
    after generation: the rest of each choice's final text (if any), its finish_reason, `data: [DONE]`

Text is sent only once it cannot change: a trailing U+FFFD (a multi-byte character whose bytes
are split over BPE tokens) and a tail that could start a stop string are held back, so the
concatenated chunks of a choice equal the text of the same request answered without stream.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, List, Optional, Sequence

import torch


class IncrementalText:
    """One choice's completion as its tokens arrive (detokenize(prompt + tokens) minus the prompt)."""

    def __init__(self, detokenize: Callable[[List[int]], str], prompt_ids: Sequence[int], prompt: str,
                 max_tokens: int, stops: Sequence[str], stop_ids: Collection[int]):
        self.detokenize, self.ids, self.prompt = detokenize, list(prompt_ids), prompt
        self.max_tokens, self.stops, self.stop_ids = max_tokens, tuple(stops), set(stop_ids)
        self.sent, self.count, self.done = "", 0, False

    def add(self, token: int) -> str:
        """The text that `token` makes final ("" while held back or once the choice has ended)."""
        if self.done:
            return ""
        if token in self.stop_ids:  # the termination token ends the choice and adds no text
            self.done = True
            return ""
        self.ids.append(token)
        self.count += 1
        self.done = self.count >= self.max_tokens
        text = self.detokenize(self.ids)
        if not text.startswith(self.prompt):  # the prompt's last piece merged with the new one: wait for the end
            return ""
        completion = text[len(self.prompt):]
        cut = min((completion.find(stop) for stop in self.stops if stop in completion), default=-1)
        if cut >= 0:
            completion, self.done = completion[:cut], True
        elif not self.done:
            completion = completion[:len(completion) - _held_back(completion, self.stops)]
        if not completion.startswith(self.sent):
            return ""
        new = completion[len(self.sent):]
        self.sent = completion
        return new


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of text may still change: partial UTF-8 (U+FFFD) or a stop's start."""
    held = len(text) - len(text.rstrip("\ufffd"))
    kept = text[:len(text) - held]
    for stop in stops:
        for size in range(min(len(stop) - 1, len(kept)), 0, -1):
            if kept.endswith(stop[:size]):
                held = max(held, len(text) - len(kept) + size)
                break
    return held


def step_hook(texts: List[IncrementalText], prompt_lengths: Sequence[int],
              send: Callable[[int, str], None]) -> Callable[[int, torch.Tensor], None]:
    """generate_tokens' on_step: row i's token at column `step` is generated once its prompt
    (prompt_lengths[i] tokens, BOS included) is behind it; each new piece of text goes to send(i, text)."""

    def on_step(step: int, new: torch.Tensor) -> None:
        for row, token in enumerate(new.tolist()):
            if prompt_lengths[row] <= step:
                piece = texts[row].add(int(token))
                if piece:
                    send(row, piece)

    return on_step


def event(index: int, text: str, finish_reason: Optional[str] = None, **fields: Any) -> dict:
    """One completion chunk (the caller adds id, object, created, model)."""
    return {"choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}], **fields}
