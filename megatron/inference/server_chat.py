"""POST /v1/chat/completions: OpenAI's chat body, the model's chat template, the chat answer shapes.

    body -> parse_chat_request -> (GenerationRequest over the rendered prompt, CompletionOptions)
    the completion machinery generates it (server.completion_choices)
    choices -> chat_completion (whole answer) / chat_chunks (stream: true)

The prompt is the conversation rendered by a ChatTemplate:
| source | how |
|---|---|
| an HF tokenizer folder's tokenizer_config.json "chat_template" (--load-hf, --tokenizer-model DIR) | Jinja, in jinja2's immutable sandbox (as transformers renders it): a template can compute, never run code |
| --chat-template chatml | `<|im_start|>role\ncontent<|im_end|>\n` ..., then `<|im_start|>assistant\n` |
| --chat-template llama2-chat | `[INST] <<SYS>>\nsystem\n<</SYS>>\n\nuser [/INST] assistant </s><s>[INST] ...` |
| --chat-template FILE | a Jinja template file |
A named format's end-of-turn text (`<|im_end|>`, `</s>`) is an extra stop string.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from megatron.inference.server_requests import (
    CompletionOptions, GenerationRequest, Limits, RequestError, _bool, _float, _int, _json_type, _refuse_unknown,
    _stop_strings,
)

CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
               "stream", "stream_options", "seed", "logprobs", "top_logprobs", "user")
ROLES = ("system", "user", "assistant", "developer")


@dataclass(frozen=True)
class ChatTemplate:
    """render(messages) -> the prompt text that asks for the assistant's next turn."""

    name: str
    source: str  # Jinja text
    stops: Tuple[str, ...] = ()
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: List[Dict[str, str]]) -> str:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:  # the helper HF templates call on a bad conversation
            raise RequestError("messages", f"the chat template refused the conversation: {message}")

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        try:
            return environment.from_string(self.source).render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token)
        except RequestError:
            raise
        except Exception as error:  # noqa: BLE001 - a template error is the request's or the template's, never a crash
            raise RequestError("messages", f"the chat template {self.name} failed: {type(error).__name__}: "
                                           f"{error}") from None


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA2_CHAT = (
    "{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set ns.system = '<<SYS>>\n' + m['content'] + '\n<</SYS>>\n\n' %}{% elif m['role'] == 'user' %}"
    "{{ bos_token }}[INST] {{ ns.system }}{{ m['content'] }} [/INST]{% set ns.system = '' %}"
    "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")
NAMED = {"chatml": ChatTemplate("chatml", CHATML, stops=("<|im_end|>",)),
         "llama2-chat": ChatTemplate("llama2-chat", LLAMA2_CHAT, stops=("</s>",), bos_token="<s>", eos_token="</s>")}


def load_chat_template(spec: Optional[str], tokenizer_dir: Optional[str]) -> Optional[ChatTemplate]:
    """--chat-template's template (a name of NAMED or a Jinja file), else the tokenizer folder's
    tokenizer_config.json chat_template, else None (chat requests answer 400). ValueError: one line."""
    if spec:
        if spec in NAMED:
            return NAMED[spec]
        if not os.path.isfile(spec):
            raise ValueError(f"--chat-template {spec}: not a named format ({', '.join(NAMED)}) nor a file")
        with open(spec, encoding="utf-8") as handle:
            return ChatTemplate(os.path.basename(spec), handle.read())
    config_file = os.path.join(tokenizer_dir, "tokenizer_config.json") if tokenizer_dir else None
    if not config_file or not os.path.isfile(config_file):
        return None
    with open(config_file, encoding="utf-8") as handle:
        config = json.load(handle)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        return None

    def token(name: str) -> str:
        value = config.get(name) or ""
        return value.get("content", "") if isinstance(value, dict) else str(value)

    return ChatTemplate(os.path.basename(os.path.normpath(tokenizer_dir)), template,
                        bos_token=token("bos_token"), eos_token=token("eos_token"))


def _messages(value: Any) -> List[Dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages", "messages must be a non-empty list of {role, content} objects"
                           if isinstance(value, list) else f"messages must be a list, got {_json_type(value)}")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise RequestError("messages", f"messages[{index}] must be an object, got {_json_type(message)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RequestError("messages", f"messages[{index}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if isinstance(content, list):  # OpenAI's content parts: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError("messages", f"messages[{index}].content parts must be text parts")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError("messages", f"messages[{index}].content must be a string, got {_json_type(content)}")
        unknown = set(message) - {"role", "content", "name"}
        if unknown:
            raise RequestError("messages", f"messages[{index}] has unknown field {sorted(unknown)[0]!r}")
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    return messages


def parse_chat_request(body: Dict[str, Any], template: Optional[ChatTemplate], limits: Limits = Limits(),
                       model_name: str = "megatron") -> Tuple[GenerationRequest, CompletionOptions]:
    """OpenAI's chat body -> the generation of the rendered prompt and how to answer (options.chat)."""
    _refuse_unknown(body, CHAT_FIELDS)
    if "messages" not in body:
        raise RequestError("messages", "messages is required")
    messages = _messages(body["messages"])
    model = body.get("model", model_name)
    if not isinstance(model, str):
        raise RequestError("model", f"model must be a string, got {_json_type(model)}")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int(body, name, 16, 1, limits.max_tokens_to_generate)
    temperature = _float(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise RequestError("temperature", f"temperature must be between 0 and 2, got {temperature}")
    top_p = _float(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise RequestError("top_p", f"top_p must be greater than 0 and at most 1, got {top_p}")
    n = _int(body, "n", 1, 1, limits.max_prompts)
    stop = _stop_strings(body.get("stop"))
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _int(body, "top_logprobs", 0, 0, 20)
    if "top_logprobs" in body and not logprobs:
        raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")
    seed = _int(body, "seed", -1, 0)
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and (not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}):
        raise RequestError("stream_options", "stream_options must be an object with include_usage only")
    if template is None:
        raise RequestError("messages", "this model has no chat template: start the server with --chat-template "
                                       "(chatml, llama2-chat or a Jinja file) or a tokenizer folder that has one")
    prompt = template.render(messages)
    if len(prompt) > limits.max_prompt_chars:
        raise RequestError("messages", f"the conversation has {len(prompt)} characters, more than the limit "
                                       f"{limits.max_prompt_chars}")
    greedy = temperature == 0.0
    request = GenerationRequest(
        prompts=(prompt,) * n, tokens_to_generate=max_tokens, logprobs=logprobs,
        temperature=1.0 if greedy else temperature, top_k=1 if greedy else 0,
        top_p=0.0 if greedy or top_p == 1.0 else top_p, random_seed=seed, top_logprobs=top_logprobs)
    options = CompletionOptions(model=model, prompts=(prompt,), n=n, stop=stop + template.stops,
                                logprobs=top_logprobs if logprobs else None, stream=stream, chat=True,
                                include_usage=bool((stream_options or {}).get("include_usage")))
    return request, options


def _token_entry(text: str, logprob: float) -> Dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(choice: Dict[str, Any], options: CompletionOptions) -> Optional[Dict[str, Any]]:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]} of a completion choice."""
    if options.logprobs is None or choice.get("_logprobs") is None:
        return None
    tops = choice.get("_top_logprobs") or [None] * len(choice["_segments"])
    content = []
    for segment, logprob, top in zip(choice["_segments"], choice["_logprobs"], tops):
        entry = _token_entry(segment, logprob)
        entry["top_logprobs"] = [_token_entry(t, v) for t, v in (top or {}).items()][:options.logprobs]
        content.append(entry)
    return {"content": content}


def chat_completion(choices: List[Dict[str, Any]], options: CompletionOptions, completion_id: str, created: int,
                    usage: Dict[str, int]) -> Dict[str, Any]:
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": options.model,
            "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                         "logprobs": chat_logprobs(c, options), "finish_reason": c["finish_reason"]}
                        for c in choices],
            "usage": usage}


def chat_chunk(index: int, delta: Dict[str, Any], finish: Optional[str] = None,
               logprobs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One chat stream chunk's choices (the caller adds id, object, created, model)."""
    return {"choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def chat_chunks(choices: List[Dict[str, Any]], options: CompletionOptions) -> Iterator[Dict[str, Any]]:
    """The whole answer as chunks (the stream sent after generation: with logprobs, or a lock-step backend)."""
    for choice in choices:
        index = choice["index"]
        yield chat_chunk(index, {"role": "assistant", "content": ""})
        pieces = choice["_segments"]
        if "".join(pieces) != choice["text"]:  # a stop cut inside a token: the text whole
            pieces = [choice["text"]]
            logprobs = None
        else:
            logprobs = chat_logprobs(choice, options)
        for i, piece in enumerate(pieces):
            piece_logprobs = {"content": [logprobs["content"][i]]} if logprobs else None
            yield chat_chunk(index, {"content": piece}, logprobs=piece_logprobs)
        yield chat_chunk(index, {}, choice["finish_reason"])
