"""The text generation server's request bodies, validated into one GenerationRequest.

    PUT /api              Megatron's fields  -> parse_api_request         -> GenerationRequest
    POST /v1/completions  OpenAI's fields    -> parse_completions_request -> (GenerationRequest, CompletionOptions)

Megatron's REST server (megatron/inference/text_generation_server.py) checks its fields in a
fixed order with fixed messages; we check the same fields, in the same order, for the same
ranges and combinations (top_k with top_p, top_p_decay without top_p, beam_width with more than
one prompt, an empty prompt without add_BOS, tokens_to_generate 0 without logprobs). Where we
differ (each on purpose, see docs/generation.md):

| | Megatron | here |
|---|---|---|
| a bad request | HTTP 200 (most checks) and a bare string | HTTP 400, `{"error": {"message", "field", "type"}}` |
| a field it does not know | ignored | refused, naming it |
| a bool where an int is due | accepted (`True` is an `int` in Python) | refused |
| an int where a float is due (`"top_p": 1`) | refused | accepted (JSON has one number type) |
| NaN / Infinity | accepted by the JSON parser | refused |
| tokens_to_generate | no upper bound | at most `Limits.max_tokens_to_generate` |
| stop_token default | 50256 (GPT-2's end of document) | None: the tokenizer's end of document |
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple


class RequestError(ValueError):
    """A request the server refuses: HTTP `status`, a message naming `field`."""

    def __init__(self, field: Optional[str], message: str, status: int = 400):
        super().__init__(message)
        self.field = field
        self.message = message
        self.status = status


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (the server's --max-* flags)."""
    max_body_bytes: int = 1 << 20
    max_prompts: int = 128  # Megatron's "Maximum number of prompts is 128"
    max_tokens_to_generate: int = 1024
    max_prompt_chars: int = 100_000


@dataclass(frozen=True)
class GenerationRequest:
    """Megatron's /api fields after validation, with Megatron's defaults."""
    prompts: Tuple[str, ...]
    tokens_to_generate: int = 64
    logprobs: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    add_BOS: bool = False
    stop_on_double_eol: bool = False
    stop_on_eol: bool = False
    prevent_newline_after_colon: bool = False
    random_seed: int = -1  # -1: no seed set for this request
    no_log: bool = False
    beam_width: Optional[int] = None
    stop_token: Optional[int] = None  # None: the tokenizer's end-of-document id
    length_penalty: float = 1.0
    top_logprobs: int = 0  # not an /api field: /v1/completions' logprobs=N asks for N alternatives

    def to_json(self) -> str:
        """The request as JSON (how rank 0 hands it to the other ranks: data, never code)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "GenerationRequest":
        values = json.loads(text)
        values["prompts"] = tuple(values["prompts"])
        return cls(**values)


API_FIELDS = tuple(field.name for field in dataclasses.fields(GenerationRequest) if field.name != "top_logprobs")
# Megatron's renamed fields: it answers these two with a hint, so do we.
_RENAMED = {"max_len": "max_len is no longer used. Replace with tokens_to_generate",
            "sentences": "sentences is no longer used. Replace with prompts"}


def decode_body(raw: bytes) -> Dict[str, Any]:
    """The JSON object in raw; RequestError(field "body") for anything else."""
    def refuse_constant(name: str) -> None:
        raise RequestError("body", f"the body is not valid JSON: {name} is not a number")

    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=refuse_constant)
    except UnicodeDecodeError:
        raise RequestError("body", "the body is not UTF-8 text") from None
    except RecursionError:
        raise RequestError("body", "the body is nested too deeply") from None
    except json.JSONDecodeError as error:
        raise RequestError("body", f"the body is not valid JSON: {error.msg} at line {error.lineno} "
                                   f"column {error.colno}") from None
    if not isinstance(body, dict):
        raise RequestError("body", f"the body must be a JSON object, got {_json_type(body)}")
    return body


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _refuse_unknown(body: Dict[str, Any], known: Tuple[str, ...]) -> None:
    for name in body:
        if name not in known:
            raise RequestError(name, f"unknown field {name!r}; the fields are: {', '.join(known)}")


def _bool(body: Dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(name, f"{name} must be a boolean value, got {_json_type(value)}")
    return value


def _int(body: Dict[str, Any], name: str, default: Any, low: int, high: Optional[int] = None) -> Any:
    value = body.get(name, default)
    if name not in body:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"{name} must be an integer, got {_json_type(value)}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise RequestError(name, f"{name} must be an integer {bound}, got {value}")
    return value


def _float(body: Dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(name, f"{name} must be a number, got {_json_type(value)}")
    return float(value)


def _prompt_list(value: Any, name: str, limits: Limits) -> List[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise RequestError(name, f"{name} must be a list of strings, got {_json_type(value)}"
                           if not isinstance(value, list) else f"{name} must be a list of strings")
    if not value:
        raise RequestError(name, f"{name} is empty")
    if len(value) > limits.max_prompts:
        raise RequestError(name, f"at most {limits.max_prompts} prompts per request, got {len(value)}")
    for index, prompt in enumerate(value):
        if len(prompt) > limits.max_prompt_chars:
            raise RequestError(name, f"{name}[{index}] has {len(prompt)} characters, more than the limit "
                                     f"{limits.max_prompt_chars}")
    return value


def parse_api_request(body: Dict[str, Any], limits: Limits = Limits()) -> GenerationRequest:
    """Megatron's PUT /api body -> GenerationRequest (RequestError naming the first bad field)."""
    for name, message in _RENAMED.items():
        if name in body:
            raise RequestError(name, message)
    _refuse_unknown(body, API_FIELDS)
    if "prompts" not in body:
        raise RequestError("prompts", "prompts argument required")
    prompts = _prompt_list(body["prompts"], "prompts", limits)
    tokens_to_generate = _int(body, "tokens_to_generate", 64, 0, limits.max_tokens_to_generate)
    logprobs = _bool(body, "logprobs", False)
    if tokens_to_generate == 0 and not logprobs:
        raise RequestError("tokens_to_generate", "tokens_to_generate=0 implies logprobs should be True")
    sampling = _sampling_fields(body)
    add_bos = _bool(body, "add_BOS", False)
    if any(not prompt for prompt in prompts) and not add_bos:
        raise RequestError("prompts", "Empty prompts require add_BOS=true")
    flags = {name: _bool(body, name, False) for name in ("stop_on_double_eol", "stop_on_eol",
                                                          "prevent_newline_after_colon")}
    random_seed = _int(body, "random_seed", -1, 0)
    no_log = _bool(body, "no_log", False)
    beam_width = _int(body, "beam_width", None, 1)
    if beam_width is not None and len(prompts) > 1:
        raise RequestError("beam_width", f"beam_width needs exactly one prompt (Megatron: \"When doing "
                                         f"beam_search, batch size must be 1\"), got {len(prompts)}")
    stop_token = _int(body, "stop_token", None, 0)
    length_penalty = _float(body, "length_penalty", 1.0)
    return GenerationRequest(prompts=tuple(prompts), tokens_to_generate=tokens_to_generate, logprobs=logprobs,
                             add_BOS=add_bos, random_seed=random_seed, no_log=no_log, beam_width=beam_width,
                             stop_token=stop_token, length_penalty=length_penalty, **flags, **sampling)


def _sampling_fields(body: Dict[str, Any]) -> Dict[str, Any]:
    """temperature, top_k, top_p, top_p_decay, top_p_bound: ranges and combinations as Megatron's."""
    temperature = _float(body, "temperature", 1.0)
    if not 0.0 < temperature <= 100.0:
        raise RequestError("temperature", f"temperature must be a positive number less than or equal to "
                                          f"100.0, got {temperature}")
    top_k = _int(body, "top_k", 0, 0, 1000)
    top_p = _float(body, "top_p", 0.0)
    if not 0.0 <= top_p <= 1.0:
        raise RequestError("top_p", f"top_p must be between 0.0 and 1.0, got {top_p}")
    if top_p > 0.0 and top_k > 0:
        raise RequestError("top_p", "cannot set both top-k and top-p samplings (top_k and top_p)")
    top_p_decay = _float(body, "top_p_decay", 0.0)
    if "top_p_decay" in body and top_p == 0.0:
        raise RequestError("top_p_decay", "top_p_decay cannot be set without top_p")
    if not 0.0 <= top_p_decay <= 1.0:
        raise RequestError("top_p_decay", f"top_p_decay must be between 0.0 and 1.0, got {top_p_decay}")
    top_p_bound = _float(body, "top_p_bound", 0.0)
    if "top_p_bound" in body:
        if top_p == 0.0:
            raise RequestError("top_p_bound", "top_p_bound cannot be set without top_p")
        if not 0.0 < top_p_bound <= top_p:
            raise RequestError("top_p_bound", f"top_p_bound must be greater than 0 and at most top_p "
                                              f"({top_p}), got {top_p_bound}")
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, top_p_decay=top_p_decay,
                top_p_bound=top_p_bound)


@dataclass(frozen=True)
class CompletionOptions:
    """The OpenAI fields that shape the answer rather than the generation."""
    model: str
    prompts: Tuple[str, ...]  # each once (the request's prompts hold each n times)
    n: int = 1
    stop: Tuple[str, ...] = ()
    logprobs: Optional[int] = None
    echo: bool = False
    stream: bool = False
    chat: bool = False  # /v1/chat/completions: answered in the chat shapes (server_chat)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop",
                     "logprobs", "stream", "seed", "echo", "user")


def parse_completions_request(body: Dict[str, Any], limits: Limits = Limits(), model_name: str = "megatron"
                              ) -> Tuple[GenerationRequest, CompletionOptions]:
    """OpenAI's POST /v1/completions body -> the generation to run and how to answer it.

    temperature 0 means greedy (top_k 1), as OpenAI's; top_p 1 means no nucleus filtering.
    """
    _refuse_unknown(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise RequestError("prompt", "prompt is required")
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) else _prompt_list(prompt, "prompt", limits)
    _prompt_list(prompts, "prompt", limits)
    if any(not text for text in prompts):
        raise RequestError("prompt", "prompt must not be empty")
    model = body.get("model", model_name)
    if not isinstance(model, str):
        raise RequestError("model", f"model must be a string, got {_json_type(model)}")
    max_tokens = _int(body, "max_tokens", 16, 1, limits.max_tokens_to_generate)
    temperature = _float(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 100.0:
        raise RequestError("temperature", f"temperature must be between 0 and 100, got {temperature}")
    top_p = _float(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise RequestError("top_p", f"top_p must be greater than 0 and at most 1, got {top_p}")
    top_k = _int(body, "top_k", 0, 0, 1000)
    if top_k > 0 and top_p < 1.0:
        raise RequestError("top_p", "cannot set both top_k and top_p")
    n = _int(body, "n", 1, 1, limits.max_prompts)
    if n * len(prompts) > limits.max_prompts:
        raise RequestError("n", f"n x prompts = {n * len(prompts)} completions, more than the limit "
                                f"{limits.max_prompts}")
    stop = _stop_strings(body.get("stop"))
    logprobs = _int(body, "logprobs", None, 0, 5) if body.get("logprobs") is not None else None
    seed = _int(body, "seed", -1, 0)
    greedy = temperature == 0.0
    request = GenerationRequest(
        prompts=tuple(text for text in prompts for _ in range(n)), tokens_to_generate=max_tokens,
        logprobs=logprobs is not None, temperature=1.0 if greedy else temperature,
        top_k=1 if greedy else top_k, top_p=0.0 if greedy or top_p == 1.0 else top_p, random_seed=seed,
        no_log=False, top_logprobs=logprobs or 0)
    options = CompletionOptions(model=model, prompts=tuple(prompts), n=n, stop=stop, logprobs=logprobs,
                                echo=_bool(body, "echo", False), stream=_bool(body, "stream", False))
    return request, options


def _stop_strings(value: Any) -> Tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(item, str) and item for item in stops):
        raise RequestError("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > 4:
        raise RequestError("stop", f"at most 4 stop strings, got {len(stops)}")
    return tuple(stops)
