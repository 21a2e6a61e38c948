"""The Mamba-2 mixer and hybrid models (megatron/model/mamba/).

The chunked SSD scan against the per-position recurrence; a converted tiny HF Mamba2ForCausalLM
(its torch path) against our MambaModel: logits, loss and every gradient within 1e-4; a hybrid
pattern against a stack assembled by hand from the reference layers (TransformerLayer for attention
and MLP, the mixer's own MambaLayer) with the same weights.
"""

from __future__ import annotations

import pytest
import torch

from megatron.convert.huggingface import config_from_hf, state_dict_from_hf, state_dict_to_hf
from megatron.model import TransformerConfig
from megatron.model.mamba import MambaModel, allocate_layers
from megatron.model.mamba.hybrid import HybridPatternError
from megatron.fused_kernels.fused_ssd import causal_conv1d, ssd_recurrence, ssd_scan

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def scan_inputs(b=2, s=37, nh=4, hd=3, ng=2, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(b, s, nh, hd, generator=g), dt=torch.rand(b, s, nh, generator=g) * 0.5 + 0.01,
                A=-torch.rand(nh, generator=g) * 4 - 0.1, B=torch.randn(b, s, ng, n, generator=g),
                C=torch.randn(b, s, ng, n, generator=g), D=torch.randn(nh, generator=g))


@pytest.mark.parametrize("chunk_size", [1, 8, 16, 64])
def test_chunked_scan_equals_the_sequential_recurrence(chunk_size):
    inputs = scan_inputs()
    initial = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(1))
    y, final = ssd_scan(**inputs, chunk_size=chunk_size, initial_state=initial, return_final_state=True)
    y_ref, final_ref = ssd_recurrence(**inputs, initial_state=initial)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, final_ref, rtol=1e-5, atol=1e-5)
    # Two halves, the second from the first's final state, equal the whole.
    first = {k: v[:, :20] if v.dim() > 1 else v for k, v in inputs.items()}
    second = {k: v[:, 20:] if v.dim() > 1 else v for k, v in inputs.items()}
    y1, state = ssd_scan(**first, chunk_size=chunk_size, return_final_state=True)
    y2 = ssd_scan(**second, chunk_size=chunk_size, initial_state=state)
    torch.testing.assert_close(torch.cat([y1, y2], 1), ssd_scan(**inputs, chunk_size=chunk_size), rtol=1e-5, atol=1e-5)


def test_causal_conv_carries_its_state():
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(2, 6, 11, generator=g), torch.randn(6, 1, 4, generator=g), torch.randn(6, generator=g)
    whole, _ = causal_conv1d(x, w, bias)
    expected = torch.nn.functional.conv1d(x, w, bias, padding=3, groups=6)[..., :11]
    torch.testing.assert_close(whole, expected)
    out, state = causal_conv1d(x[..., :5], w, bias)
    steps = [out]
    for t in range(5, 11):
        y, state = causal_conv1d(x[..., t:t + 1], w, bias, state)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, -1), whole)


def tiny_mamba2(**overrides):
    kwargs = dict(vocab_size=96, hidden_size=32, num_heads=8, head_dim=8, expand=2, state_size=8, n_groups=2,
                  num_hidden_layers=2, chunk_size=8, tie_word_embeddings=False, initializer_range=0.1,
                  pad_token_id=0, bos_token_id=0, eos_token_id=1)
    return transformers.Mamba2Config(**{**kwargs, **overrides})


def hf_and_ours(hf_config, seed=0):
    torch.manual_seed(seed)
    hf = transformers.Mamba2ForCausalLM(hf_config).eval()
    with torch.no_grad():  # norms and D away from their constant init, so a mix-up shows
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
                p.add_(torch.randn_like(p) * 0.2)
    config_kwargs, model_kwargs = config_from_hf(hf_config, seq_length=64)
    ours = MambaModel(TransformerConfig(**config_kwargs), **model_kwargs).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), hf_config))
    return hf, ours


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_converted_hf_mamba2_gives_the_same_logits_loss_and_gradients(tied):
    hf_config = tiny_mamba2(tie_word_embeddings=tied)
    hf, ours = hf_and_ours(hf_config)
    ids = torch.randint(2, 96, (2, 21), generator=torch.Generator().manual_seed(3))  # s = 21: a partial chunk
    hf_out = hf(ids, labels=ids)
    torch.testing.assert_close(ours(ids, None), hf_out.logits, rtol=1e-4, atol=1e-4)
    loss = ours(ids[:, :-1], None, labels=ids[:, 1:]).mean()  # HF shifts the labels itself
    torch.testing.assert_close(loss, hf_out.loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    hf_out.loss.backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    our_grads = state_dict_to_hf({name: p.grad for name, p in ours.named_parameters()}, hf_config)
    for name, grad in hf_grads.items():
        scale = grad.abs().max().clamp(min=1e-3)
        torch.testing.assert_close(our_grads[name] / scale, grad / scale, rtol=0, atol=1e-4, msg=name)
    assert state_dict_to_hf(ours.state_dict(), hf_config).keys() >= {k for k in hf.state_dict() if "lm_head" not in k}


def test_allocation_matches_megatrons_and_refuses_bad_patterns():
    assert allocate_layers(4, 0.0, 0.0) == "MMMM"
    # Megatron-Core 0.13's allocate_layers gives these (checked against its code when this was written).
    assert allocate_layers(10, 0.2, 0.0) == "MMM*MM*MMM"
    assert allocate_layers(8, 0.25, 0.25) == "MM*-M*M-"
    assert allocate_layers(48, 0.1, 0.3) == "MM-MM-M*M-MM-MM*-MM-MMM-*MM-MM-M*M-MM-MM*-MM-MM-"
    assert allocate_layers(4, 0.25, 0.25, "M*-M") == "M*-M"
    assert allocate_layers(5, 0.0, 0.0, "ME*-E") == "ME*-E"  # E (MoE) layers only by the override
    for args, flag in (((4, 0.0, 0.0, "M*M"), "--hybrid-override-pattern has 3"),
                       ((4, 0.0, 0.0, "M*xM"), "'x' is not a layer symbol"),
                       ((4, 0.25, 0.25, "M*-E"), "does not have the layer counts"),  # ratios place no E
                       ((4, 0.5, 0.0, "M*MM"), "does not have the layer counts"),
                       ((4, 0.7, 0.5), "at most 1")):
        with pytest.raises(HybridPatternError, match=flag):
            allocate_layers(*args)


def hybrid_config(**overrides):
    kwargs = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, normalization="RMSNorm",
                  add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                  hidden_dropout=0.0, attention_dropout=0.0, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
                  mamba_chunk_size=8, init_method_std=0.1)
    return TransformerConfig(**{**kwargs, **overrides})


def test_hybrid_pattern_equals_a_stack_assembled_from_the_reference_layers():
    """M*-EM: our MambaModel against embedding -> HF's Mamba2Block / the attention and MLP halves of our
    Llama-spec TransformerLayer (each half through its own norm and residual) / our GPT MoE MLP (the
    layer spec's MoELayer: router, experts, dispatcher) after an RMSNorm -> final RMSNorm -> output layer,
    with the same weights, written out here. The E layer has Megatron-Core's keys and records its
    balancing loss under its layer number; the loss reaches the router's gradient."""
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Block

    from megatron.core import aux_losses
    from megatron.model.layer_specs import get_llama_layer_spec, get_moe_spec
    from megatron.model.layers import Norm
    from megatron.model.spec import build_module

    config = hybrid_config(num_layers=5, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                           moe_aux_loss_coeff=0.1)
    torch.manual_seed(0)
    model = MambaModel(config, vocab_size=64, max_sequence_length=32, hybrid_override_pattern="M*-EM",
                       share_embeddings_and_output_weights=False)  # training: the router records its loss
    assert [type(layer).__name__ for layer in model.decoder.layers] == ["MambaLayer", "TransformerLayer",
                                                                         "TransformerLayer", "TransformerLayer",
                                                                         "MambaLayer"]
    state = model.state_dict()
    e_keys = sorted(k[len("decoder.layers.3."):] for k in state if k.startswith("decoder.layers.3."))
    assert e_keys == ["mlp.experts.local_experts.0.linear_fc1.weight", "mlp.experts.local_experts.0.linear_fc2.weight",
                      "mlp.experts.local_experts.1.linear_fc1.weight", "mlp.experts.local_experts.1.linear_fc2.weight",
                      "mlp.experts.local_experts.2.linear_fc1.weight", "mlp.experts.local_experts.2.linear_fc2.weight",
                      "mlp.experts.local_experts.3.linear_fc1.weight", "mlp.experts.local_experts.3.linear_fc2.weight",
                      "mlp.router.weight", "pre_mlp_layernorm.weight"]
    assert not any(k.startswith("decoder.layers.2.mlp.router") for k in state)  # '-' stays dense
    gpt_layers = [build_module(get_llama_layer_spec(), config, layer_number=n) for n in (2, 3)]
    for layer, i in zip(gpt_layers, (1, 2)):  # the GPT layer holds both halves: load the half the pattern has
        own = {k[len(f"decoder.layers.{i}."):]: v for k, v in state.items() if k.startswith(f"decoder.layers.{i}.")}
        missing, unexpected = layer.load_state_dict(own, strict=False)
        assert not unexpected
    moe_norm, moe = Norm(32, config), build_module(get_moe_spec(), config, layer_number=4)
    moe.set_layer_number(4)
    moe_norm.load_state_dict({"weight": state["decoder.layers.3.pre_mlp_layernorm.weight"]})
    moe.load_state_dict({k[len("decoder.layers.3.mlp."):]: v for k, v in state.items()
                         if k.startswith("decoder.layers.3.mlp.")})
    hf_config = tiny_mamba2(hidden_size=32, num_heads=8, head_dim=8, state_size=8, n_groups=2, chunk_size=8)
    mamba_blocks = []
    for i in (0, 4):
        block = Mamba2Block(hf_config, layer_idx=0).eval()
        block.load_state_dict({k[len(f"decoder.layers.{i}."):]: v for k, v in state.items()
                               if k.startswith(f"decoder.layers.{i}.")})
        mamba_blocks.append(block)
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(1))
    x = model.embedding(ids, None)  # [s, b, h]
    x = mamba_blocks[0](x.transpose(0, 1)).transpose(0, 1)  # HF's block is batch-first
    attn, mlp = gpt_layers
    mask = torch.ones(19, 19, dtype=torch.bool).triu(1)[None, None]
    out, bias = attn.self_attention(attn.input_layernorm(x), mask, True)
    x = x + out
    out, bias = mlp.mlp(mlp.pre_mlp_layernorm(x))
    x = x + out
    aux_losses.clear()
    out, bias = moe(moe_norm(x))
    reference_balance = aux_losses.collect(["load_balancing_loss"], 5, 4, 1, 1).losses["load_balancing_loss"]
    x = x + out
    x = mamba_blocks[1](x.transpose(0, 1)).transpose(0, 1)
    x = model.decoder.final_norm(x)
    logits = x @ model.output_layer.weight.t()  # [s, b, v]
    aux_losses.clear()
    ours = model(ids, None)  # (no dropout: training gives the same outputs)
    balance = aux_losses.collect(["load_balancing_loss"], 5, 4, 1, 1).losses["load_balancing_loss"]
    torch.testing.assert_close(ours, logits.transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert balance[3] > 0 and balance.count_nonzero() == 1  # layer 4 only
    torch.testing.assert_close(balance, reference_balance)
    model(ids, None).float().sum().backward()
    assert model.decoder.layers[3].mlp.router.weight.grad.abs().sum() > 0


def test_greedy_generation_equals_hf_generate_one_token_per_step():
    """generate_tokens (the generation API the server uses) with the conv + SSM state cache: the same
    greedy tokens as HF generate, the prompt run once and then one token per forward; rows of
    different prompt lengths in one batch each equal their own HF generation."""
    from megatron.inference.generation import generate_tokens

    hf_config = tiny_mamba2(num_hidden_layers=3)
    hf, ours = hf_and_ours(hf_config, seed=2)
    prompts = torch.randint(2, 96, (2, 11), generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([11, 7])
    seen = []
    ours.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    with torch.no_grad():
        out = generate_tokens(ours, prompts, lengths, 12, top_k=1, stop_early=False)
    assert seen == [7] + [1] * 15  # prefill to the shortest prompt, then single tokens (no prefix recompute)
    for row, length in enumerate(lengths.tolist()):
        expected = hf.generate(prompts[row:row + 1, :length], max_new_tokens=12, do_sample=False,
                               pad_token_id=0)
        assert out.tokens[row, :length + 12].tolist() == expected[0].tolist()


def test_the_generation_server_serves_a_mamba_model():
    """PUT /api on the text generation server (megatron/inference/server.py, in a thread) with our converted
    Mamba-2: HF generate's greedy tokens."""
    import http.client
    import json

    from megatron.inference.server import ApiBackend, GenerationServer
    from megatron.training.tokenizer.null_tokenizer import NullTokenizer

    hf_config = tiny_mamba2(eos_token_id=95)
    hf, ours = hf_and_ours(hf_config, seed=4)
    server = GenerationServer(ApiBackend(ours, NullTokenizer(95)), port=0, log_requests=False).start()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        connection.request("PUT", "/api", body=json.dumps({"prompts": ["3 14 15 92 65"], "tokens_to_generate": 9,
                                                            "top_k": 1}),
                           headers={"Content-Type": "application/json"})
        answer = json.loads(connection.getresponse().read())
        connection.close()
    finally:
        server.stop()
    expected = hf.generate(torch.tensor([[3, 14, 15, 92, 65]]), max_new_tokens=9, do_sample=False, pad_token_id=0)
    assert answer["text"][0] == " ".join(str(t) for t in expected[0].tolist())


def test_beam_search_with_the_state_cache_equals_recomputing_the_prefix():
    """cached_next_logits reorders the Mamba states to the parent beams (swap_key_value_dict): the beams
    and scores equal those of model_next_logits, which reruns the whole prefix at every step."""
    from megatron.inference.beam_search import beam_search, model_next_logits
    from megatron.inference.generation import cached_next_logits

    _, ours = hf_and_ours(tiny_mamba2(), seed=6)
    prompt = [5, 17, 33, 2, 60]
    plain = beam_search(model_next_logits(ours), prompt, 3, 8, stop_token=1, vocab_size=96)
    cached = beam_search(cached_next_logits(ours, len(prompt) + 8), prompt, 3, 8, stop_token=1, vocab_size=96)
    assert cached.tokens == plain.tokens
    torch.testing.assert_close(torch.tensor(cached.scores), torch.tensor(plain.scores), rtol=1e-5, atol=1e-5)
    assert len({tuple(t) for t in plain.tokens}) == 3  # the beams differ: the reordering matters
