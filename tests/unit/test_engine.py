"""The serving engine (megatron/inference/engine.py, kv_cache.py) on tiny random HF models.

In-flight batching must not change an answer: 32 concurrent greedy requests of different prompt
and answer lengths (with chunked prefill) give each request's tokens served alone and HF generate's;
seeded sampling gives each request its own draws whatever runs beside it; the block pool never
hands out more than its blocks and requests beyond it wait; the prefix cache shares blocks.
"""

from __future__ import annotations

import pytest
import torch

from megatron.inference.engine import DynamicEngine, EngineConfig, RequestRejected, SamplingParams
from tests.helpers.hf_models import FUSED, VOCAB, gpt2, llama_family, make_hf, make_ours

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MODELS = {"gpt2": gpt2, "llama-gqa": lambda: llama_family("llama")}


@pytest.fixture(scope="module", params=list(MODELS))
def models(request):
    hf = make_hf(MODELS[request.param]())
    return hf, make_ours(hf, FUSED)


def _engine(model, **overrides) -> DynamicEngine:
    settings = dict(block_size=4, num_blocks=400, max_requests=32, max_tokens=48, max_sequence_length=64)
    return DynamicEngine(model, EngineConfig(**{**settings, **overrides}))


def _prompts(lengths, seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _hf_greedy(hf, prompt: list, new: int):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                      min_new_tokens=new, eos_token_id=None, pad_token_id=0, output_logits=True,
                      return_dict_in_generate=True)
    generated = out.sequences[0, len(prompt):]
    log_probs = torch.stack(out.logits, dim=1)[0].log_softmax(-1).gather(1, generated[:, None])[:, 0]
    return generated.tolist(), log_probs


def test_32_concurrent_greedy_requests_equal_each_alone_and_hf_generate(models):
    hf, ours = models
    lengths = [1 + (7 * i) % 40 for i in range(32)]  # 1 .. 40 tokens
    news = [4 + (5 * i) % 13 for i in range(32)]  # 4 .. 16 tokens
    prompts = _prompts(lengths)
    params = [SamplingParams(max_tokens=n, top_k=1, logprobs=True) for n in news]
    engine = _engine(ours, max_tokens=100)  # packed steps longer than gpt2's 64 positions; prompts chunked
    together = engine.generate(prompts, params)
    assert engine.stats()["blocks_in_use"] == 0  # every finished request gave its blocks back
    assert engine.steps < sum(news)  # the requests shared steps
    whole_prompts = _engine(ours, chunked_prefill=False, max_tokens=40).generate(prompts, params)  # no chunks
    assert [r.generated for r in whole_prompts] == [r.generated for r in together]
    for prompt, param, request in zip(prompts, params, together):
        alone = _engine(ours).generate([prompt], param)[0]
        expected, expected_log_probs = _hf_greedy(hf, prompt, param.max_tokens)
        assert request.finish_reason == "length"
        assert request.generated == alone.generated == expected, len(prompt)
        torch.testing.assert_close(torch.tensor(request.logprobs), expected_log_probs, rtol=0, atol=1e-4)


def test_seeded_sampling_is_reproducible_per_request_and_stop_tokens_end_it(models):
    _, ours = models
    prompts = _prompts([3, 11, 6, 20, 9, 14], seed=1)
    params = [SamplingParams(max_tokens=10, temperature=0.8, top_k=8 if i % 2 else 0, top_p=0.0 if i % 2 else 0.9,
                             seed=100 + i, top_logprobs=3) for i in range(len(prompts))]
    together = _engine(ours, max_requests=6, max_tokens=12).generate(prompts, params)
    for prompt, param, request in zip(prompts, params, together):
        alone = _engine(ours).generate([prompt], param)[0]
        assert request.generated == alone.generated
        assert [ids for ids, _ in request.top_logprobs[0]] == [ids for ids, _ in alone.top_logprobs[0]]
        assert len(request.top_logprobs[0]) == 3
    other_seeds = [SamplingParams(**{**vars(p), "seed": p.seed + 50}) for p in params]
    redrawn = _engine(ours).generate(prompts, other_seeds)
    assert [r.generated for r in redrawn] != [r.generated for r in together]
    # A stop token ends the request at its first occurrence, included.
    first = together[0].generated
    stop = SamplingParams(**{**vars(params[0]), "stop_token_ids": (first[2],)})
    stopped = _engine(ours).generate([prompts[0]], stop)[0]
    assert stopped.finish_reason == "stop" and stopped.generated == first[:first.index(first[2]) + 1]


def test_kv_budget_is_never_exceeded_and_requests_beyond_it_wait(models):
    hf, ours = models
    prompts = _prompts([5, 9, 2, 12, 7, 3, 10, 6], seed=2)
    params = SamplingParams(max_tokens=6, top_k=1)
    engine = _engine(ours, num_blocks=10)  # each request needs 2 - 5 blocks of 4
    requests = [engine.add_request(p, params) for p in prompts]
    waited = False
    while engine.has_work():
        engine.step()
        held = [b for r in engine.running for b in r.blocks]
        assert len(held) == len(set(held)) == engine.pool.in_use() <= 10  # no block twice, none beyond the pool
        waited |= bool(engine.waiting and engine.running)
    assert waited and engine.stats()["max_blocks_in_use"] <= 10
    assert engine.context.key_value_memory_dict[1][0].shape[1] == 10 * 4  # one slot per block token, no more
    for prompt, request in zip(prompts, requests):
        assert request.generated == _engine(ours).generate([prompt], params)[0].generated
    with pytest.raises(RequestRejected) as over_budget:
        engine.add_request(list(range(30)), SamplingParams(max_tokens=20))  # 50 tokens: 13 blocks
    assert over_budget.value.status == 503
    with pytest.raises(RequestRejected) as too_long:
        engine.add_request(list(range(60)), SamplingParams(max_tokens=10))
    assert too_long.value.status == 413
    queue = _engine(ours, max_queue=2)
    queue.add_request([1, 2], params), queue.add_request([3], params)
    with pytest.raises(RequestRejected) as full:
        queue.add_request([4], params)
    assert full.value.status == 429
    # A cancelled request leaves at once and its blocks return to the pool.
    running = queue.waiting[0]
    queue.step()
    assert queue.pool.in_use() > 0
    for request in list(queue.running) + list(queue.waiting):
        queue.cancel(request.request_id)
    assert running.finish_reason == "cancelled" and queue.pool.in_use() == 0 and not queue.has_work()


def test_blocks_are_taken_as_requests_grow_and_the_youngest_is_preempted_when_none_is_left(models):
    _, ours = models
    prompts = _prompts([6, 3, 9, 5, 2, 7], seed=5)
    params = [SamplingParams(max_tokens=14, top_k=1)] * 3 + \
        [SamplingParams(max_tokens=14, temperature=0.9, top_k=6, seed=7 + i) for i in range(3)]
    alone = [_engine(ours).generate([p], q)[0].generated for p, q in zip(prompts, params)]

    def serve(**overrides):
        engine = _engine(ours, num_blocks=12, prefix_caching=True, **overrides)  # 12 blocks of 4: 48 slots
        requests = [engine.add_request(p, q) for p, q in zip(prompts, params)]
        most_running = 0
        while engine.has_work():
            engine.step()
            held = [b for r in engine.running for b in r.blocks]
            assert len(held) == len(set(held)) == engine.pool.in_use() <= 12
            most_running = max(most_running, len(engine.running))
        assert [r.generated for r in requests] == alone  # recomputed prefills change no answer, no draw
        assert engine.pool.in_use() == 0
        return engine, requests, most_running

    # On demand: all six start (their prompts need 1 - 3 blocks), and growing to 20 - 23 tokens
    # (5 - 6 blocks each) preempts the youngest, which are prefilled again later.
    engine, requests, most_running = serve()
    assert most_running == 6 and engine.stats()["preemptions"] > 0
    assert any(r.preempted for r in requests) and not requests[0].preempted  # the oldest is never the victim
    # reserve_whole: each request holds the blocks of prompt + max_tokens from the start: two at a time.
    whole, whole_requests, whole_running = serve(reserve_whole=True)
    assert whole_running == 2 and whole.stats()["preemptions"] == 0
    assert engine.steps < whole.steps


def test_a_request_is_not_admitted_into_the_blocks_a_running_one_grows_into(models):
    _, ours = models
    first, second = _prompts([4, 4], seed=8)
    params = SamplingParams(max_tokens=3, top_k=1)
    engine = _engine(ours, num_blocks=2)  # blocks of 4: the first request's prompt fills one
    a = engine.add_request(first, params)
    engine.step()  # a's prefill and first token: its next token starts its second block
    b = engine.add_request(second, params)
    engine.step()  # one free block, which a grows into: b waits instead of being admitted and preempted
    assert b in engine.waiting and len(a.blocks) == 2 and engine.stats()["preemptions"] == 0
    while engine.has_work():
        engine.step()
    assert [a.generated, b.generated] == [_engine(ours).generate([p], params)[0].generated for p in (first, second)]


def test_an_alibi_model_answers_as_generate_tokens_does():
    """ALiBi (no HF counterpart among the test models): each request's bias over its own positions, in
    the decoders' group and in prefill chunks, gives each prompt's generate_tokens answer."""
    from megatron.inference.generation import generate_tokens
    from megatron.model import GPTModel, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="alibi").eval()
    prompts = _prompts([3, 17, 9, 26, 1, 12], seed=6)
    params = SamplingParams(max_tokens=8, top_k=1)
    served = _engine(model, max_requests=6, max_tokens=20).generate(prompts, params)  # 26, 17: chunked
    for prompt, request in zip(prompts, served):
        alone = generate_tokens(model, torch.tensor([prompt]), torch.tensor([len(prompt)]), 8, top_k=1)
        assert request.generated == alone.tokens[0, len(prompt):].tolist(), len(prompt)


def test_prefix_cache_shares_a_common_prompt_prefix(models):
    _, ours = models
    prefix = _prompts([16], seed=3)[0]  # 4 full blocks of 4
    prompts = [prefix + tail for tail in _prompts([3, 5, 1, 7], seed=4)]
    params = SamplingParams(max_tokens=5, top_k=1)
    plain = _engine(ours).generate(prompts, params)
    cached = _engine(ours, prefix_caching=True, eviction_policy="lru")
    first = cached.generate(prompts[:1], params)[0]
    assert cached.stats()["prefix_hits"] == 0
    rest = cached.generate(prompts[1:], params)
    stats = cached.stats()
    assert stats["prefix_hits"] == 4 * 3 and stats["prefix_lookups"] == sum((len(p) - 1) // 4 for p in prompts)
    assert all(r.cached_tokens == 16 for r in rest)
    assert [r.generated for r in [first, *rest]] == [r.generated for r in plain]
    # ref_zero (Megatron's default) frees a block with its last user: a later request finds nothing,
    # while requests running at the same time share it (reference counted).
    ref_zero = _engine(ours, prefix_caching=True)
    ref_zero.generate(prompts[:1], params)
    a = ref_zero.add_request(prompts[1], params)
    ref_zero.step()  # a's prompt is in the cache and a still runs
    b = ref_zero.add_request(prompts[2], params)
    ref_zero.step()
    assert a.cached_tokens == 0 and b.cached_tokens == 16 and a.blocks[:4] == b.blocks[:4]
    assert all(ref_zero.pool.refcount[block] == 2 for block in a.blocks[:4])
    while ref_zero.has_work():
        ref_zero.step()
    assert ref_zero.pool.in_use() == 0 and not ref_zero.pool.cached
    assert b.generated == plain[2].generated
