"""The text generation server: Megatron's `PUT /api` and OpenAI's `POST /v1/completions`.

    client --HTTP--> GenerationServer (a thread per connection)
                       validate the body (server_requests)      -> 4xx + JSON error naming the field
                       with the generation lock: backend.generate(request)   (one request at a time)
                       answer: Megatron's {text, segments, logprobs, tokens} or OpenAI's completion

| path | method | body | answer |
|---|---|---|---|
| /api | PUT | Megatron's fields (prompts, tokens_to_generate, ...) | `{"text", "segments", "logprobs", "tokens"}` |
| /v1/completions (and Megatron's /completions) | POST | prompt, max_tokens, temperature, top_p, n, stop, logprobs, stream, ... | `{"id", "object": "text_completion", "choices", "usage"}`, or server-sent events |

The standard library's ThreadingHTTPServer serves it: the server answers a handful of JSON
routes for one model that computes one request at a time, so a framework (Flask, as Megatron
uses) would add a dependency and nothing we use. Requests wait for one lock, so answers never mix
and the other ranks see requests in one order; connections are read and validated outside it.

The backend is the seam to the model: `generate(request) -> dict` and `tokenize(text) -> ids`.
ApiBackend calls megatron.inference.api.generate; tools/run_text_generation_server.py wraps it so
every rank runs the same request.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List, Optional, Tuple

from megatron.inference.server_requests import (
    CompletionOptions, GenerationRequest, Limits, RequestError, decode_body, parse_api_request,
    parse_completions_request,
)
from megatron.inference.server_stream import IncrementalText, event, step_hook

API_PATH = "/api"
COMPLETIONS_PATHS = ("/v1/completions", "/completions")  # OpenAI's path, and Megatron's
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
_ROUTES = {API_PATH: "PUT", **{path: "POST" for path in COMPLETIONS_PATHS + CHAT_PATHS}}
# An oversized body is read and dropped up to this size so the client sees the 413 (closing a
# socket with unread data resets the connection, and the answer may be lost); larger: closed.
_DRAIN_LIMIT = 64 << 20


class EngineUnavailableError(RuntimeError):
    """The generation engine cannot be imported (reported in one line by the server tool)."""


class GenerationBackend:
    """What the server needs from a model: generate a request, and its tokenizer's two directions.

    A backend whose `streams` is True takes generate(request, on_step=hook) and calls hook(step,
    new_tokens [b]) after each decoding step (generate_tokens' on_step), and names the tokens that
    end a row in stop_ids(request); the server then streams completions as they are generated.
    """

    streams = False
    concurrent = False  # True: generate / submit may be called from many threads at once (EngineBackend)

    def generate(self, request: GenerationRequest) -> Dict[str, Any]:
        """Megatron's response body: text, segments, logprobs (or None), tokens (one per prompt)."""
        raise NotImplementedError

    def stop_ids(self, request: GenerationRequest) -> Tuple[int, ...]:
        """The tokens that end a generated row (a streaming backend's)."""
        raise NotImplementedError

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError

    def detokenize(self, ids: List[int]) -> str:
        raise NotImplementedError


class ApiBackend(GenerationBackend):
    """megatron.inference.api on one model and tokenizer (imported on first use)."""

    def __init__(self, model: Any, tokenizer: Any):
        import importlib

        try:  # here, not at the server's import: the server and its tests need no engine
            self.api = importlib.import_module("megatron.inference.api")
        except ImportError as error:
            raise EngineUnavailableError(f"the generation engine megatron.inference.api cannot be imported: "
                                         f"{error}") from None
        self.model, self.tokenizer = model, tokenizer

    streams = True

    def generate(self, request: GenerationRequest, on_step: Any = None) -> Dict[str, Any]:
        if request.beam_width is not None:
            return self._beam_search(request)
        return self.api.generate(self.model, self.tokenizer, list(request.prompts),
                                 tokens_to_generate=request.tokens_to_generate, logprobs=request.logprobs,
                                 top_k=request.top_k, top_p=request.top_p, top_p_decay=request.top_p_decay,
                                 top_p_bound=request.top_p_bound, temperature=request.temperature,
                                 add_BOS=request.add_BOS, stop_on_double_eol=request.stop_on_double_eol,
                                 stop_on_eol=request.stop_on_eol,
                                 prevent_newline_after_colon=request.prevent_newline_after_colon,
                                 random_seed=None if request.random_seed < 0 else request.random_seed,
                                 stop_token=request.stop_token, on_step=on_step,
                                 top_logprobs=request.top_logprobs)

    def stop_ids(self, request: GenerationRequest) -> Tuple[int, ...]:
        return (request.stop_token if request.stop_token is not None else self.tokenizer.eod,)

    def _beam_search(self, request: GenerationRequest) -> Dict[str, Any]:
        """Megatron's beam answer {text, segments, scores}: the whole beam, best first."""
        if request.tokens_to_generate < 1:
            raise RequestError("beam_width", "beam search needs tokens_to_generate >= 1")
        return self.api.beam_search(self.model, self.tokenizer, list(request.prompts), request.tokens_to_generate,
                                    request.beam_width, stop_token=request.stop_token,
                                    num_return_gen=request.beam_width, length_penalty=request.length_penalty,
                                    add_BOS=request.add_BOS)

    def tokenize(self, text: str) -> List[int]:
        return list(self.tokenizer.tokenize(text))

    def detokenize(self, ids: List[int]) -> str:
        return self.tokenizer.detokenize(ids)


class GenerationServer(ThreadingHTTPServer):
    """The HTTP server; `serve_forever()` (or `start()` for a background thread) and `shutdown()`."""

    daemon_threads = True
    request_queue_size = 128  # concurrent clients wait in the accept queue, not refused

    def __init__(self, backend: GenerationBackend, host: str = "127.0.0.1", port: int = 5000,
                 limits: Limits = Limits(), model_name: str = "megatron", log_requests: bool = True,
                 chat_template: Any = None):
        self.backend, self.limits, self.model_name = backend, limits, model_name
        self.chat_template = chat_template  # server_chat.ChatTemplate, or None: chat requests answer 400
        self.log_requests = log_requests
        self.generation_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> "GenerationServer":
        """Serve in a daemon thread (tests, notebooks)."""
        self._thread = threading.Thread(target=self.serve_forever, name="generation-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join()

    def run_generation(self, request: GenerationRequest, on_step: Any = None) -> Dict[str, Any]:
        """backend.generate under the lock: one request at a time, in arrival order of the lock (a
        concurrent backend, the engine's, orders its work itself)."""
        if self.backend.concurrent:
            return self.backend.generate(request) if on_step is None else self.backend.generate(request, on_step=on_step)
        with self.generation_lock:
            if on_step is None:
                return self.backend.generate(request)
            return self.backend.generate(request, on_step=on_step)


class _Handler(BaseHTTPRequestHandler):
    server: GenerationServer
    timeout = 60  # a client that stops sending mid-body frees its thread after this many seconds

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_POST(self) -> None:
        self._route("POST")

    def do_GET(self) -> None:
        self._route("GET")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_PATCH(self) -> None:
        self._route("PATCH")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if self.server.log_requests:
            super().log_message(format, *args)

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path not in _ROUTES:
                raise RequestError("path", f"no such path {path!r}; the paths are: {', '.join(_ROUTES)}", 404)
            if method != _ROUTES[path]:
                raise RequestError("method", f"{path} takes {_ROUTES[path]}, not {method}", 405)
            body = decode_body(self._read_body())
            if path == API_PATH:
                self._serve_api(body)
            else:
                self._serve_completions(body, chat=path in CHAT_PATHS)
        except RequestError as error:
            self._send_error(error)
        except Exception as error:  # noqa: BLE001 - a bug answers 500 and the server keeps serving
            traceback.print_exc(file=sys.stderr)
            self._send_error(RequestError(None, f"generation failed: {type(error).__name__}: {error}", 500))

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise RequestError("body", "chunked bodies are not accepted: send Content-Length", 411)
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise RequestError("body", "Content-Length is required", 411)
        try:
            length = int(length_header)
        except ValueError:
            raise RequestError("body", f"Content-Length must be an integer, got {length_header!r}") from None
        if length < 0:
            raise RequestError("body", f"Content-Length must not be negative, got {length}")
        limit = self.server.limits.max_body_bytes
        if length > limit:
            if length <= _DRAIN_LIMIT:
                self._drain(length)
            self.close_connection = True
            raise RequestError("body", f"the body has {length} bytes, more than the limit {limit}", 413)
        data = self.rfile.read(length)
        if len(data) < length:
            raise RequestError("body", f"the body ended after {len(data)} of {length} bytes")
        return data

    def _drain(self, length: int) -> None:
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 16))
            if not chunk:
                return
            length -= len(chunk)

    def _log_request(self, body: Dict[str, Any], request: GenerationRequest) -> None:
        if not request.no_log and self.server.log_requests:  # Megatron's request log lines
            print(f"request IP: {self.client_address[0]}\n{json.dumps(body)}\nstart time: "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}", file=sys.stderr, flush=True)

    def _serve_api(self, body: Dict[str, Any]) -> None:
        request = parse_api_request(body, self.server.limits)
        self._log_request(body, request)
        self._send_json(HTTPStatus.OK, _engine_call(self.server, request))

    def _serve_completions(self, body: Dict[str, Any], chat: bool = False) -> None:
        if chat:
            from megatron.inference.server_chat import parse_chat_request

            request, options = parse_chat_request(body, self.server.chat_template, self.server.limits,
                                                  self.server.model_name)
        else:
            request, options = parse_completions_request(body, self.server.limits, self.server.model_name)
        self._log_request(body, request)
        if hasattr(self.server.backend, "serve_completion"):  # the engine's backend: every request at once
            self.server.backend.serve_completion(self, request, options)
            return
        if options.chat:
            self._answer_chat(request, options, _engine_call(self.server, request))
            return
        if options.stream and _streams_incrementally(self.server.backend, request, options):
            self._stream_completions(request, options)
            return
        result = _engine_call(self.server, request)
        choices = completion_choices(self.server.backend, request, options, result)
        completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if not options.stream:
            counts = usage(self.server.backend, options, choices)
            self._send_json(HTTPStatus.OK, completion_answer(choices, options, completion_id, created, counts))
            return
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        for chunk in stream_chunks(choices, options):
            chunk.update(id=completion_id, object="text_completion", created=created, model=options.model)
            self.wfile.write(b"data: " + json.dumps(chunk).encode("utf-8") + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def _answer_chat(self, request: GenerationRequest, options: CompletionOptions, result: Dict[str, Any]) -> None:
        """A chat answer from a lock-step backend's result (streamed: after the whole generation)."""
        from megatron.inference.server_chat import chat_chunks, chat_completion

        choices = completion_choices(self.server.backend, request, options, result)
        fields = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": options.model}
        if not options.stream:
            answer = chat_completion(choices, options, fields["id"], fields["created"],
                                     usage(self.server.backend, options, choices))
            self._send_json(HTTPStatus.OK, answer)
            return
        self.start_stream()
        for chunk in chat_chunks(choices, options):
            self.write_event({**chunk, "object": "chat.completion.chunk", **fields})
        self.end_stream()

    def start_stream(self) -> None:
        """The headers of a server-sent event stream."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.close_connection = True

    def write_event(self, payload: Dict[str, Any]) -> bool:
        """One `data:` event; False when the client is gone."""
        try:
            self.wfile.write(b"data: " + json.dumps(payload).encode("utf-8") + b"\n\n")
            self.wfile.flush()
            return True
        except OSError:
            return False

    def end_stream(self) -> None:
        try:
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:
            pass

    def _stream_completions(self, request: GenerationRequest, options: CompletionOptions) -> None:
        """One event per token as generate_tokens produces it (server_stream), then the finishes."""
        backend, completion_id, created = self.server.backend, f"cmpl-{uuid.uuid4().hex}", int(time.time())
        fields = {"id": completion_id, "object": "text_completion", "created": created, "model": options.model}
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.close_connection = True
        lost = []  # a client gone mid-stream: stop writing, but let generation finish (the other ranks follow it)

        def send(index: int, text: str, finish: Optional[str] = None) -> None:
            if lost:
                return
            try:
                self.wfile.write(b"data: " + json.dumps(event(index, text, finish, **fields)).encode("utf-8") + b"\n\n")
                self.wfile.flush()
            except OSError:
                lost.append(True)

        prompt_ids = [backend.tokenize(prompt) for prompt in request.prompts]
        stops = backend.stop_ids(request)
        texts = [IncrementalText(backend.detokenize, ids, prompt, request.tokens_to_generate, options.stop, stops)
                 for ids, prompt in zip(prompt_ids, request.prompts)]
        if options.echo:
            for index, prompt in enumerate(request.prompts):
                send(index, prompt)
        lengths = [len(ids) + (1 if request.add_BOS else 0) for ids in prompt_ids]
        try:
            result = self.server.run_generation(request, on_step=step_hook(texts, lengths, send))
        except ValueError as error:  # before any token (a too long prompt): the stream says why
            send(0, "", "error")
            print(f"streamed request failed: {error}", file=sys.stderr, flush=True)
            return
        for choice, text in zip(completion_choices(backend, request, options, result), texts):
            final = choice["text"][len(text.prompt):] if options.echo else choice["text"]
            if final.startswith(text.sent) and len(final) > len(text.sent):
                send(choice["index"], final[len(text.sent):])
            send(choice["index"], "", choice["finish_reason"])
        if not lost:
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    def _send_json(self, status: int, payload: Any, headers: Optional[Dict[str, str]] = None) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, error: RequestError) -> None:
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        payload = {"error": {"message": error.message, "field": error.field, "type": kind}}
        headers = {"Allow": _ROUTES[self.path.split("?", 1)[0]]} if error.status == 405 else None
        self._send_json(error.status, payload, headers)


def _engine_call(server: GenerationServer, request: GenerationRequest) -> Dict[str, Any]:
    """The generation; the engine's ValueError (a prompt longer than the model's sequence, ...)
    is the request's fault: 400 with its message, as Megatron answers it."""
    try:
        return server.run_generation(request)
    except RequestError:
        raise
    except ValueError as error:
        raise RequestError("prompts", str(error)) from None


def _streams_incrementally(backend: GenerationBackend, request: GenerationRequest, options: CompletionOptions) -> bool:
    """Whether the stream is sent as tokens are generated; otherwise after the whole batch (a backend
    without on_step; per-token logprobs, known at the end; newline stops, decided inside the engine)."""
    return (backend.streams and options.logprobs is None and request.beam_width is None
            and not (request.stop_on_eol or request.stop_on_double_eol))


def completion_choices(backend: GenerationBackend, request: GenerationRequest, options: CompletionOptions,
                       result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """OpenAI choices from Megatron's result (whose text and segments hold prompt and completion).

    Each choice also carries `_segments`, `_tokens` and `_logprobs` of the completion (for the
    stream and the usage count); the caller drops them from the answer.
    """
    choices = []
    for index, prompt in enumerate(request.prompts):
        prompt_length = len(backend.tokenize(prompt)) + (1 if request.add_BOS else 0)
        # A batch runs to its longest prompt + tokens_to_generate (Megatron's rule), so a shorter
        # prompt's row holds more tokens than asked for: the completion keeps max_tokens of them.
        end = prompt_length + request.tokens_to_generate
        tokens = list(result["tokens"][index][prompt_length:end])
        segments = list(result["segments"][index][prompt_length:end])
        all_logprobs = (result.get("logprobs") or [None] * len(request.prompts))[index]
        logprobs = list(all_logprobs[prompt_length - 1:end - 1]) if all_logprobs is not None else None
        all_top = (result.get("top_logprobs") or [None] * len(request.prompts))[index]
        top = ([None if pairs is None else {backend.detokenize([token]): value for token, value in pairs}
                for pairs in all_top[prompt_length - 1:end - 1]] if all_top is not None else None)
        text = backend.detokenize(list(result["tokens"][index][:end]))
        completion = text[len(prompt):] if text.startswith(prompt) else backend.detokenize(tokens)
        finish = "length" if len(tokens) >= request.tokens_to_generate else "stop"
        cut = min((completion.find(stop) for stop in options.stop if stop in completion), default=-1)
        if cut >= 0:
            completion, finish = completion[:cut], "stop"
            kept = _tokens_within(segments, cut)
            segments, tokens = segments[:kept], tokens[:kept]
            logprobs = logprobs[:kept] if logprobs is not None else None
            top = top[:kept] if top is not None else None
        choice: Dict[str, Any] = {"text": (prompt if options.echo else "") + completion, "index": index,
                                  "logprobs": None, "finish_reason": finish}
        if options.logprobs is not None and logprobs is not None:
            choice["logprobs"] = {"tokens": segments, "token_logprobs": logprobs,
                                  "top_logprobs": top if options.logprobs > 0 else None,
                                  "text_offset": _offsets(segments, len(prompt) if options.echo else 0)}
        choice.update(_segments=segments, _tokens=tokens, _logprobs=logprobs, _top_logprobs=top)
        choices.append(choice)
    return choices


def completion_answer(choices: List[Dict[str, Any]], options: CompletionOptions, completion_id: str, created: int,
                      counts: Dict[str, int]) -> Dict[str, Any]:
    """OpenAI's text_completion answer (the choices' private _ fields dropped)."""
    public = [{key: value for key, value in choice.items() if not key.startswith("_")} for choice in choices]
    return {"id": completion_id, "object": "text_completion", "created": created, "model": options.model,
            "choices": public, "usage": counts}


def usage(backend: GenerationBackend, options: CompletionOptions, choices: List[Dict[str, Any]]) -> Dict[str, int]:
    """OpenAI's usage: each distinct prompt's tokens once, every choice's completion tokens."""
    prompt_tokens = sum(len(backend.tokenize(text)) for text in options.prompts)
    completion_tokens = sum(len(choice["_tokens"]) for choice in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _tokens_within(segments: List[str], length: int) -> int:
    """How many leading segments fit within `length` characters."""
    total = 0
    for count, segment in enumerate(segments):
        total += len(segment)
        if total > length:
            return count
    return len(segments)


def _offsets(segments: List[str], start: int) -> List[int]:
    offsets = []
    for segment in segments:
        offsets.append(start)
        start += len(segment)
    return offsets


def stream_chunks(choices: List[Dict[str, Any]], options: CompletionOptions) -> Iterator[Dict[str, Any]]:
    """Server-sent event payloads: one per completion token of each choice, then its finish.

    The fallback stream, sent once the batch is generated, when _streams_incrementally says no
    (per-token logprobs, newline stops, a backend without on_step); otherwise _stream_completions.
    """
    for choice in choices:
        index, logprobs, tops = choice["index"], choice["_logprobs"], choice.get("_top_logprobs")
        pieces: List[Tuple[str, Optional[float], Any]] = [
            (segment, logprobs[i] if logprobs is not None else None,
             tops[i] if tops is not None and options.logprobs else None)
            for i, segment in enumerate(choice["_segments"])]
        text = choice["text"]
        streamed = "".join(segment for segment, _, _ in pieces)
        if streamed != text:  # echo, or a stop cut inside a token: send the text whole
            pieces = [(text, None, None)]
        for segment, logprob, top in pieces:
            chunk_logprobs = None
            if options.logprobs is not None and logprob is not None:
                chunk_logprobs = {"tokens": [segment], "token_logprobs": [logprob],
                                  "top_logprobs": None if top is None else [top]}
            yield {"choices": [{"text": segment, "index": index, "logprobs": chunk_logprobs, "finish_reason": None}]}
        yield {"choices": [{"text": "", "index": index, "logprobs": None, "finish_reason": choice["finish_reason"]}]}
