"""EngineBackend: the server's requests served together by the DynamicEngine (in-flight batching).

    handler threads                         the engine thread (owns the model)
      submit(prompt ids, params) --inbox-->   each iteration: take the inbox (adds, cancels, /api calls),
      wait on the handle's events  <-token--    [TP/PP: broadcast them to the other ranks as JSON],
      cancel(handle) (client gone, stop)        apply them, run the /api calls, engine.step(),
                                                hand each new token to its request's handle

POST /v1/completions and /v1/chat/completions go through the engine: each prompt (x n) is one
engine request; tokens are streamed as they come (server-sent events) or collected; a stop
string or a client that went away cancels the request (its blocks return to the pool). Limits
answer at submit time: 413 (prompt + max_tokens over the engine's sequence), 503 (more KV blocks
than the whole cache), 429 (the queue is full). PUT /api keeps generate_tokens' batch semantics
(every row runs to the longest prompt + tokens_to_generate, prompt log-probs, beam search): its
calls run on the engine thread between steps, one at a time.

Under tensor / pipeline parallelism rank 0 serves and the other ranks run follow_engine(): each
iteration rank 0 broadcasts the applied operations (JSON bytes: data, never code), every rank
applies them in the same order and steps, so the collectives line up.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import select
import socket
import sys
import threading
import time
import traceback
import uuid
from http import HTTPStatus
from typing import Any, Callable, Dict, List, Optional

import torch

from megatron.inference.engine import DynamicEngine, RequestRejected, SamplingParams
from megatron.inference.server import ApiBackend, completion_choices
from megatron.inference.server_requests import CompletionOptions, GenerationRequest, RequestError
from megatron.inference.server_stream import IncrementalText, event

_DONE = None  # the last event of a handle


class Handle:
    """One engine request seen from a handler thread: its events (handle, new token id), then
    (handle, _DONE), go to `events` (a queue the handles of one HTTP request share)."""

    def __init__(self, prompt_ids: List[int], params: SamplingParams, events: Optional[queue.Queue] = None):
        self.prompt_ids, self.params = prompt_ids, params
        self.request = None  # the engine's Request, once the engine thread added it
        self.events: queue.Queue = events if events is not None else queue.Queue()
        self.error: Optional[Exception] = None
        self.done = False


class _Call:
    def __init__(self, request: GenerationRequest):
        self.request, self.result, self.error = request, None, None
        self.finished = threading.Event()


class EngineBackend(ApiBackend):
    """A GenerationBackend whose completions run on a DynamicEngine (see the module docstring)."""

    concurrent = True  # the server takes no generation lock

    def __init__(self, engine: DynamicEngine, tokenizer: Any, broadcast: Optional[Callable[[list], None]] = None,
                 max_queue: int = 1024):
        super().__init__(engine.model, tokenizer)
        self.engine, self.broadcast, self.max_queue = engine, broadcast, max_queue
        self.cond = threading.Condition()
        self.inbox: list = []
        self.queued = 0  # submitted, not yet running or finished
        self.handles: Dict[int, Handle] = {}
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="inference-engine", daemon=True)
        self.thread.start()

    # -- handler side ---------------------------------------------------------------------------

    def submit(self, prompt_ids: List[int], params: SamplingParams, events: Optional[queue.Queue] = None) -> Handle:
        """Queue one request; RequestError 413 / 503 / 429 (or 400) at once when it cannot be served."""
        try:
            self.engine.check_request(len(prompt_ids), params)
        except RequestRejected as error:
            raise RequestError("max_tokens" if error.status == 413 else None, str(error), error.status) from None
        except ValueError as error:
            raise RequestError("prompt", str(error)) from None
        handle = Handle(prompt_ids, params, events)
        with self.cond:
            waiting = self.queued + len(self.engine.waiting)
            if waiting >= self.max_queue:
                raise RequestError(None, f"{waiting} requests are waiting (the queue's limit is {self.max_queue}): "
                                         "retry later", 429)
            self.queued += 1
            self.inbox.append(("add", handle))
            self.cond.notify()
        return handle

    def cancel(self, handle: Handle) -> None:
        with self.cond:
            if not handle.done:
                self.inbox.append(("cancel", handle))
                self.cond.notify()

    def generate(self, request: GenerationRequest, on_step: Any = None) -> Dict[str, Any]:
        """PUT /api: generate_tokens' batch (ApiBackend.generate) on the engine thread, between steps."""
        if on_step is not None:
            raise ValueError("the engine backend streams through submit()")
        call = _Call(request)
        with self.cond:
            self.inbox.append(("call", call))
            self.cond.notify()
        call.finished.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def serve_completion(self, handler: Any, request: GenerationRequest, options: CompletionOptions) -> None:
        """The server's completions and chat completions (serve_on_engine)."""
        serve_on_engine(handler, request, options)

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.inbox.append(("stop", None))
            self.cond.notify()
        self.thread.join()

    # -- the engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.inbox and not self.engine.has_work():
                    self.cond.wait()
                commands, self.inbox = self.inbox, []
            ops, calls, stop = self._apply(commands)
            if self.broadcast is not None:
                self.broadcast(ops)
            for call in calls:
                try:
                    call.result = ApiBackend.generate(self, call.request)
                except Exception as error:  # noqa: BLE001 - the handler answers it (400 or 500)
                    call.error = error
                call.finished.set()
            if stop:
                return
            self._step()

    def _apply(self, commands: list) -> tuple:
        ops, calls, stop = [], [], False
        for kind, item in commands:
            if kind == "add":
                with self.cond:
                    self.queued -= 1
                try:
                    item.request = self.engine.add_request(item.prompt_ids, item.params)
                except ValueError as error:  # RequestRejected included
                    item.error, item.done = error, True
                    item.events.put((item, _DONE))
                    continue
                self.handles[item.request.request_id] = item
                ops.append(["add", item.prompt_ids, dataclasses.asdict(item.params)])
            elif kind == "cancel":
                if item.request is not None and not item.done:
                    self.engine.cancel(item.request.request_id)
                    ops.append(["cancel", item.request.request_id])
                    self._close(item)
            elif kind == "call":
                calls.append(item)
                ops.append(["call", item.request.to_json()])
            else:
                stop = True
                ops.append(["stop"])
        return ops, calls, stop

    def _step(self) -> None:
        try:
            touched = self.engine.step()
        except Exception as error:  # noqa: BLE001 - every running request fails, the server serves on
            traceback.print_exc(file=sys.stderr)
            for handle in list(self.handles.values()):
                self.engine.cancel(handle.request.request_id)
                handle.error = error
                self._close(handle)
            return
        for request in touched:
            handle = self.handles.get(request.request_id)
            if handle is None:
                continue
            handle.events.put((handle, request.generated[-1]))
            if request.finished:
                self._close(handle)

    def _close(self, handle: Handle) -> None:
        handle.done = True
        self.handles.pop(handle.request.request_id, None)
        handle.events.put((handle, _DONE))


def follow_engine(engine: DynamicEngine, api_backend: ApiBackend, receive: Callable[[], list]) -> None:
    """Ranks other than 0: apply rank 0's operations of each iteration and step with it, until "stop"."""
    while True:
        for op in receive():
            if op[0] == "add":
                engine.add_request(op[1], SamplingParams(**{**op[2], "stop_token_ids": tuple(op[2]["stop_token_ids"])}))
            elif op[0] == "cancel":
                engine.cancel(op[1])
            elif op[0] == "call":
                try:
                    api_backend.generate(GenerationRequest.from_json(op[1]))
                except Exception:  # noqa: BLE001 - rank 0 met the same error and answered it
                    pass
            else:
                return
        if engine.has_work():
            try:
                engine.step()
            except Exception:  # noqa: BLE001 - as rank 0: its requests are cancelled, serving goes on
                traceback.print_exc(file=sys.stderr)
                for request in list(engine.running) + list(engine.waiting):
                    engine.cancel(request.request_id)


def json_broadcaster(src: int = 0) -> tuple:
    """(send(ops), receive() -> ops): the operations as JSON bytes over the default group."""
    from megatron.core import communication, device

    def send(ops: list) -> None:
        payload = torch.tensor(list(json.dumps(ops).encode("utf-8")), dtype=torch.uint8)
        header = torch.tensor([payload.numel()], dtype=torch.int64, device=device.get_device())
        communication.broadcast(header, src)  # [n bytes]
        communication.broadcast(payload.to(device.get_device()), src)  # [n bytes] of JSON

    def receive() -> list:
        header = torch.zeros(1, dtype=torch.int64, device=device.get_device())
        communication.broadcast(header, src)
        payload = torch.zeros(int(header[0]), dtype=torch.uint8, device=device.get_device())
        communication.broadcast(payload, src)
        return json.loads(bytes(payload.cpu().tolist()).decode("utf-8"))

    return send, receive


# -- the handler's side of a completion --------------------------------------------------------


def sampling_params(backend: EngineBackend, request: GenerationRequest, index: int) -> SamplingParams:
    """The engine parameters of choice `index` (seed + index: n choices of one seeded request differ)."""
    return SamplingParams(max_tokens=request.tokens_to_generate, temperature=request.temperature,
                          top_k=request.top_k, top_p=request.top_p,
                          seed=None if request.random_seed < 0 else request.random_seed + index,
                          stop_token_ids=tuple(backend.stop_ids(request)), logprobs=request.logprobs,
                          top_logprobs=request.top_logprobs)


def client_gone(connection: socket.socket) -> bool:
    """Whether the client closed its side (a readable socket with nothing to read)."""
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def run_choices(backend: EngineBackend, request: GenerationRequest, options: CompletionOptions,
                on_piece: Optional[Callable[[int, str, Dict[str, Any]], bool]] = None,
                gone: Optional[Callable[[], bool]] = None) -> Optional[List[Dict[str, Any]]]:
    """Generate every choice on the engine; the completion choices (server.completion_choices), or
    None when the client went away (its requests cancelled). on_piece(index, text, tokens) gets each
    piece of text as it becomes final, with the tokens whose text is now all sent (their `_segments`,
    `_logprobs` and `_top_logprobs`, as a choice holds them; empty while the tokens' texts do not
    line up with the text, e.g. a character split over tokens), and returns False when it could not be
    sent (the client is gone)."""
    prompt_ids = [backend.tokenize(prompt) for prompt in request.prompts]
    events: queue.Queue = queue.Queue()
    handles: List[Handle] = []
    try:
        for index, ids in enumerate(prompt_ids):
            handles.append(backend.submit(ids, sampling_params(backend, request, index), events))
    except RequestError:
        _abandon(backend, handles)
        raise
    stops = backend.stop_ids(request)
    texts = [IncrementalText(backend.detokenize, ids, prompt, request.tokens_to_generate, options.stop, stops)
             for ids, prompt in zip(prompt_ids, request.prompts)]
    index_of = {id(handle): index for index, handle in enumerate(handles)}
    segments: List[List[str]] = [[] for _ in handles]  # each choice's tokens' texts so far
    covered = [0] * len(handles)  # tokens whose text has been sent whole
    open_, checked = len(handles), time.monotonic()
    while open_:
        if gone is not None and time.monotonic() - checked > 0.02:  # the client may have left
            if gone():
                return _abandon(backend, handles)
            checked = time.monotonic()
        try:
            handle, token = events.get(timeout=0.02)
        except queue.Empty:
            continue
        index = index_of[id(handle)]
        if token is _DONE:
            open_ -= 1
            continue
        if token not in stops:
            segments[index].append(backend.detokenize([token]))
        piece = texts[index].add(token)
        if piece and on_piece is not None:
            sent = texts[index].sent
            tokens = _tokens_sent(segments[index], sent, covered[index])
            start, covered[index] = covered[index], covered[index] + len(tokens)
            engine_request = handle.request
            tokens["_logprobs"] = list(engine_request.logprobs[start:covered[index]]) if request.logprobs else None
            tokens["_top_logprobs"] = ([{backend.detokenize([t]): v for t, v in pairs}
                                        for pairs in engine_request.top_logprobs[start:covered[index]]]
                                       if request.top_logprobs else None)
            if not on_piece(index, piece, tokens):
                return _abandon(backend, handles)
        if texts[index].done:  # a stop string (or max_tokens): nothing more is needed
            backend.cancel(handle)
    for handle in handles:
        if handle.error is not None:
            raise handle.error
    return completion_choices(backend, request, options, _result(backend, request, prompt_ids, handles))


def _tokens_sent(segments: List[str], sent: str, covered: int) -> Dict[str, Any]:
    """The tokens after the first `covered` whose texts lie whole within the text sent so far,
    {"_segments": [...]}; none when the tokens' texts are not the text's start (a character whose
    bytes are split over tokens: their log-probs then come with the last chunk)."""
    start = len("".join(segments[:covered]))
    end, count = start, covered
    while count < len(segments) and end + len(segments[count]) <= len(sent):
        end += len(segments[count])
        count += 1
    if not sent.startswith("".join(segments[:count])):
        return {"_segments": []}
    return {"_segments": segments[covered:count]}


def _abandon(backend: EngineBackend, handles: List[Handle]) -> None:
    for handle in handles:
        backend.cancel(handle)
    return None


def _result(backend: EngineBackend, request: GenerationRequest, prompt_ids: List[List[int]],
            handles: List[Handle]) -> Dict[str, Any]:
    """Megatron's result shape (completion_choices reads it): tokens and segments with the prompt,
    log-probs aligned to the positions that predict each token."""
    result: Dict[str, Any] = {"tokens": [], "segments": [], "logprobs": [] if request.logprobs else None,
                              "top_logprobs": [] if request.top_logprobs else None}
    for ids, handle in zip(prompt_ids, handles):
        engine_request = handle.request
        generated = list(engine_request.generated) if engine_request is not None else []
        tokens = ids + generated
        result["tokens"].append(tokens)
        result["segments"].append([backend.detokenize([token]) for token in tokens])
        pad = max(len(ids) - 1, 0)
        if request.logprobs:
            result["logprobs"].append([0.0] * pad + list(engine_request.logprobs[:len(generated)]))
        if request.top_logprobs:
            result["top_logprobs"].append([None] * pad + list(engine_request.top_logprobs[:len(generated)]))
    return result


def serve_on_engine(handler: Any, request: GenerationRequest, options: CompletionOptions) -> None:
    """Answer a completion or chat request from the engine: whole, or streamed as the text becomes
    final, each chunk with the log-probs of the tokens whose text it completes (those left, e.g. of a
    character split over tokens, come with the choice's last chunk; with echo the stream is sent once
    generated, as the lock-step server does). A client that goes away, or whose stream cannot be
    written, has its requests cancelled."""
    from megatron.inference.server import completion_answer, stream_chunks, usage
    from megatron.inference.server_chat import chat_chunk, chat_chunks, chat_completion, chat_logprobs

    backend = handler.server.backend
    chat = options.chat
    fields = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
              "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
              "model": options.model}
    incremental = options.stream and not options.echo
    sent = [""] * len(request.prompts)
    covered = [0] * len(request.prompts)  # tokens whose log-probs were sent
    started: List[bool] = []

    def start() -> bool:
        if not started:
            handler.start_stream()
            started.append(True)
            if chat:  # the assistant's role first, as OpenAI's stream
                return all(handler.write_event({**chat_chunk(i, {"role": "assistant", "content": ""}), **fields})
                           for i in range(len(request.prompts)))
        return True

    def logprobs_of(index: int, tokens: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """The chunk's logprobs of `tokens` (a choice's _segments / _logprobs / _top_logprobs slice)."""
        if options.logprobs is None or tokens.get("_logprobs") is None or not tokens["_segments"]:
            return None
        if chat:
            return chat_logprobs(tokens, options)
        offsets = [covered_text[index] + len("".join(tokens["_segments"][:i])) for i in range(len(tokens["_segments"]))]
        return {"tokens": tokens["_segments"], "token_logprobs": tokens["_logprobs"],
                "top_logprobs": tokens["_top_logprobs"] if options.logprobs > 0 else None,
                "text_offset": offsets}

    covered_text = [0] * len(request.prompts)  # characters of the tokens whose log-probs were sent

    def send_logprobs(index: int, tokens: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        logprobs = logprobs_of(index, tokens)
        covered[index] += len(tokens["_segments"])
        covered_text[index] += sum(len(segment) for segment in tokens["_segments"])
        return logprobs

    def on_piece(index: int, text: str, tokens: Dict[str, Any]) -> bool:
        sent[index] += text
        logprobs = send_logprobs(index, tokens)
        payload = chat_chunk(index, {"content": text}, logprobs=logprobs) if chat else event(index, text)
        if not chat and logprobs is not None:
            payload["choices"][0]["logprobs"] = logprobs
        return start() and handler.write_event({**payload, **fields})

    gone = (lambda: client_gone(handler.connection))
    choices = run_choices(backend, request, options, on_piece=on_piece if incremental else None, gone=gone)
    if choices is None:
        handler.close_connection = True
        return
    counts = usage(backend, options, choices)
    if not options.stream:
        answer = (chat_completion(choices, options, fields["id"], fields["created"], counts) if chat
                  else completion_answer(choices, options, fields["id"], fields["created"], counts))
        handler._send_json(HTTPStatus.OK, answer)
        return
    if not start():
        return
    if incremental:
        chunks = []
        for choice in choices:
            index, final = choice["index"], choice["text"]
            rest = final[len(sent[index]):] if final.startswith(sent[index]) else ""
            left = {key: choice[key][covered[index]:] if choice.get(key) is not None else None
                    for key in ("_segments", "_logprobs", "_top_logprobs")}  # the tokens not yet covered
            logprobs = send_logprobs(index, left)
            if rest or logprobs is not None:
                payload = chat_chunk(index, {"content": rest}, logprobs=logprobs) if chat else event(index, rest)
                if not chat and logprobs is not None:
                    payload["choices"][0]["logprobs"] = logprobs
                chunks.append(payload)
            chunks.append(chat_chunk(index, {}, choice["finish_reason"]) if chat
                          else event(index, "", choice["finish_reason"]))
    else:
        chunks = list(chat_chunks(choices, options) if chat else stream_chunks(choices, options))
    for chunk in chunks:
        if chat and not incremental and chunk["choices"][0]["delta"].get("role"):
            continue  # start() sent the roles
        if not handler.write_event({**chunk, **fields}):
            return
    if options.include_usage:
        handler.write_event({**fields, "choices": [], "usage": counts})
    handler.end_stream()
