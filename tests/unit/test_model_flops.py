"""megatron/training/training_log.py num_floating_point_operations: Megatron-LM core_v0.13's count, checked
against numbers worked out by hand, GEMM by GEMM, for a GPT and a Llama-style layer."""

import pytest

from megatron.training.training_log import num_floating_point_operations
from tests.helpers.args import run_args as Namespace


def gemm_by_gemm(*, s, layers, h, heads, groups, d, f, vocab, gated, batch):
    """Multiply-adds per token of each GEMM, x 2 FLOPs, x 3 (forward, data and weight gradients)."""
    qkv = h * (heads * d + 2 * groups * d)    # [h] -> [a d] queries, [g d] keys and [g d] values
    scores = heads * d * s / 2               # q k^T over the causal half of the s x s matrix
    values = heads * d * s / 2               # probabilities x v, the same half
    out = heads * d * h                      # [a d] -> [h]
    mlp = h * f * (2 if gated else 1) + f * h  # up (and gate), down
    logits = h * vocab                       # once, whether the output layer is tied or not
    per_token = layers * (qkv + scores + values + out + mlp) + logits
    return 6 * per_token * s * batch


GPT = dict(seq_length=32, num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16,
           ffn_hidden_size=256, padded_vocab_size=128, group_query_attention=False, num_query_groups=1,
           swiglu=False, untie_embeddings_and_output_weights=False)
# GQA (8 heads, 2 groups), kv channels 16 != h / heads = 8, SwiGLU, untied output layer.
LLAMA = dict(GPT, num_attention_heads=8, group_query_attention=True, num_query_groups=2, ffn_hidden_size=96,
             swiglu=True, untie_embeddings_and_output_weights=True)


def test_gpt_count():
    # per token: layer 12288 qkv + 1024 + 1024 + 4096 out + 32768 mlp = 51200; x 2 layers + 8192 logits = 110592
    assert num_floating_point_operations(Namespace(**GPT), batch_size=2) == 6 * 110592 * 32 * 2 == 42_467_328
    assert 42_467_328 == gemm_by_gemm(s=32, layers=2, h=64, heads=4, groups=4, d=16, f=256, vocab=128,
                                      gated=False, batch=2)
    # the closed form 72 B s L h^2 (1 + s/12h + V/12Lh)
    closed = 72 * 2 * 32 * 2 * 64 ** 2 * (1 + 32 / (12 * 64) + 128 / (12 * 2 * 64))
    assert num_floating_point_operations(Namespace(**GPT), 2) == pytest.approx(closed, rel=1e-12)


def test_llama_count():
    # per token: layer 12288 qkv + 2048 + 2048 + 8192 out + 18432 mlp = 43008; x 2 + 8192 logits = 94208
    assert num_floating_point_operations(Namespace(**LLAMA), batch_size=2) == 6 * 94208 * 32 * 2 == 36_175_872
    assert 36_175_872 == gemm_by_gemm(s=32, layers=2, h=64, heads=8, groups=2, d=16, f=96, vocab=128,
                                      gated=True, batch=2)


def test_query_groups_count_only_with_group_query_attention():
    # Megatron: --num-query-groups without --group-query-attention is ignored (one group per head)
    no_gqa = Namespace(**dict(LLAMA, group_query_attention=False))
    assert num_floating_point_operations(no_gqa, 1) == gemm_by_gemm(s=32, layers=2, h=64, heads=8, groups=8, d=16,
                                                                   f=96, vocab=128, gated=True, batch=1)


def test_tied_and_untied_output_layers_count_the_same():
    tied = Namespace(**dict(LLAMA, untie_embeddings_and_output_weights=False))
    assert num_floating_point_operations(tied, 3) == num_floating_point_operations(Namespace(**LLAMA), 3)
