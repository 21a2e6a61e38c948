"""Activation bytes of one bf16 transformer layer on each tensor-parallel rank against Korthikanti et
al. 2022's formulas: TP, TP + SP, TP + selective recompute, TP + SP + selective, and full recompute
(with and without distributed saved inputs), at t = 2 and t = 4.

Shape: s = 128, b = 2, h = 512, a = 8 (hn = 64, ffn = 4h): a, s and h divide by t, dropout is on
(0.1), the parameters and activations are bf16 -- the formulas' assumptions. Every rank measures
its own layer (megatron/model/activation_memory.py); the TP ranks must agree with each other.
The measured bytes exceed the formula by exactly the layer norms' saved mean and 1/std (bf16 on
CPU: 2 norms x 2 x s b / (t with SP) x 2 bytes); docs/memory.md goes term by term.
The Llama-style layer (RMSNorm, SwiGLU, G = 2 key/value groups, RoPE, no biases) matches
llama_activation_bytes exactly, byte for byte.
"""

import pytest
import torch

from megatron.model.activation_memory import (
    llama_activation_bytes,
    measure_layer_activation_bytes,
    paper_activation_bytes,
)
from tests.parallel.harness import init_parallel

S, B, H, A = 128, 2, 512, 8
G = 2  # the Llama-style layer's key/value groups: 1 per rank at t = 2, replicated on 2 ranks at t = 4
LLAMA_CASES = ("tp", "tp-sp", "tp-selective")

CASES = {  # name: (sequence_parallel, recompute, distribute_saved_activations)
    "tp": (False, None, False),
    "tp-sp": (True, None, False),
    "tp-selective": (False, "selective", False),
    "tp-sp-selective": (True, "selective", False),
    "tp-full": (False, "full", False),
    "tp-sp-full": (True, "full", False),
    "tp-full-distributed": (False, "full", True),
}


def _measure_all(tp: int) -> dict:
    init_parallel(tp=tp)
    measured = {name: measure_layer_activation_bytes(S, B, H, A, dtype=torch.bfloat16, sequence_parallel=sp,
                                                     recompute=recompute, distribute_saved_activations=distribute)
                for name, (sp, recompute, distribute) in CASES.items()}
    for name in LLAMA_CASES:
        sp, recompute, distribute = CASES[name]
        measured["llama-" + name] = measure_layer_activation_bytes(
            S, B, H, A, dtype=torch.bfloat16, sequence_parallel=sp, recompute=recompute,
            distribute_saved_activations=distribute, llama_query_groups=G)
    return measured


@pytest.fixture(scope="module", params=[2, 4], ids=["t2", "t4"])
def measured(request, dist_pool):
    return request.param, dist_pool.run(_measure_all, request.param)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_measured_bytes_match_the_paper(measured, case):
    t, per_rank = measured
    sp, recompute, distribute = CASES[case]
    paper = paper_activation_bytes(S, B, H, A, t, sequence_parallel=sp, recompute=recompute,
                                   distribute_saved_activations=distribute)
    values = {result[case] for result in per_rank}
    assert len(values) == 1, per_rank  # every rank saves the same amount
    (bytes_,) = values
    assert abs(bytes_ - paper) <= 0.10 * paper, (bytes_, paper)
    norm_statistics = 0 if recompute == "full" else 2 * 2 * (S // t if sp else S) * B * 4  # fp32 statistics
    assert bytes_ - paper == norm_statistics, (bytes_, paper)


@pytest.mark.parametrize("case", LLAMA_CASES, ids=LLAMA_CASES)
def test_llama_layer_bytes_are_the_formulas_to_the_byte(measured, case):
    t, per_rank = measured
    sp, recompute, distribute = CASES[case]
    values = {result["llama-" + case] for result in per_rank}
    assert len(values) == 1, per_rank
    assert values == {llama_activation_bytes(S, B, H, A, G, t, sequence_parallel=sp, recompute=recompute,
                                             distribute_saved_activations=distribute)}
