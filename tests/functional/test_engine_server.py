"""The server on the inference engine (megatron/inference/server_engine.py), in-process, with the
official openai client: completions and chat completions, streamed and not, n > 1, stop strings,
logprobs, seeds; concurrent clients; the limits (413 / 503 / 429); a disconnected client's request
cancelled and its blocks freed; the malformed-request cases of the lock-step server and malformed
chat bodies.

The model is a tiny random GPT-2 with the real GPT-2 tokenizer in an HF folder whose
tokenizer_config.json carries a chat template; greedy answers are checked against HF generate.
"""

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron.convert.huggingface import config_from_hf, state_dict_from_hf
from megatron.inference.engine import DynamicEngine, EngineConfig
from megatron.inference.server import GenerationServer
from megatron.inference.server_chat import load_chat_template
from megatron.inference.server_engine import EngineBackend
from megatron.inference.server_requests import Limits
from megatron.model import GPTModel, TransformerConfig
from tests.helpers.server_cases import MALFORMED, MALFORMED_CHAT

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant:{% endif %}")
BLOCKS, BLOCK = 16, 8  # 128 token slots: a 141-token request is over the KV budget (503), 191 over the length (413)


@pytest.fixture(scope="module")
def served(tmp_path_factory, gpt2_vocab_dir):
    from megatron.training.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
    from tests.helpers.hf_models import gpt2_folder

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    hf, hf_tokenizer, folder = gpt2_folder(tmp_path_factory.mktemp("engine_server") / "hf", gpt2_vocab_dir, 256)
    config_file = folder / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": TEMPLATE}))
    config_kwargs, model_kwargs = config_from_hf(hf.config, seq_length=256)
    ours = GPTModel(TransformerConfig(**config_kwargs), **model_kwargs).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), hf.config))
    engine = DynamicEngine(ours, EngineConfig(block_size=BLOCK, num_blocks=BLOCKS, max_requests=8, max_tokens=64,
                                              max_sequence_length=180, prefix_caching=True, eviction_policy="lru"))
    backend = EngineBackend(engine, HuggingFaceTokenizer(str(folder)))
    server = GenerationServer(backend, port=0, limits=Limits(max_body_bytes=4096, max_prompts=8,
                                                            max_tokens_to_generate=100),
                              log_requests=False, chat_template=load_chat_template(None, str(folder))).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    yield server, backend, client, hf, transformers.AutoTokenizer.from_pretrained(str(folder))
    server.stop()
    backend.stop()
    torch.set_num_threads(threads)


def _hf_text(hf, tokenizer, prompt: str, new: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                          min_new_tokens=new, pad_token_id=50256, eos_token_id=None)[0]
    return tokenizer.decode(out)[len(prompt):]


def test_openai_client_completions(served):
    _, _, client, hf, tokenizer = served
    prompt = "The quick brown fox"
    whole = client.completions.create(model="megatron", prompt=prompt, max_tokens=8, temperature=0)
    assert whole.choices[0].text == _hf_text(hf, tokenizer, prompt, 8)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (4, 8)
    streamed = client.completions.create(model="megatron", prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.choices[0].text
    # n > 1 with a seed: three different draws, the same three again with the same seed
    drawn = [client.completions.create(model="megatron", prompt=prompt, max_tokens=6, n=3, seed=5, temperature=1.0)
             for _ in range(2)]
    texts = [[choice.text for choice in answer.choices] for answer in drawn]
    assert texts[0] == texts[1] and len(set(texts[0])) == 3
    # a stop string cuts the completion before it
    stop = whole.choices[0].text[3:6]
    cut = client.completions.create(model="megatron", prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].text == whole.choices[0].text[:whole.choices[0].text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    scored = client.completions.create(model="megatron", prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == 4
    assert all(len(top) <= 2 and max(top.values()) >= value - 1e-5
               for top, value in zip(logprobs.top_logprobs, logprobs.token_logprobs))


def test_openai_client_chat_completions(served):
    _, _, client, hf, tokenizer = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    whole = client.chat.completions.create(model="megatron", messages=messages, max_tokens=8, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == _hf_text(hf, tokenizer, prompt, 8)
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    streamed = list(client.chat.completions.create(model="megatron", messages=messages, max_tokens=8, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content
    assert streamed[-1].usage.completion_tokens == 8
    scored = client.chat.completions.create(model="megatron", messages=messages, max_tokens=5, n=2, seed=3,
                                            logprobs=True, top_logprobs=3)
    assert len(scored.choices) == 2
    for choice in scored.choices:
        assert "".join(entry.token for entry in choice.logprobs.content) == choice.message.content
        assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
    streamed_scores = client.chat.completions.create(model="megatron", messages=messages, max_tokens=5, seed=3,
                                                     logprobs=True, top_logprobs=3, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed_scores) == scored.choices[0].message.content


def test_streamed_logprobs_come_with_their_tokens_and_equal_the_whole_answers(served):
    """stream=true with logprobs streams as the text becomes final: each chunk carries the log-probs of
    the tokens its text completes, and together they are the answer's, for completions and chat."""
    _, _, client, _, _ = served
    prompt = "The quick brown fox"
    whole = client.completions.create(model="megatron", prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    chunks = [c.choices[0] for c in client.completions.create(model="megatron", prompt=prompt, max_tokens=8,
                                                              temperature=0, logprobs=2, stream=True)]
    scored = [c.logprobs for c in chunks if c.logprobs is not None]
    assert len(scored) > 1 and chunks[0].logprobs is not None  # token by token, not all at the end
    expected = whole.choices[0].logprobs
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    assert [t for lp in scored for t in lp.tokens] == expected.tokens
    assert [o for lp in scored for o in lp.text_offset] == expected.text_offset
    torch.testing.assert_close([v for lp in scored for v in lp.token_logprobs], expected.token_logprobs)
    assert [sorted(top) for lp in scored for top in lp.top_logprobs] == [sorted(top) for top in expected.top_logprobs]
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    answer = client.chat.completions.create(model="megatron", messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=2)
    pieces = list(client.chat.completions.create(model="megatron", messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    entries = [entry for c in pieces if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert sum(1 for c in pieces if c.choices and c.choices[0].logprobs) > 1
    assert [e.token for e in entries] == [e.token for e in answer.choices[0].logprobs.content]
    torch.testing.assert_close([e.logprob for e in entries], [e.logprob for e in answer.choices[0].logprobs.content])
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == answer.choices[0].message.content


def test_concurrent_clients_get_their_own_greedy_answers(served):
    _, backend, client, _, _ = served
    prompts = [f"Number {i} is" + " very" * (i % 5) for i in range(16)]

    def ask(prompt):
        return client.completions.create(model="megatron", prompt=prompt, max_tokens=6, temperature=0).choices[0].text

    alone = [ask(prompt) for prompt in prompts]
    steps = backend.engine.steps
    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone
    assert backend.engine.steps - steps < 6 * len(prompts)  # they shared steps


def _post(port, path, body):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    return response.status, answer


def test_limits_answer_413_503_429_and_a_gone_client_is_cancelled(served):
    server, backend, _, _, _ = served
    status, answer = _post(server.port, "/v1/completions", {"prompt": "x " * 90, "max_tokens": 100})
    assert status == 413 and "180" in answer["error"]["message"]
    status, answer = _post(server.port, "/v1/completions", {"prompt": "x " * 40, "max_tokens": 100})
    assert status == 503 and "KV blocks" in answer["error"]["message"]
    backend.max_queue = 0
    try:
        status, answer = _post(server.port, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 429 and "waiting" in answer["error"]["message"]
    finally:
        backend.max_queue = 1024
    for stream in (False, True):  # the client leaves mid-answer: the request is cancelled, its blocks freed
        before = backend.engine.steps
        sock = socket.create_connection(("127.0.0.1", server.port))
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 100, "temperature": 0, "stream": stream})
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.0 200")
        else:
            started = time.time() + 30  # (a bound for a broken engine, not a timing assumption)
            while backend.engine.steps == before and time.time() < started:
                time.sleep(0.01)
            assert backend.engine.steps > before, "the engine never started the request"
        sock.close()
        deadline = time.time() + 30
        while backend.engine.has_work() and time.time() < deadline:
            time.sleep(0.02)
        assert not backend.engine.has_work() and backend.engine.pool.in_use() == 0
        assert backend.engine.steps - before < 100, stream


@pytest.mark.parametrize("name,method,path,body,status,field", MALFORMED + MALFORMED_CHAT,
                         ids=[case[0] for case in MALFORMED + MALFORMED_CHAT])
def test_malformed_request_is_refused_naming_the_field(served, name, method, path, body, status, field):
    server = served[0]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    raw = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    connection.request(method, path, body=raw, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    assert response.status == status, answer
    assert answer["error"]["field"] == field and answer["error"]["message"]


def test_chat_without_a_template_says_how_to_get_one(served):
    backend = served[1]
    server = GenerationServer(backend, port=0, log_requests=False).start()
    try:
        status, answer = _post(server.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "--chat-template" in answer["error"]["message"]
    finally:
        server.stop()
