"""Text generation under model parallelism gives the serial model's tokens and log-probs: TP = 2
(heads split over the ranks, the vocab-parallel logits gathered), PP = 2 (one layer per stage,
each stage's own KV cache, the last stage choosing and broadcasting the tokens) and TP = 2 x PP = 2.

Each task builds a tiny random HuggingFace model (the same seed on every rank), maps it into ours
(megatron.convert.huggingface), runs greedy generation serially (TP = 1) and then on a TP = 2
model whose parameters are the serial ones' shards (tensor_parallel.layout.shard_for_rank; a stage
takes its layers), with a batch of prompts of different lengths, with and without the KV cache, and
seeded top-k sampling, api.score's log-probs and api.beam_search's beams and scores. The world has 4 ranks (TP = 2 or PP = 2 alone: two replicas side by side).
"""

import pytest
import torch

from megatron.core import parallel_state
from megatron.inference.api import beam_search, score
from megatron.inference.generation import generate_tokens
from megatron.model import GPTModel
from megatron.training.tokenizer.null_tokenizer import NullTokenizer
from tests.helpers.hf_models import VOCAB, gpt2, llama_family, make_hf, make_sharded
from tests.parallel.harness import init_parallel

transformers = pytest.importorskip("transformers")

LENGTHS = (5, 9, 7)
NEW = 8
MODELS = {"gpt2": gpt2, "llama-gqa": lambda: llama_family("llama"),
          "llama-mqa": lambda: llama_family("llama", num_key_value_heads=1)}


def _build(hf, tp: int, pp: int = 1) -> GPTModel:
    """Our model of this rank's stage and TP shard, its parameters cut from the whole mapped state dict."""
    return make_sharded(hf, tp, pp, seq_length=32)


def _generate(model: GPTModel) -> dict:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (len(LENGTHS), max(LENGTHS)), generator=generator)
    lengths = torch.tensor(LENGTHS)
    runs = {}
    for cache in (True, False):
        out = generate_tokens(model, tokens, lengths, NEW, top_k=1, return_output_log_probs=True, use_cache=cache)
        runs[f"greedy-cache={cache}"] = (out.tokens, out.output_log_probs)
    out = generate_tokens(model, tokens, lengths, NEW, top_k=4, temperature=0.9, random_seed=11, top_logprobs=3)
    runs["sampled"] = (out.tokens, None)
    runs["top-logprobs"] = (out.top_log_probs[1], out.top_log_probs[0].clamp(min=-1e4))  # ids; -inf in the prompt
    scored = score(model, NullTokenizer(VOCAB - 1), ["3 1 4 1 5 9", "2 6"])
    runs["score"] = (torch.tensor(scored["tokens"][0]), torch.tensor(scored["logprobs"][0]))
    beams = beam_search(model, NullTokenizer(VOCAB - 1), ["3 1 4 1 5"], 6, 3, num_return_gen=3)
    runs["beam"] = (torch.tensor(list("|".join(beams["text"]).encode())), torch.tensor(beams["scores"]))
    return runs


def _serial_and_parallel(name: str, layouts: list) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = make_hf(MODELS[name]())
        init_parallel(tp=1)
        results = {"serial": _generate(_build(hf, 1))}
        for tp, pp in layouts:
            parallel_state.destroy_model_parallel()
            init_parallel(tp=tp, pp=pp)
            results[f"tp{tp}-pp{pp}"] = _generate(_build(hf, tp, pp))
    finally:
        torch.set_num_threads(threads)
    return results


@pytest.mark.parametrize("name", list(MODELS))
def test_parallel_generation_equals_serial(dist_pool, name):
    layouts = [(2, 1), (1, 2), (2, 2)]
    for rank, result in enumerate(dist_pool.run(_serial_and_parallel, name, layouts)):
        assert len(result) == 1 + len(layouts)
        for layout in [f"tp{tp}-pp{pp}" for tp, pp in layouts]:
            for run, (tokens, log_probs) in result[layout].items():
                expected_tokens, expected_log_probs = result["serial"][run]
                assert torch.equal(tokens, expected_tokens), (rank, layout, run)
                if log_probs is not None:  # every stage returns the last stage's log-probs
                    torch.testing.assert_close(log_probs, expected_log_probs, rtol=0, atol=1e-4)
