"""Text generation under tensor parallelism: TP = 2 (heads split over the ranks, the vocab-parallel
logits gathered) gives the serial model's tokens and log-probs.

Each task builds a tiny random HuggingFace model (the same seed on every rank), maps it into ours
(megatron.convert.huggingface), runs greedy generation serially (TP = 1) and then on a TP = 2
model whose parameters are the serial ones' shards (tensor_parallel.layout.shard_for_rank), with a
batch of prompts of different lengths, with and without the KV cache. The world has 4 ranks: two
TP = 2 groups run the same thing side by side.
"""

import pytest
import torch

from megatron.convert.huggingface import config_from_hf, state_dict_from_hf
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layout import shard_for_rank
from megatron.inference.generation import generate_tokens
from megatron.model import GPTModel, TransformerConfig
from tests.parallel.harness import init_parallel
from tests.unit.test_hf_equivalence import VOCAB, gpt2, llama_family, make_hf

transformers = pytest.importorskip("transformers")

LENGTHS = (5, 9, 7)
NEW = 8
MODELS = {"gpt2": gpt2, "llama-gqa": lambda: llama_family("llama"),
          "llama-mqa": lambda: llama_family("llama", num_key_value_heads=1)}


def _build(hf, tp: int) -> GPTModel:
    config_kwargs, model_kwargs = config_from_hf(hf.config, seq_length=32)
    model = GPTModel(TransformerConfig(**config_kwargs, tensor_model_parallel_size=tp), **model_kwargs).eval()
    full = state_dict_from_hf(hf.state_dict(), hf.config)
    rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard_for_rank(full[name], param, tp, rank))
    return model


def _generate(model: GPTModel) -> dict:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (len(LENGTHS), max(LENGTHS)), generator=generator)
    lengths = torch.tensor(LENGTHS)
    runs = {}
    for cache in (True, False):
        out = generate_tokens(model, tokens, lengths, NEW, top_k=1, return_output_log_probs=True, use_cache=cache)
        runs[f"greedy-cache={cache}"] = (out.tokens, out.output_log_probs)
    out = generate_tokens(model, tokens, lengths, NEW, top_k=4, temperature=0.9, random_seed=11)
    runs["sampled"] = (out.tokens, None)
    return runs


def _serial_and_tp2(name: str) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = make_hf(MODELS[name]())
        init_parallel(tp=1)
        serial = _generate(_build(hf, 1))
        parallel_state.destroy_model_parallel()
        init_parallel(tp=2)
        parallel = _generate(_build(hf, 2))
    finally:
        torch.set_num_threads(threads)
    return {"serial": serial, "tp2": parallel}


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_generation_equals_serial(dist_pool, name):
    for rank, result in enumerate(dist_pool.run(_serial_and_tp2, name)):
        for run, (tokens, log_probs) in result["tp2"].items():
            expected_tokens, expected_log_probs = result["serial"][run]
            assert torch.equal(tokens, expected_tokens), (rank, run)
            if log_probs is not None:
                torch.testing.assert_close(log_probs, expected_log_probs, rtol=0, atol=1e-4)
