"""The serving engine under model parallelism gives the serial engine's answers: TP = 2 (each rank's
heads' K/V in its own paged cache, the logits gathered), PP = 2 (each stage's layers' blocks, the
packed step's [T, 1, h] activations passed stage to stage, the last stage choosing) and TP 2 x PP 2.

One task per rank: a tiny random Llama (GQA) mapped into ours, served serially and then in each
layout, with 12 concurrent requests of different prompt and answer lengths (chunked prefill, a
block pool small enough that some wait, prefix caching on): greedy tokens and their log-probs, and
seeded top-k sampling.
"""

import pytest
import torch

from megatron.core import parallel_state
from megatron.inference.engine import DynamicEngine, EngineConfig, SamplingParams
from tests.helpers.hf_models import VOCAB, llama_family, make_hf, make_sharded
from tests.parallel.harness import init_parallel

transformers = pytest.importorskip("transformers")


def _serve(model) -> dict:
    generator = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, VOCAB, (8,), generator=generator).tolist()
    prompts = [(prefix if i % 3 == 0 else []) + torch.randint(0, VOCAB, (1 + (5 * i) % 17,), generator=generator).tolist()
               for i in range(12)]
    greedy = [SamplingParams(max_tokens=2 + i % 4, top_k=1, logprobs=True) for i in range(12)]
    sampled = [SamplingParams(max_tokens=4, top_k=5, temperature=0.9, seed=7 + i) for i in range(12)]
    config = EngineConfig(block_size=4, num_blocks=40, max_requests=8, max_tokens=32, max_sequence_length=48,
                          prefix_caching=True, eviction_policy="lru")
    engine = DynamicEngine(model, config)
    runs = {"greedy": [(r.generated, r.logprobs) for r in engine.generate(prompts, greedy)]}
    runs["sampled"] = [(r.generated, None) for r in DynamicEngine(model, config).generate(prompts, sampled)]
    runs["stats"] = engine.stats()
    return runs


def _serial_and_parallel(layouts: list) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = make_hf(llama_family("llama"))
        init_parallel(tp=1)
        results = {"serial": _serve(make_sharded(hf, 1))}
        for tp, pp in layouts:
            parallel_state.destroy_model_parallel()
            init_parallel(tp=tp, pp=pp)
            results[f"tp{tp}-pp{pp}"] = _serve(make_sharded(hf, tp, pp))
    finally:
        torch.set_num_threads(threads)
    return results


def test_parallel_engine_equals_serial(dist_pool):
    layouts = [(2, 1), (1, 2), (2, 2)]
    for rank, result in enumerate(dist_pool.run(_serial_and_parallel, layouts)):
        serial = result["serial"]
        assert serial["stats"]["prefix_hits"] > 0 and serial["stats"]["max_blocks_in_use"] <= 40
        for layout in [f"tp{tp}-pp{pp}" for tp, pp in layouts]:
            for run in ("greedy", "sampled"):
                for i, ((tokens, log_probs), (expected, expected_log_probs)) in enumerate(
                        zip(result[layout][run], serial[run])):
                    assert tokens == expected, (rank, layout, run, i)
                    if log_probs is not None:  # every stage holds the last stage's log-probs
                        torch.testing.assert_close(torch.tensor(log_probs), torch.tensor(expected_log_probs),
                                                   rtol=0, atol=1e-4)
            assert result[layout]["stats"]["prefix_hits"] == serial["stats"]["prefix_hits"]
