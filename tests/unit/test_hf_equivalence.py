"""GPTModel equals HuggingFace transformers' models after megatron.convert.huggingface's mapping.

Tiny random models (2 layers, h 64, vocab 128, s 32) in fp32 eval mode with HF's eager attention:
logits within 1e-4, the loss on labels, and every gradient (mapped back to HF names with
state_dict_to_hf's rules) within 1e-4 of the largest. Norm weights and biases are perturbed so
that a mix-up between them shows; the init std is 0.1 so that attention is far from uniform and
a RoPE difference (Llama 3.1 scaling) moves the logits well past the tolerance. Each model runs
with the default (fused) config flags and with the plain path. ALiBi, which HF's Llama family
does not have, is checked against a forward written out here.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron.convert.huggingface import config_from_hf, rope_parameters, state_dict_from_hf, state_dict_to_hf
from megatron.model import GPTModel, TransformerConfig
from megatron.model.positions import alibi_slopes
from tests.helpers.hf_models import (BATCH, FFN, FUSED, HEADS, HIDDEN, LAYERS, SEQ, STD, UNFUSED, VOCAB, gpt2,
                                     llama_family, make_hf, make_ours)

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

FLAGS = pytest.mark.parametrize("flags", [FUSED, UNFUSED], ids=["fused", "unfused"])


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one intra-op thread


def llama3_rope(theta: float = 10000.0):
    return dict(rope_parameters=dict(LLAMA3_ROPE, rope_theta=theta), max_position_embeddings=16384)


def gpt_neox(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, max_position_embeddings=64, rotary_pct=0.25, use_parallel_residual=False,
                  hidden_dropout=0.0, attention_dropout=0.0, initializer_range=STD, bos_token_id=0, eos_token_id=1)
    return transformers.GPTNeoXConfig(**{**kwargs, **overrides})


HF_CONFIGS = {
    "llama-gqa": lambda: llama_family("llama"),
    "llama-mqa": lambda: llama_family("llama", num_key_value_heads=1),
    "llama-tied": lambda: llama_family("llama", tie_word_embeddings=True),
    "llama-rope-scaling": lambda: llama_family("llama", **llama3_rope()),
    "llama-biases": lambda: llama_family("llama", attention_bias=True, mlp_bias=True),
    "mistral": lambda: llama_family("mistral", sliding_window=SEQ),
    "mistral-head-dim-8": lambda: llama_family("mistral", head_dim=8, sliding_window=None),  # kv_channels != h / np
    "qwen2": lambda: llama_family("qwen2"),
    "gpt-neox": gpt_neox,
    "gpt2": gpt2,
    "gpt2-untied-erf-gelu": lambda: gpt2(tie_word_embeddings=False, activation_function="gelu"),
}


def batch(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ)


def assert_equivalent(hf, ours) -> float:
    """Logits, loss and all gradients agree; returns the max abs logit difference."""
    tokens, positions = batch()
    expected = hf(input_ids=tokens, labels=tokens)  # HF shifts: the mean over the first s - 1 positions
    logits = ours(tokens, positions)
    diff = (logits - expected.logits).abs().max().item()
    assert diff < 1e-4, diff

    losses = ours(tokens, positions, labels=torch.roll(tokens, -1, dims=1))  # [b, s]; the last column unused
    loss = losses[:, :-1].mean()
    torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=0)
    loss.backward()
    expected.loss.backward()
    grads = state_dict_to_hf({name: p.grad for name, p in ours.named_parameters()}, hf.config)
    for name, param in hf.named_parameters():
        scale = param.grad.abs().max().item()
        assert scale > 0, name
        assert (grads[name] - param.grad).abs().max().item() <= 1e-4 * scale, name
    return diff


@FLAGS
@pytest.mark.parametrize("name", ["llama-gqa", "llama-mqa", "llama-tied", "llama-biases", "mistral",
                                  "mistral-head-dim-8", "qwen2", "gpt-neox", "gpt2", "gpt2-untied-erf-gelu"])
def test_logits_loss_and_grads_match_hf(name, flags):
    hf = make_hf(HF_CONFIGS[name]())
    assert_equivalent(hf, make_ours(hf, flags))


@FLAGS
def test_llama31_rope_scaling_matches_hf_and_changes_the_logits(flags):
    scaled = make_hf(HF_CONFIGS["llama-rope-scaling"]())
    plain = make_hf(llama_family("llama"))  # the same weights (same seed), plain RoPE
    ours = make_ours(scaled, flags)
    assert ours.rotary_pos_emb is not None and config_from_hf(scaled.config)[1]["rope_scaling"]
    assert_equivalent(scaled, ours)
    tokens, positions = batch()
    with torch.no_grad():
        change = (scaled(input_ids=tokens).logits - plain(input_ids=tokens).logits).abs().max().item()
        ours_plain = make_ours(plain, flags)(tokens, positions)
    assert change > 1e-3  # ten times the tolerance: a missing scaling would fail the comparison above
    assert (ours_plain - plain(input_ids=tokens).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_state_dict_round_trip_is_exact(name):
    hf = make_hf(HF_CONFIGS[name]())
    original = hf.state_dict()
    back = state_dict_to_hf(state_dict_from_hf(original, hf.config), hf.config)
    assert back.keys() == original.keys()
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def test_gpt_neox_old_head_name_is_accepted():
    hf = make_hf(gpt_neox())
    old = {("embed_out.weight" if k == "lm_head.weight" else k): t for k, t in hf.state_dict().items()}
    assert torch.equal(state_dict_from_hf(old, hf.config)["output_layer.weight"], hf.lm_head.weight)


def test_config_mapping():
    config, model = config_from_hf(llama_family("qwen2", tie_word_embeddings=True))
    assert (config["add_qkv_bias"], config["add_bias_linear"], config["num_query_groups"]) == (True, False, 2)
    assert model["share_embeddings_and_output_weights"] and model["position_embedding_type"] == "rope"
    config, model = config_from_hf(gpt_neox())
    assert model["rotary_percent"] == 0.25
    assert config["bias_gelu_fusion"] is False and config["activation_func"] is F.gelu
    config, model = config_from_hf(gpt2())
    assert config["openai_gelu"] and "bias_gelu_fusion" not in config  # the fused tanh GeLU is GPT-2's
    assert model["position_embedding_type"] == "learned_absolute" and model["max_sequence_length"] == 64
    _, model = config_from_hf(llama_family("llama", **llama3_rope(theta=500000.0)))
    assert (model["rope_scaling"], model["rope_scaling_factor"], model["rotary_base"]) == (True, 8.0, 500000.0)


def test_transformers4_config_attributes():
    # transformers 4 kept RoPE settings in separate attributes (no rope_parameters).
    neox = SimpleNamespace(model_type="gpt_neox", rotary_pct=0.25, rotary_emb_base=20000.0)
    assert rope_parameters(neox) == {"rope_theta": 20000.0, "partial_rotary_factor": 0.25, "rope_type": "default"}
    llama = SimpleNamespace(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", num_hidden_layers=2,
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5,
        attention_dropout=0.0, initializer_range=0.02, vocab_size=VOCAB, max_position_embeddings=131072,
        tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={k: v for k, v in LLAMA3_ROPE.items()})
    _, model = config_from_hf(llama)
    assert (model["rope_scaling"], model["rope_scaling_factor"], model["rotary_base"]) == (True, 8.0, 500000.0)


@pytest.mark.parametrize("hf_config, message", [
    (lambda: llama_family("llama", rope_parameters=dict(LLAMA3_ROPE, rope_theta=1e4, high_freq_factor=2.0),
                          max_position_embeddings=16384), "high_freq_factor"),
    (lambda: llama_family("llama", rope_parameters=dict(LLAMA3_ROPE, rope_theta=1e4,
                                                        original_max_position_embeddings=4096)),
     "original_max_position_embeddings"),
    (lambda: llama_family("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "'linear' is not supported"),
    (lambda: llama_family("qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                    "partial_rotary_factor": 0.5}), "partial_rotary_factor 0.5"),
    (lambda: llama_family("llama", attention_bias=True), "mlp_bias=False"),
    (lambda: llama_family("mistral", sliding_window=SEQ - 1), "sliding_window=31"),
    (lambda: gpt_neox(use_parallel_residual=True), "use_parallel_residual=True"),
    (lambda: gpt2(activation_function="relu"), "'relu' is not supported"),
], ids=["llama3-constants", "llama3-original-length", "linear-rope", "llama-partial-rotary", "o-bias-without-mlp-bias",
        "sliding-window", "neox-parallel-residual", "relu"])
def test_refuses_what_it_cannot_convert(hf_config, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf_config(), seq_length=SEQ)


# ---------------------------------------------------------------- ALiBi against a written-out forward


def test_alibi_slopes_are_the_papers():
    assert alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]  # 1/2, 1/4, ..., 1/256
    # Not a power of two: the 4-head slopes, then every other slope of the 8-head sequence.
    assert alibi_slopes(6).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]


def alibi_reference_forward(sd: dict, tokens: torch.Tensor, heads: int, slopes: list[float]) -> torch.Tensor:
    """One pre-LN GPT layer with ALiBi, tied output: softmax(q k^T / sqrt(hn) - slope (i - j), causal) v."""
    b, s = tokens.shape
    h = sd["embedding.word_embeddings.weight"].shape[1]
    hn, p = h // heads, "decoder.layers.0."

    def norm(x, name):
        return F.layer_norm(x, (h,), sd[name + ".weight"], sd[name + ".bias"], eps=1e-5)

    def linear(x, name):
        return x @ sd[name + ".weight"].t() + sd[name + ".bias"]

    x = sd["embedding.word_embeddings.weight"][tokens]  # [b, s, h]
    qkv = linear(norm(x, p + "input_layernorm"), p + "self_attention.linear_qkv")
    q, k, v = qkv.view(b, s, heads, 3, hn).unbind(dim=3)  # rows [np, 3, hn]: each [b, s, np, hn]
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(hn)
    distance = torch.arange(s)[:, None] - torch.arange(s)[None, :]  # i - j
    scores = scores - torch.tensor(slopes)[:, None, None] * distance
    scores = scores.masked_fill(distance < 0, float("-inf"))
    context = torch.einsum("bnqk,bknd->bqnd", scores.softmax(-1), v).reshape(b, s, h)
    x = x + linear(context, p + "self_attention.linear_proj")
    hidden = F.gelu(linear(norm(x, p + "pre_mlp_layernorm"), p + "mlp.linear_fc1"), approximate="tanh")
    x = x + linear(hidden, p + "mlp.linear_fc2")
    return norm(x, "decoder.final_layernorm") @ sd["embedding.word_embeddings.weight"].t()


@FLAGS
def test_alibi_matches_a_written_out_forward(flags):
    heads = 6
    torch.manual_seed(0)
    config = TransformerConfig(**{**flags, **dict(num_layers=1, hidden_size=48, num_attention_heads=heads,
                                                  ffn_hidden_size=96, openai_gelu=True, hidden_dropout=0.0,
                                                  attention_dropout=0.0, init_method_std=0.3)})
    model = GPTModel(config, VOCAB, SEQ, position_embedding_type="alibi").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".bias", "layernorm.weight")):
                param.add_(0.1 * torch.randn_like(param))
    slopes = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    assert model.alibi.slopes.tolist() == slopes
    tokens, positions = batch()
    with torch.no_grad():
        logits = model(tokens, positions)
        expected = alibi_reference_forward(model.state_dict(), tokens, heads, slopes)
    assert (logits - expected).abs().max().item() < 1e-4
