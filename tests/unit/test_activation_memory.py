"""Activation-memory accounting on one process: the byte counter, the bool-mask dropout, and one
bf16 layer without parallelism (and with selective / full recompute) against Korthikanti et al. 2022.

Shape s = 128, b = 2, h = 512, a = 8 (hn = 64, ffn = 4h), dropout 0.1, bf16: 5as/h = 10, so the
attention's s^2 terms are a fifth of the layer, as in the paper's regime. The TP cases run on 2 and
4 ranks in tests/parallel/test_activation_memory_parallel.py. The Llama-style layer (RMSNorm, SwiGLU
ffn 1344, 1 / 2 / 8 key/value groups, RoPE, no biases) matches llama_activation_bytes to the byte.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.model.activation_memory import (
    llama_activation_bytes,
    llama_ffn_hidden_size,
    measure_layer_activation_bytes,
    paper_activation_bytes,
    saved_tensor_bytes,
)
from megatron.model.layers import Dropout

S, B, H, A = 128, 2, 512, 8
SBH = S * B * H
NORM_STATISTICS = 2 * 2 * S * B * 4  # 2 layer norms x (mean, 1/std) x [s, b] x 4 bytes (fp32 statistics)


def test_saved_bytes_count_each_storage_once_and_skip_excluded_tensors():
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 24, requires_grad=True)

    def fn(x):
        q, k, v = x.split(8, dim=-1)  # three views of x's storage
        return ((q @ weight) + k * v).sum()  # saves q, weight, k and v

    records = []
    assert saved_tensor_bytes(fn, x, exclude=[weight], records=records) == x.numel() * 4
    assert records == [((4, 8), torch.float32, x.numel() * 4)]  # q stands for the whole storage of x
    assert saved_tensor_bytes(fn, x) == (x.numel() + weight.numel()) * 4


def test_a_released_saved_storage_does_not_hide_a_later_one_at_its_address():
    """A node's saved storage freed during fn (its output dropped) and a later saved storage that the
    allocator puts at the same address are two storages: the count must not depend on the reuse."""
    x = torch.randn(256, requires_grad=True)

    def fn():
        for _ in range(8):
            h = x + 1  # a new storage, saved by sin; dropping y and h frees it
            y = h.sin()
            del y, h

    assert saved_tensor_bytes(fn, exclude=[x]) == 8 * 256 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_matches_torch_bit_for_bit_and_keeps_a_one_byte_mask(dtype):
    x = torch.randn(32, 48, dtype=dtype, requires_grad=True)
    grad = torch.randn(32, 48, dtype=dtype)
    results = []
    for dropout in (torch.nn.Dropout(0.1), Dropout(0.1)):
        x.grad = None
        torch.manual_seed(3)
        out = dropout(x)
        out.backward(grad)
        results.append((out, x.grad.clone(), torch.get_rng_state()))
    assert all(torch.equal(a, b) for a, b in zip(*results))  # same masks, outputs, gradients, generator
    assert saved_tensor_bytes(Dropout(0.1), x) == x.numel()  # bool
    assert saved_tensor_bytes(lambda t: F.dropout(t, 0.1), x) == x.numel() * x.element_size()  # torch on CPU


def test_paper_formulas():
    assert paper_activation_bytes(S, B, H, A) == SBH * (34 + 5 * A * S / H) == SBH * 44
    assert paper_activation_bytes(S, B, H, A, 4) == SBH * (10 + 6 + 2.5)
    assert paper_activation_bytes(S, B, H, A, 4, sequence_parallel=True) == SBH * (34 / 4 + 2.5)
    assert paper_activation_bytes(S, B, H, A, 4, recompute="selective") == SBH * 16
    assert paper_activation_bytes(S, B, H, A, 4, sequence_parallel=True, recompute="selective") == SBH * 8.5
    assert paper_activation_bytes(S, B, H, A, 4, recompute="full") == 2 * SBH
    assert paper_activation_bytes(S, B, H, A, 4, recompute="full", distribute_saved_activations=True) == SBH / 2


@pytest.mark.parametrize("recompute, extra", [(None, NORM_STATISTICS), ("selective", NORM_STATISTICS), ("full", 0)])
def test_one_layer_without_parallelism_matches_the_paper(recompute, extra):
    state = torch.get_rng_state()
    measured = measure_layer_activation_bytes(S, B, H, A, dtype=torch.bfloat16, recompute=recompute)
    assert torch.equal(torch.get_rng_state(), state)  # the measurement uses its own seed
    paper = paper_activation_bytes(S, B, H, A, recompute=recompute)
    assert abs(measured - paper) <= 0.10 * paper
    assert measured - paper == extra  # the only term the paper leaves out: the norms' mean and 1/std


def test_recompute_modes_order_the_memory():
    none, selective, full = (measure_layer_activation_bytes(S // 2, B, H // 2, A // 2, recompute=mode)
                             for mode in (None, "selective", "full"))
    assert full < selective < none
    assert none - selective == 5 * (A // 2) * (S // 2) ** 2 * B  # softmax, its dropout mask and output


def test_llama_formula_term_by_term():
    f, hn = llama_ffn_hidden_size(H), H // A
    assert f == 1344  # int(4h x 2/3 / 64) x 64
    # 18 sbh (norm inputs, QKV/fc1 inputs, q, repeated k and v, projection input, masks) + 8 sbf (SwiGLU)
    # + 5 a s^2 b (softmax, its mask and output) + 8 sb (two RMSNorms' fp32 1/rms) + 16 s hn (cos, sin)
    no_recompute = 18 * SBH + 8 * S * B * f + 5 * A * S * S * B + 8 * S * B + 16 * S * hn
    assert llama_activation_bytes(S, B, H, A, 2, fused=False) == no_recompute == 6_555_648
    # the fusions (the defaults): no cos/sin, and bias_swiglu keeps its input only (not silu(gate))
    assert llama_activation_bytes(S, B, H, A, 2) == no_recompute - 16 * S * hn - 2 * S * B * f
    # MHA (g = a): v stays a view of the QKV output [s, b, 3h] (6 sbh) instead of a 2 sbh copy
    assert llama_activation_bytes(S, B, H, A, A, fused=False) == no_recompute + 4 * SBH
    # selective: q, compact k (g heads) and the QKV output replace q, k, v and the s^2 terms
    selective = no_recompute - 6 * SBH - 5 * A * S * S * B + 2 * SBH + 2 * S * B * 2 * hn + 2 * S * B * (A + 4) * hn
    assert llama_activation_bytes(S, B, H, A, 2, recompute="selective", fused=False) == selective == 5_179_392
    assert llama_activation_bytes(S, B, H, A, 2, 4, recompute="full") == 2 * SBH


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("groups", [1, 2, A], ids=["mqa", "gqa", "mha"])
@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_llama_layer_matches_its_formula_to_the_byte(groups, recompute, fused):
    measured = measure_layer_activation_bytes(S, B, H, A, dtype=torch.bfloat16, recompute=recompute,
                                              llama_query_groups=groups, llama_fused=fused)
    assert measured == llama_activation_bytes(S, B, H, A, groups, recompute=recompute, fused=fused)
