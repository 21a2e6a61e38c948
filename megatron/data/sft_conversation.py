"""Chat conversations -> token ids and loss flags, through a chat template (--sft).

    tokenize_conversation(tokenizer, template, messages) -> (ids int64 [n], loss bool [n])

The template is a Jinja chat template, rendered as transformers' apply_chat_template renders
one (a sandboxed environment with trim_blocks and lstrip_blocks, `raise_exception`, a `tojson`
filter, `strftime_now`; the variables `messages`, `add_generation_prompt` and the tokenizer's
special tokens, `bos_token`, `eos_token`, ...). It comes from the tokenizer's
tokenizer_config.json (--sft-tokenizer-prompt-format default) or from PROMPT_FORMATS by name.

Which tokens are trained (loss True): those of each assistant turn, its end-of-turn text
included. The assistant turn i covers the characters between the rendering of messages[:i]
with the generation prompt (the prompt ends where the answer begins: "...[/INST]",
"...<|im_start|>assistant\\n") and the rendering of messages[:i + 1] (which ends with the
turn's end: " </s>", "<|im_end|>\\n"). A template that does not render turns as prefixes of
the whole conversation is refused (TemplateError). Every other character -- system, user, the
role headers, the generation prompt -- is prompt.

The rendered text is tokenized once as a whole, without added special tokens (the template
writes its own BOS), and a token is trained when its character span overlaps an assistant
turn (a tokenizer's `encode_with_offsets`, HuggingFace fast tokenizers). A tokenizer without
character spans tokenizes prompt and answer pieces separately and concatenates them.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

ROLES = ("system", "user", "assistant")

# Named prompt formats (--sft-tokenizer-prompt-format). "default" is the tokenizer's own template.
PROMPT_FORMATS: Dict[str, str] = {
    # Llama-2-chat: [INST] ... [/INST] per user turn, the system prompt inside the first one in
    # <<SYS>> markers, each answer followed by EOS; every user turn starts with BOS.
    "llama2-chat": (
        "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
        "{% set turns = messages[1:] %}{% else %}{% set system = none %}{% set turns = messages %}{% endif %}"
        "{% for message in turns %}"
        "{% if message['role'] == 'user' %}"
        "{% if loop.first and system is not none %}"
        "{% set text = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}"
        "{% else %}{% set text = message['content'] %}{% endif %}"
        "{{ bos_token + '[INST] ' + text.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}"
        "{% endif %}{% endfor %}"),
    # ChatML: <|im_start|>ROLE\nCONTENT<|im_end|>\n per message.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    # Megatron-LM's default SFT format (nemotron-h-aligned): the user turn ends with the
    # assistant header, an answer with a newline.
    "nemotron-h-aligned": (
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ '<SPECIAL_10>System\\n' + message['content'].strip() + '\\n' }}"
        "{% elif message['role'] == 'user' %}"
        "{{ '<SPECIAL_11>User\\n' + message['content'].strip() + '\\n<SPECIAL_11>Assistant\\n' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'].strip() + '\\n' }}"
        "{% endif %}{% endfor %}"),
}
DEFAULT_FORMAT = "default"


class TemplateError(ValueError):
    """A chat template that cannot be rendered or whose assistant turns cannot be located."""


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:  # pragma: no cover - jinja2 comes with transformers
        raise TemplateError("rendering a chat template needs jinja2: pip install jinja2") from err

    class GenerationBlocks(Extension):
        """transformers' {% generation %} ... {% endgeneration %} markers, rendered as their body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(f"the chat template refused the conversation: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as err:
        raise TemplateError(f"the chat template does not parse: {err}") from None


def render(template: str, messages: Sequence[Dict[str, Any]], add_generation_prompt: bool = False,
           special_tokens: Dict[str, str] | None = None) -> str:
    """The template's text for `messages`, as transformers' apply_chat_template(tokenize=False)."""
    try:
        return _compiled(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                          **(special_tokens or {}))
    except TemplateError:
        raise
    except Exception as err:  # jinja2's errors (undefined variables, sandbox) as one line
        raise TemplateError(f"the chat template failed to render: {type(err).__name__}: {err}") from None


def assistant_spans(template: str, messages: Sequence[Dict[str, Any]],
                    special_tokens: Dict[str, str] | None = None) -> Tuple[str, List[Tuple[int, int]]]:
    """(rendered text, [start, end) character range of each assistant turn, its end of turn included)."""
    text = render(template, messages, False, special_tokens)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(template, messages[:i], True, special_tokens)
        through = render(template, messages[:i + 1], False, special_tokens)
        if not (text.startswith(through) and through.startswith(prompt)):
            raise TemplateError("the chat template does not render a conversation's first turns as a prefix of "
                                "the whole conversation, so its assistant turns cannot be located")
        spans.append((len(prompt), len(through)))
    return text, spans


def _special_tokens(tokenizer: Any) -> Dict[str, str]:
    found = getattr(tokenizer, "special_tokens_map", None)
    return dict(found) if isinstance(found, dict) else {}


def tokenize_conversation(tokenizer: Any, template: str, messages: Sequence[Dict[str, Any]]
                          ) -> Tuple[np.ndarray, np.ndarray]:
    """(ids int64 [n], loss bool [n]): the conversation's tokens and which of them are trained."""
    text, spans = assistant_spans(template, messages, _special_tokens(tokenizer))
    encode = getattr(tokenizer, "encode_with_offsets", None)
    if encode is not None:
        ids, offsets = encode(text)
        if offsets is not None:
            ids = np.asarray(ids, dtype=np.int64)
            bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
            loss = np.zeros(len(ids), dtype=bool)
            for start, end in spans:  # a token overlapping the turn's characters is trained
                loss |= (bounds[:, 0] < end) & (bounds[:, 1] > start) & (bounds[:, 1] > bounds[:, 0])
            return ids, loss
    pieces, cut = [], 0  # no character spans: tokenize prompt and answer pieces separately
    for start, end in spans:
        pieces += [(text[cut:start], False), (text[start:end], True)]
        cut = end
    pieces.append((text[cut:], False))
    ids_parts, loss_parts = [], []
    for piece, trained in pieces:
        if piece:
            piece_ids = encode(piece)[0] if encode is not None else tokenizer.tokenize(piece)
            ids_parts.append(np.asarray(piece_ids, dtype=np.int64))
            loss_parts.append(np.full(len(piece_ids), trained))
    if not ids_parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    return np.concatenate(ids_parts), np.concatenate(loss_parts)
