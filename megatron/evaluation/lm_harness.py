"""HarnessLM: lm-evaluation-harness 0.4's three request types answered by our GPTModel.

| request | arguments | answer | lm-eval 0.4's rule we follow |
|---|---|---|---|
| loglikelihood | (context, continuation) | (sum of the continuation tokens' log-probs, is_greedy) | TemplateLM.loglikelihood, HFLM._loglikelihood_tokens |
| loglikelihood_rolling | (text,) | sum of log-probs of every token of text | HFLM.loglikelihood_rolling: get_rolling_token_windows(context_len=1) + make_disjoint_window |
| generate_until | (context, {"until", "max_gen_toks", ...}) | the greedy continuation, cut before the first until string | HFLM.generate_until |

The token boundary (TemplateLM._encode_pair): trailing whitespace of the context moves to the
continuation; then the whole text context + continuation is encoded and the continuation is
whatever follows the first len(encode(context)) tokens of the whole (so a BPE merge across the
boundary moves the merged token to the continuation; the model reads context_enc + continuation_enc).
An empty context is scored after the prefix token (the tokenizer's eod, which HF's GPT-2 calls bos
and eos). Checked against lm-eval 0.4.9 and 0.4.13's source (HFLM, TemplateLM, lm_eval.utils).

Batching (HFLM): requests are sorted by descending length of context + continuation tokens (ties
by the tokens), cut into batches of batch_size, right-padded, scored in one forward each, and the
answers put back in request order. The model sees (context + continuation)[-(max_length + 1):][:-1]:
too long an input is truncated from the left. generate_until groups requests by their keyword
arguments, sorts each group by descending context length, truncates each context from the left to
max_length - max_gen_toks tokens and decodes greedily (megatron.inference.generation.generate_tokens,
right-padded, which under the causal mask equals HF's left-padded batch); each row keeps at most
max_gen_toks new tokens, ends at eod, and is cut before the first until string (eod's text added).

Under tensor parallelism every rank gets the whole logits (vocab_logits gathers them); under
pipeline parallelism the last stage scores and the answers are broadcast over the pipeline group,
so every rank returns the same answers. Not done: HFLM's one-token-continuation logits cache
(an optimisation: the answers are the same), sampling (greedy only), batch_size="auto".
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron.inference.generation import from_last_stage, generate_tokens, stage_forward

Tokens = List[int]


class HarnessRequestError(ValueError):
    """A request the harness rules cannot answer (one line, naming what is wrong)."""


def rolling_token_windows(token_list: Tokens, prefix_token: int, max_seq_len: int,
                          context_len: int = 1) -> List[Tuple[Tokens, Tokens]]:
    """lm-eval's get_rolling_token_windows: (input, predicted) pairs covering every token once;
    the first window predicts its tokens after prefix_token, each later one predicts up to
    max_seq_len - context_len + 1 tokens after the max_seq_len tokens before its last one."""
    if not 1 <= context_len <= max_seq_len:
        raise ValueError(f"context_len must be in [1, max_seq_len], got {context_len} and {max_seq_len}")
    if not token_list:
        return []
    pred_len = max_seq_len - context_len + 1
    first = min(max_seq_len, len(token_list))
    windows = [([prefix_token] + token_list[:first - 1], token_list[:first])]
    predicted = first
    while predicted < len(token_list):
        window_pred_len = min(len(token_list) - predicted, pred_len)
        end = predicted + window_pred_len
        windows.append((token_list[max(end - max_seq_len - 1, 0):end - 1], token_list[end - window_pred_len:end]))
        predicted += window_pred_len
    return windows


def make_disjoint_window(pair: Tuple[Tokens, Tokens]) -> Tuple[Tokens, Tokens]:
    """lm-eval's make_disjoint_window: the context without the tokens the window predicts."""
    context, predicted = pair
    return context[:len(context) - (len(predicted) - 1)], predicted


def stop_sequences(until: Any, eos_text: str) -> List[str]:
    """lm-eval's handle_stop_sequences: until as a list (a string is one), eos's text added."""
    if until is None:
        until = []
    elif isinstance(until, str):
        until = [until]
    elif not isinstance(until, list) or not all(isinstance(u, str) for u in until):
        raise HarnessRequestError(f"until must be a string or a list of strings, got {until!r}")
    return list(until) + ([eos_text] if eos_text and eos_text not in until else [])


def sorted_batches(items: Sequence[Any], key: Callable[[Any], Any], batch_size: int) -> List[List[int]]:
    """Indices of items sorted by key, cut into batches of batch_size (lm-eval's Collator)."""
    order = sorted(range(len(items)), key=lambda i: key(items[i]))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


class HarnessLM:
    """model: this rank's GPTModel chunk (eval mode); tokenizer: one of megatron.training.tokenizer's.
    max_length: the longest input (HFLM's max_length: the model's position table)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_length: int, batch_size: int = 8,
                 max_gen_toks: int = 256):
        if max_length < 2 or batch_size < 1 or max_gen_toks < 1:
            raise ValueError(f"need max_length >= 2, batch_size >= 1, max_gen_toks >= 1; got "
                             f"{max_length}, {batch_size}, {max_gen_toks}")
        self.model, self.tokenizer = model, tokenizer
        self.max_length, self.batch_size, self.max_gen_toks = max_length, batch_size, max_gen_toks
        self.device = next(model.parameters()).device

    # Tokens.

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.eod  # Megatron's BOS is its end-of-document token (HF GPT-2: bos == eos)

    def tok_encode(self, text: str) -> Tokens:
        return list(self.tokenizer.tokenize(text))

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.detokenize(list(ids))

    def encode_pair(self, context: str, continuation: str) -> Tuple[Tokens, Tokens]:
        """TemplateLM._encode_pair; an empty context is the prefix token, unless the continuation's
        tokens start with it (then that first token is the context: lm-eval 0.4.13's rule)."""
        if context == "":
            continuation_enc = self.tok_encode(continuation)
            if continuation_enc and continuation_enc[0] == self.prefix_token_id:
                return continuation_enc[:1], continuation_enc[1:]
            return [self.prefix_token_id], continuation_enc
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces > 0:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        context_enc = self.tok_encode(context)
        return context_enc, whole[len(context_enc):]

    # The three request types.

    def loglikelihood(self, requests: Sequence[Tuple[str, str]]) -> List[Tuple[float, bool]]:
        return self.loglikelihood_tokens([self.encode_pair(context, continuation)
                                          for context, continuation in requests])

    def loglikelihood_rolling(self, requests: Sequence[str]) -> List[float]:
        windows, owners = [], []
        for index, text in enumerate(requests):
            for window in rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, self.loglikelihood_tokens(windows)):
            totals[owner] += log_prob
        return totals

    def generate_until(self, requests: Sequence[Tuple[str, Dict[str, Any]]]) -> List[str]:
        answers: List[Optional[str]] = [None] * len(requests)
        groups: Dict[str, List[int]] = {}
        for index, (_, kwargs) in enumerate(requests):
            groups.setdefault(json.dumps(kwargs, sort_keys=True, default=str), []).append(index)
        for indices in groups.values():  # (HFLM: a batch never mixes generation arguments)
            until, max_gen_toks = self._generation_kwargs(requests[indices[0]][1])
            contexts = [requests[i][0] for i in indices]
            encoded = [self.tok_encode(c)[-(self.max_length - max_gen_toks):] for c in contexts]
            for batch in sorted_batches(list(zip(encoded, contexts)), lambda e: (-len(e[0]), e[1]), self.batch_size):
                texts = self._greedy([encoded[i] for i in batch], max_gen_toks)
                for i, text in zip(batch, texts):
                    for term in until:
                        if term:
                            text = text.split(term)[0]
                    answers[indices[i]] = text
        return answers  # type: ignore[return-value]

    # The scoring engine.

    def loglikelihood_tokens(self, requests: Sequence[Tuple[Tokens, Tokens]]) -> List[Tuple[float, bool]]:
        """(context tokens, continuation tokens) pairs -> (sum of log-probs, is_greedy), HFLM's batches."""
        for context, continuation in requests:
            if not context or not continuation:
                raise HarnessRequestError("a loglikelihood request needs at least one context and one "
                                          "continuation token (the continuation encodes to none)")
            if len(continuation) > self.max_length:
                raise HarnessRequestError(f"a continuation of {len(continuation)} tokens does not fit in "
                                          f"max_length {self.max_length}")
        answers: List[Optional[Tuple[float, bool]]] = [None] * len(requests)
        key = lambda r: (-(len(r[0]) + len(r[1])), tuple(r[0] + r[1]))  # noqa: E731 - HFLM's _collate
        for batch in sorted_batches(requests, key, self.batch_size):
            for i, answer in zip(batch, self._score_batch([requests[i] for i in batch])):
                answers[i] = answer
        return answers  # type: ignore[return-value]

    @torch.no_grad()
    def _score_batch(self, batch: Sequence[Tuple[Tokens, Tokens]]) -> List[Tuple[float, bool]]:
        inputs = [(context + continuation)[-(self.max_length + 1):][:-1] for context, continuation in batch]
        width = max(len(row) for row in inputs)
        tokens = torch.zeros(len(batch), width, dtype=torch.int64)  # right-padded with 0, as HFLM pads
        for row, ids in enumerate(inputs):
            tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        positions = torch.arange(width).expand_as(tokens)
        self.model.eval()
        logits = stage_forward(self.model, tokens.to(self.device), positions.to(self.device), None)  # [b, s, v]
        result = torch.zeros(len(batch), 2, dtype=torch.float64, device=self.device)  # [b, (log-prob, greedy)]
        if logits is not None:  # the last pipeline stage
            log_probs = logits.log_softmax(-1)
            for row, ((_, continuation), ids) in enumerate(zip(batch, inputs)):
                picked = log_probs[row, len(ids) - len(continuation):len(ids)]  # [cont, v]
                target = torch.tensor(continuation, device=picked.device)
                result[row, 0] = picked.gather(1, target[:, None]).sum().double()
                result[row, 1] = float(bool((picked.argmax(-1) == target).all()))
        result = from_last_stage(result).cpu()
        return [(float(log_prob), bool(greedy)) for log_prob, greedy in result.tolist()]

    def _generation_kwargs(self, kwargs: Dict[str, Any]) -> Tuple[List[str], int]:
        kwargs = copy.deepcopy(kwargs)
        if not isinstance(kwargs, dict):
            raise HarnessRequestError(f"generation arguments must be a dict, got {type(kwargs).__name__}")
        until = stop_sequences(kwargs.pop("until", None), self.tok_decode([self.eot_token_id]))
        max_gen_toks = self.max_gen_toks
        for alias in ("max_completion_tokens", "max_tokens", "max_new_tokens", "max_gen_toks"):  # lowest first
            max_gen_toks = kwargs.pop(alias, max_gen_toks)  # (normalize_gen_kwargs's aliases and priority)
        if not isinstance(max_gen_toks, int) or not 1 <= max_gen_toks < self.max_length:
            raise HarnessRequestError(f"max_gen_toks must be an integer in [1, max_length {self.max_length}), "
                                      f"got {max_gen_toks!r}")
        temperature = kwargs.pop("temperature", 0.0)
        if kwargs.pop("do_sample", temperature not in (0, 0.0, None)):
            raise HarnessRequestError("generate_until is greedy here: give do_sample false (or temperature 0)")
        for name in ("top_k", "top_p"):
            kwargs.pop(name, None)  # unused when not sampling (HF ignores them too)
        if kwargs:
            raise HarnessRequestError(f"unknown generation arguments: {', '.join(sorted(kwargs))}")
        return until, max_gen_toks

    def _greedy(self, contexts: Sequence[Tokens], max_gen_toks: int) -> List[str]:
        if any(not c for c in contexts):
            raise HarnessRequestError("a generate_until context must encode to at least one token")
        width = max(len(c) for c in contexts)
        tokens = torch.full((len(contexts), width), self.eot_token_id, dtype=torch.int64)
        for row, ids in enumerate(contexts):
            tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        lengths = torch.tensor([len(c) for c in contexts])
        self.model.eval()
        out = generate_tokens(self.model, tokens, lengths, max_gen_toks, top_k=1, eod=self.eot_token_id)
        texts = []
        for row, ids in enumerate(contexts):
            new = out.tokens[row, len(ids):min(int(out.lengths[row]), len(ids) + max_gen_toks)].tolist()
            if self.eot_token_id in new:
                new = new[:new.index(self.eot_token_id)]
            texts.append(self.tok_decode(new))
        return texts


def requests_of(instances: Iterable[Any]) -> List[tuple]:
    """lm_eval Instances (or anything with .args) -> their argument tuples."""
    return [tuple(instance.args) for instance in instances]
