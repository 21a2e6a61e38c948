"""Serving speed: the inference engine's server vs the one-at-a-time server vs HF generate on static batches.

    python bench/serving.py                              # 1, 8, 32, 64 clients; a GPT-2-style model, fp32
    python bench/serving.py --clients 32 --json

One random GPT-2-style model (bench/generation.py's build_models: the same weights in HF and in
ours) and a NullTokenizer (prompts are space-separated token ids, so no vocabulary files). For
each number of concurrent clients C, the same mixed workload (2 C requests, at least 16; prompt
lengths uniform in --prompt-lengths, answer lengths in --answer-lengths, greedy) goes to:

* engine: POST /v1/completions with stream: true on the engine's server (megatron/inference/
  server_engine.py: in-flight batching over the paged KV cache, chunked prefill);
* one-at-a-time: the same requests on the lock-step server (server.ApiBackend, generate_tokens
  per request under the generation lock: the path before the engine);
* HF static: transformers' generate on the requests in arrival order, in static batches of C
  (left-padded; each batch runs to its longest answer), no HTTP.

The clients are C threads of a child process (each sending its next request when the previous
one ended), so their work does not compete with the server's threads for its interpreter lock. Printed per case: requests/s, generated tokens/s (each request's own answer
tokens), time to first token (TTFT, from sending to the first streamed token) and per-token latency
(the mean gap between a request's later tokens), p50 and p99. Then a prefix-caching run: C
clients whose prompts share a --shared-prefix-token prefix, the engine with and without
--inference-dynamic-batching-prefix-caching: the cache's hit rate and TTFT. Compare figures
within one run only (a shared machine's load changes between runs).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def workload(count: int, prompt_lengths: Tuple[int, int], answer_lengths: Tuple[int, int], vocab: int,
             seed: int = 0, prefix: List[int] | None = None) -> List[Tuple[List[int], int]]:
    """(prompt ids, answer length) per request."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_lengths))]
        requests.append(((prefix or []) + prompt, rng.randint(*answer_lengths)))
    return requests


def percentile(values: List[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _stream_request(port: int, prompt: List[int], max_tokens: int) -> Tuple[float, List[float]]:
    """(send time, arrival time of each streamed token) of one streamed completion."""
    body = json.dumps({"prompt": " ".join(map(str, prompt)), "max_tokens": max_tokens, "temperature": 0,
                       "stream": True})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the server answered {response.status}: {response.read()[:300]!r}")
    arrivals = []
    for line in response:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        now = time.perf_counter()
        text = json.loads(line[6:])["choices"][0]["text"]
        arrivals.extend([now] * len(text.split()))  # NullTokenizer: one id per word
    connection.close()
    return start, arrivals


def run_clients(port: int, requests: List[Tuple[List[int], int]], clients: int) -> Dict[str, float]:
    """run_clients_here in a child process (the clients' Python work must not compete with the
    server's threads for this process's interpreter lock, as real clients would not)."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"port": port, "requests": requests, "clients": clients}, handle)
    try:
        child = subprocess.run([sys.executable, os.path.abspath(__file__), "--client-run", handle.name],
                               capture_output=True, text=True, timeout=7200)
    finally:
        os.unlink(handle.name)
    if child.returncode != 0:
        raise RuntimeError(f"the client process failed: {child.stderr[-2000:]}")
    lines = child.stdout.strip().splitlines()
    for line in lines[:-1]:
        print(line, flush=True)
    return json.loads(lines[-1])


def run_clients_here(port: int, requests: List[Tuple[List[int], int]], clients: int) -> Dict[str, float]:
    """Closed loop: `clients` threads take the next request when theirs ended; the figures."""
    pending = list(reversed(requests))
    lock = threading.Lock()
    records: List[Tuple[float, List[float]]] = []
    errors: List[str] = []

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                prompt, answer = pending.pop()
            try:
                record = _stream_request(port, prompt, answer)
            except Exception as error:  # noqa: BLE001 - reported below, the bench goes on
                errors.append(f"{type(error).__name__}: {error}")
                continue
            with lock:
                records.append(record)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if errors:
        print(f"  {len(errors)} requests failed, e.g. {errors[0]}", flush=True)
    ttft = [arrivals[0] - sent for sent, arrivals in records if arrivals]
    per_token = [(arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) for _, arrivals in records if len(arrivals) > 1]
    tokens = sum(len(arrivals) for _, arrivals in records)
    return {"requests_per_s": len(records) / elapsed, "tokens_per_s": tokens / elapsed, "seconds": elapsed,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "per_token_p50_ms": 1e3 * percentile(per_token, 50), "per_token_p99_ms": 1e3 * percentile(per_token, 99)}


@torch.no_grad()
def hf_static(hf, requests: List[Tuple[List[int], int]], batch: int) -> Dict[str, float]:
    """HF generate over static batches of `batch` requests (left-padded, to each batch's longest answer)."""
    start, tokens = time.perf_counter(), 0
    for first in range(0, len(requests), batch):
        group = requests[first:first + batch]
        width = max(len(prompt) for prompt, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(group):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        new = max(answer for _, answer in group)
        hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    pad_token_id=0, eos_token_id=None)
        tokens += sum(answer for _, answer in group)
    elapsed = time.perf_counter() - start
    return {"requests_per_s": len(requests) / elapsed, "tokens_per_s": tokens / elapsed, "seconds": elapsed}


def _serve(backend: Any, chat_template: Any = None):
    from megatron.inference.server import GenerationServer
    from megatron.inference.server_requests import Limits

    limits = Limits(max_prompts=128, max_tokens_to_generate=4096, max_body_bytes=1 << 22)
    return GenerationServer(backend, port=0, limits=limits, log_requests=False, chat_template=chat_template).start()


def engine_server(ours, tokenizer, options, prefix_caching: bool = False):
    from megatron.inference.engine import DynamicEngine, EngineConfig
    from megatron.inference.server_engine import EngineBackend

    config = EngineConfig(block_size=options.block_size, max_requests=options.max_requests,
                          max_tokens=options.max_tokens, max_sequence_length=options.positions,
                          chunked_prefill=True, prefix_caching=prefix_caching, eviction_policy="lru",
                          buffer_size_gb=options.buffer_size_gb)
    backend = EngineBackend(DynamicEngine(ours, config), tokenizer)
    return _serve(backend), backend


def _line(name: str, r: Dict[str, float]) -> str:
    text = f"  {name:14s} {r['requests_per_s']:7.2f} req/s {r['tokens_per_s']:8.1f} tok/s"
    if "ttft_p50_ms" in r:
        text += (f"  TTFT p50 {r['ttft_p50_ms']:7.0f} ms p99 {r['ttft_p99_ms']:7.0f} ms"
                 f"  per-token p50 {r['per_token_p50_ms']:6.1f} ms p99 {r['per_token_p99_ms']:6.1f} ms")
    return text


def main(argv: List[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client-run"]:  # the child process of run_clients
        with open(argv[1]) as handle:
            job = json.load(handle)
        print(json.dumps(run_clients_here(job["port"], [tuple(r) for r in job["requests"]], job["clients"])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--clients", type=str, default="1,8,32,64")
    parser.add_argument("--prompt-lengths", type=str, default="16,256", help="min,max prompt tokens")
    parser.add_argument("--answer-lengths", type=str, default="16,128", help="min,max answer tokens")
    parser.add_argument("--shared-prefix", type=int, default=384, help="prefix-caching run: shared prompt tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--buffer-size-gb", type=float, default=2.0)
    parser.add_argument("--skip-one-at-a-time", action="store_true")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    from bench.generation import build_models
    from megatron.inference.server import ApiBackend
    from megatron.training.tokenizer.null_tokenizer import NullTokenizer

    prompt_lengths = tuple(int(x) for x in options.prompt_lengths.split(","))
    answer_lengths = tuple(int(x) for x in options.answer_lengths.split(","))
    options.positions = max(prompt_lengths[1] + answer_lengths[1], options.shared_prefix + 64 + 32)
    hf, ours = build_models(options.hidden_size, options.num_layers, options.num_attention_heads,
                            options.vocab_size, options.positions)
    tokenizer = NullTokenizer(options.vocab_size - 1)  # ids 0 .. vocab - 2, eod vocab - 1
    say: Callable[[str], None] = (lambda text: None) if options.json else (lambda text: print(text, flush=True))
    say(f"model: h {options.hidden_size}, {options.num_layers} layers, vocab {options.vocab_size}; "
        f"torch threads {torch.get_num_threads()}; prompts {prompt_lengths}, answers {answer_lengths} tokens")
    results: Dict[str, Any] = {}
    engine, engine_backend = engine_server(ours, tokenizer, options)
    lockstep = None if options.skip_one_at_a_time else _serve(ApiBackend(ours, tokenizer))
    try:
        for clients in (int(c) for c in options.clients.split(",")):
            requests = workload(max(2 * clients, 16), prompt_lengths, answer_lengths, options.vocab_size - 1,
                                seed=clients)
            case: Dict[str, Any] = {"requests": len(requests)}
            case["engine"] = run_clients(engine.port, requests, clients)
            if lockstep is not None:
                case["one_at_a_time"] = run_clients(lockstep.port, requests, clients)
            case["hf_static"] = hf_static(hf, requests, clients)
            results[f"{clients} clients"] = case
            say(f"{clients} clients, {len(requests)} requests:")
            for name in ("engine", "one_at_a_time", "hf_static"):
                if name in case:
                    say(_line(name, case[name]))
            if "one_at_a_time" in case:
                say(f"  engine / one-at-a-time throughput: "
                    f"{case['engine']['tokens_per_s'] / case['one_at_a_time']['tokens_per_s']:.1f}x")
    finally:
        engine.stop()
        engine_backend.stop()
        if lockstep is not None:
            lockstep.stop()
    results["prefix caching"] = prefix_run(ours, tokenizer, options, say)
    if options.json:
        print(json.dumps(results, indent=2))


def prefix_run(ours, tokenizer, options, say) -> Dict[str, Any]:
    """32 clients (or the largest --clients) whose prompts share a prefix: engine with and without the cache."""
    clients = min(32, max(int(c) for c in options.clients.split(",")))
    prefix = workload(1, (options.shared_prefix, options.shared_prefix), (1, 1), options.vocab_size - 1,
                      seed=999)[0][0]
    requests = workload(2 * clients, (8, 64), (16, 32), options.vocab_size - 1, seed=1000, prefix=prefix)
    result = {}
    say(f"shared {options.shared_prefix}-token prefix, {clients} clients, {len(requests)} requests:")
    for cached in (False, True):
        server, backend = engine_server(ours, tokenizer, options, prefix_caching=cached)
        try:
            figures = run_clients(server.port, requests, clients)
            figures.update({k: v for k, v in backend.engine.stats().items() if k.startswith("prefix")})
        finally:
            server.stop()
            backend.stop()
        name = "prefix cache" if cached else "no prefix cache"
        result[name] = figures
        say(_line(name, figures) + (f"  hit rate {figures['prefix_hit_rate']:.0%}" if cached else ""))
    return result


if __name__ == "__main__":
    main()
