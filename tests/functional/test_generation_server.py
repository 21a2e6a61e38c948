"""The text generation server (megatron/inference/server.py) and its CLI, in-process.

The server runs in a thread on port 0 with ReversingTestBackend, a test double that computes
its answer from the prompt (the prompt's characters reversed, cycled), so every answer can be
checked against the request that asked for it.
"""

import http.client
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron.inference.server import GenerationBackend, GenerationServer
from megatron.inference.server_requests import GenerationRequest, Limits
from tests.helpers.server_cases import MALFORMED

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ReversingTestBackend(GenerationBackend):
    """Test double: one token per character; generates the prompt's characters in reverse, cycled.

    Records every request and fails if two generations ever overlap (the server's lock).
    """

    def __init__(self):
        self.requests, self.active, self.overlapped = [], 0, False
        self._count_lock = threading.Lock()

    def tokenize(self, text):
        return [ord(char) for char in text]

    def detokenize(self, ids):
        return "".join("" if i == 0 else chr(i) for i in ids)

    def generate(self, request: GenerationRequest):
        with self._count_lock:
            self.active += 1
            self.overlapped |= self.active > 1
        time.sleep(0.002)  # long enough for overlapping calls to be seen
        try:
            self.requests.append(request)
            result = {"text": [], "segments": [], "tokens": [], "logprobs": [] if request.logprobs else None}
            for prompt in request.prompts:
                ids = ([0] if request.add_BOS else []) + self.tokenize(prompt)
                reverse = self.tokenize(prompt[::-1])
                new = [reverse[i % len(reverse)] for i in range(request.tokens_to_generate)] if reverse else []
                if request.stop_token in new:
                    new = new[:new.index(request.stop_token) + 1]
                tokens = ids + new
                result["tokens"].append(tokens)
                result["segments"].append(["<bos>" if t == 0 else chr(t) for t in tokens])
                result["text"].append(prompt + "".join(chr(t) for t in new))
                if request.logprobs:
                    result["logprobs"].append([-(i + 1) / 100 for i in range(len(tokens) - 1)])
            return result
        finally:
            with self._count_lock:
                self.active -= 1


@pytest.fixture(scope="module")
def served():
    backend = ReversingTestBackend()
    server = GenerationServer(backend, port=0, limits=Limits(max_body_bytes=4096, max_prompts=8,
                                                            max_tokens_to_generate=100),
                              log_requests=False).start()
    yield server, backend
    server.stop()


def call(server, method, path, body=None, raw=None, headers=None):
    """(status, parsed JSON or text) of one request."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    if response.getheader("Content-Type") == "application/json":
        return response.status, json.loads(text)
    return response.status, text


def test_api_documented_request(served):
    server, _ = served
    status, body = call(server, "PUT", "/api", {"prompts": ["Hello world"], "tokens_to_generate": 3})
    assert status == 200
    assert body["text"] == ["Hello worlddlr"]
    assert body["tokens"] == [[ord(c) for c in "Hello worlddlr"]]
    assert body["segments"] == [list("Hello worlddlr")]
    assert body["logprobs"] is None


def test_api_fields_reach_the_backend(served):
    server, backend = served
    status, body = call(server, "PUT", "/api", {
        "prompts": ["ab", "xyz"], "tokens_to_generate": 2, "logprobs": True, "temperature": 0.5, "top_p": 0.9,
        "top_p_decay": 0.5, "top_p_bound": 0.2, "random_seed": 7, "no_log": True, "stop_on_eol": True})
    assert status == 200, body
    assert body["text"] == ["abba", "xyzzy"]
    assert [len(lp) for lp in body["logprobs"]] == [3, 4]
    request = backend.requests[-1]
    assert (request.prompts, request.temperature, request.top_p, request.top_p_decay, request.top_p_bound,
            request.random_seed, request.stop_on_eol, request.top_k) == (("ab", "xyz"), 0.5, 0.9, 0.5, 0.2, 7,
                                                                          True, 0)


def test_api_beam_and_empty_prompt_with_bos(served):
    server, backend = served
    status, body = call(server, "PUT", "/api", {"prompts": ["q"], "tokens_to_generate": 1, "beam_width": 2,
                                                "length_penalty": 0.5, "stop_token": 5})
    assert status == 200 and backend.requests[-1].beam_width == 2 and backend.requests[-1].length_penalty == 0.5
    status, body = call(server, "PUT", "/api", {"prompts": [""], "tokens_to_generate": 0, "logprobs": True,
                                                "add_BOS": True})
    assert status == 200 and body["tokens"] == [[0]]


def test_completions_documented_request(served):
    server, backend = served
    status, body = call(server, "POST", "/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 4,
                                                            "temperature": 0})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"text": "cbac", "index": 0, "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert backend.requests[-1].top_k == 1  # temperature 0: greedy


def test_completions_list_n_stop_logprobs(served):
    server, _ = served
    status, body = call(server, "POST", "/completions", {"prompt": ["ab", "xyz"], "max_tokens": 5, "n": 2,
                                                         "stop": ["x"], "logprobs": 1})
    assert status == 200, body
    texts = [(choice["index"], choice["text"], choice["finish_reason"]) for choice in body["choices"]]
    assert texts == [(0, "babab", "length"), (1, "babab", "length"), (2, "zy", "stop"), (3, "zy", "stop")]
    assert body["choices"][0]["logprobs"]["tokens"] == list("babab")
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [-0.02, -0.03, -0.04, -0.05, -0.06]
    assert body["choices"][2]["logprobs"]["token_logprobs"] == [-0.03, -0.04]


def test_completions_stream(served):
    server, _ = served
    status, text = call(server, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 3, "stream": True})
    assert status == 200
    events = [line[len("data: "):] for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "cba"
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, None, None, "length"]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)


class ByteStreamingBackend(GenerationBackend):
    """Test double for incremental streaming: one token per UTF-8 byte (0 ends a row); every prompt
    continues with ANSWER's bytes, handed to on_step one per step. With `hold` set, steps after the
    first wait until the test sets `release`."""

    streams = True
    ANSWER = "héllo wörld € done"

    def __init__(self):
        self.hold, self.release, self.finished = False, threading.Event(), threading.Event()

    def tokenize(self, text):
        return list(text.encode("utf-8"))

    def detokenize(self, ids):
        return bytes(i for i in ids if i != 0).decode("utf-8", errors="replace")

    def stop_ids(self, request):
        return (0,)

    def generate(self, request, on_step=None):
        self.finished.clear()
        rows = [self.tokenize(prompt) for prompt in request.prompts]
        start = max(len(row) for row in rows)
        answer = self.tokenize(self.ANSWER)[:request.tokens_to_generate]
        for index, byte in enumerate(answer):
            if on_step is not None:
                if self.hold and index == 1:
                    assert self.release.wait(20), "the test never read the first chunk"
                on_step(start + index, torch.tensor([byte] * len(rows)))
        tokens = [row + answer for row in rows]
        self.finished.set()
        return {"text": [self.detokenize(row) for row in tokens], "tokens": tokens, "logprobs": None,
                "segments": [[self.detokenize([t]) for t in row] for row in tokens]}


@pytest.fixture
def byte_server():
    backend = ByteStreamingBackend()
    server = GenerationServer(backend, port=0, log_requests=False).start()
    yield server, backend
    backend.release.set()
    server.stop()


def _stream_texts(text):
    events = [line[len("data: "):] for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    return [chunk["text"] for chunk in chunks], [chunk["finish_reason"] for chunk in chunks]


def test_stream_is_incremental_and_equals_the_whole_answer(byte_server):
    server, backend = byte_server
    backend.hold = True
    body = {"prompt": "Say:", "max_tokens": 12, "stream": True}
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    first = response.fp.readline()  # the first event, sent while the engine waits in its second step
    assert first.startswith(b"data: ") and json.loads(first[6:])["choices"][0]["text"] == "h"
    assert not backend.finished.is_set()
    backend.release.set()
    rest = response.read().decode()
    connection.close()
    pieces, finishes = _stream_texts(first.decode() + rest)
    backend.hold = False
    status, whole = call(server, "POST", "/v1/completions", {"prompt": "Say:", "max_tokens": 12})
    assert status == 200 and whole["choices"][0]["text"] == "héllo wörl"  # 12 bytes
    assert "".join(pieces) == whole["choices"][0]["text"]
    assert all("\ufffd" not in piece for piece in pieces)  # "é", "ö": two bytes, sent once whole
    assert pieces[:3] == ["h", "é", "l"] and finishes[-1] == "length" and finishes[:-1] == [None] * (len(finishes) - 1)


def test_stream_stops_before_a_stop_string(byte_server):
    server, _ = byte_server
    for stop, expected in (["wör"], "héllo "), (["€", "xyz"], "héllo wörld "):
        request = {"prompt": "a", "max_tokens": 30, "stop": stop, "n": 2}
        status, text = call(server, "POST", "/v1/completions", {**request, "stream": True})
        assert status == 200
        events = [json.loads(line[6:])["choices"][0] for line in text.split("\n\n") if line and line != "data: [DONE]"]
        status, whole = call(server, "POST", "/v1/completions", request)
        for index in (0, 1):
            streamed = "".join(event["text"] for event in events if event["index"] == index)
            assert streamed == whole["choices"][index]["text"] == expected
            assert [event["finish_reason"] for event in events if event["index"] == index][-1] == "stop"




@pytest.mark.parametrize("name,method,path,body,status,field", MALFORMED, ids=[case[0] for case in MALFORMED])
def test_malformed_request_is_refused_naming_the_field(served, name, method, path, body, status, field):
    server, _ = served
    raw = body if isinstance(body, bytes) else None
    got_status, answer = call(server, method, path, body=None if raw else body, raw=raw)
    assert got_status == status, answer
    assert answer["error"]["field"] == field
    assert answer["error"]["message"]
    # ... and the server still answers a good request
    assert call(server, "PUT", "/api", {"prompts": ["ok"], "tokens_to_generate": 1})[1]["text"] == ["okk"]


def test_missing_content_length_and_405_allow_header(served):
    server, _ = served
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.putrequest("PUT", "/api")
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 411 and json.loads(response.read())["error"]["field"] == "body"
    connection.close()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("GET", "/api")
    response = connection.getresponse()
    assert response.status == 405 and response.getheader("Allow") == "PUT"
    connection.close()


def test_50_concurrent_requests_get_their_own_answers(served):
    server, backend = served
    prompts = [f"p{i:02d}q" for i in range(50)]

    def ask(prompt):
        if int(prompt[1:3]) % 2:
            return call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 4})[1]["choices"][0]["text"]
        return call(server, "PUT", "/api", {"prompts": [prompt], "tokens_to_generate": 4})[1]["text"][0][len(prompt):]

    with ThreadPoolExecutor(max_workers=50) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == [prompt[::-1] for prompt in prompts]
    assert not backend.overlapped


def test_binds_localhost_by_default():
    server = GenerationServer(ReversingTestBackend(), port=0, log_requests=False)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()


def test_cli_talks_to_the_server(served):
    server, _ = served
    stdin = "Hello\n3\nabc\nnot a number\nxy\n2\n"
    result = subprocess.run([sys.executable, os.path.join(REPO, "tools", "text_generation_cli.py"),
                             f"127.0.0.1:{server.port}"], input=stdin, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr
    assert "Megatron Response: \nHellooll\n" in result.stdout
    assert "tokens to generate must be a non-negative integer, got 'not a number'" in result.stdout
    assert "Megatron Response: \nxyyx\n" in result.stdout


def test_cli_bad_address():
    result = subprocess.run([sys.executable, os.path.join(REPO, "tools", "text_generation_cli.py"), "nohost"],
                            input="", capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 1
    assert result.stderr.strip() == "text_generation_cli.py: error: the address must be HOST:PORT, got 'nohost'"


TINY_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
              "--max-position-embeddings", "64", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]
SERVER_SCRIPT = os.path.join(REPO, "tools", "run_text_generation_server.py")


@pytest.mark.parametrize("flags,message", [
    (["--load", "/nonexistent", "--port", "70000"], "--port must be between 0 and 65535, got 70000"),
    ([], "a checkpoint is required: --load CKPT or --load-hf HF_DIR"),
    (["--load", "/nonexistent", "--chat-template", "nosuch"], "--chat-template nosuch: not a named format (chatml, llama2-chat) nor a file"),
], ids=["port", "no-checkpoint", "chat-template"])
def test_server_tool_bad_flags_are_one_line(flags, message):
    _assert_tool_error(flags, message)


def test_server_tool_taken_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        _assert_tool_error(["--load", "/nonexistent", "--port", str(port)],
                           f"--host 127.0.0.1 --port {port}: cannot listen there: Address already in use")


def _assert_tool_error(flags, message):
    result = subprocess.run([sys.executable, SERVER_SCRIPT, *TINY_MODEL, *flags], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"run_text_generation_server.py: error: {message}"


def _put(port, body):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("PUT", "/api", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    return response.status, answer


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serving_port(server: subprocess.Popen) -> int:
    """The port a launched server prints in its '{"serving": "HOST:PORT"}' line (within 120 s)."""
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()
    seen, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        seen.append(line)
        if line.startswith('{"serving"'):
            return int(json.loads(line)["serving"].rsplit(":", 1)[1])
    raise AssertionError("the server did not start:\n" + "".join(seen[-20:]))


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def test_end_to_end_two_ranks_serve_a_trained_checkpoint(tmp_path):
    """torchrun, 2 ranks at TP=2: rank 0 serves, rank 1 follows each broadcast request into the
    same generation (its collectives line up, or the request would hang)."""
    env = {**os.environ, "PYTHONPATH": REPO}
    train = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                            str(_free_port()), os.path.join(REPO, "pretrain_gpt.py"), *TINY_MODEL,
                            "--tensor-model-parallel-size", "2", "--micro-batch-size",
                            "2", "--global-batch-size", "2", "--lr", "1e-3", "--mock-data", "--num-workers", "0",
                            "--eval-iters", "0", "--train-iters", "1", "--save", str(tmp_path / "ckpt"),
                            "--save-interval", "1", "--ckpt-format", "torch"], capture_output=True, text=True,
                           timeout=300, env=env, cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-2000:]
    server = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-port", str(_free_port()), SERVER_SCRIPT, "--tensor-model-parallel-size", "2", *TINY_MODEL, "--load", str(tmp_path / "ckpt"),
                               "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=tmp_path)
    try:
        port = _serving_port(server)
        request = {"prompts": ["1 2 3", "7"], "tokens_to_generate": 4, "top_k": 1, "logprobs": True}
        status, first = _put(port, request)
        assert status == 200, first
        # Megatron's rule: every row runs to the longest prompt + tokens_to_generate
        assert [len(tokens) for tokens in first["tokens"]] == [3 + 4, 3 + 4]
        assert [len(logprobs) for logprobs in first["logprobs"]] == [6, 6]
        assert first["text"][0].startswith("1 2 3") and first["text"][1].startswith("7")
        assert _put(port, {"prompts": ["1"], "top_k": 2, "top_p": 0.5})[0] == 400  # refused on rank 0 only
        assert _put(port, request) == (200, first)  # greedy: the same answer, rank 1 still in step
        status, beams = _put(port, {"prompts": ["1 2"], "tokens_to_generate": 2, "beam_width": 2})
        assert status == 200 and len(beams["text"]) == len(beams["scores"]) == 2, beams
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        connection.request("POST", "/v1/completions", body=json.dumps({"prompt": ["1 2 3", "7"], "max_tokens": 4,
                                                                      "temperature": 0}))
        completion = json.loads(connection.getresponse().read())
        connection.close()
        assert "choices" in completion, completion
        assert [choice["text"] for choice in completion["choices"]] == [
            first["text"][0][len("1 2 3"):], " ".join(first["text"][1].split()[:5])[len("7"):]]
        assert completion["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}
    finally:
        _stop(server)


def test_serves_a_huggingface_directory_with_its_greedy_answer(tmp_path, gpt2_vocab_dir):
    """--load-hf HF_DIR: the architecture from config.json, the weights converted on load, the
    tokenizer from the directory's tokenizer.json; /api's greedy answer equals HF generate's."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     activation_function="gelu_new", bos_token_id=50256, eos_token_id=50256)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir)
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(str(gpt2_vocab_dir))
    tokenizer.save_pretrained(hf_dir)
    prompt = "In the beginning God created"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf.generate(ids, do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=50256)[0]

    env = {**os.environ, "PYTHONPATH": REPO}
    server = subprocess.Popen([sys.executable, SERVER_SCRIPT, "--load-hf", str(hf_dir), "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    try:
        port = _serving_port(server)
        status, answer = _put(port, {"prompts": [prompt], "tokens_to_generate": 6, "top_k": 1})
        assert status == 200, answer
        assert answer["tokens"][0] == expected.tolist()
        assert answer["text"][0] == tokenizer.decode(expected)
    finally:
        _stop(server)
