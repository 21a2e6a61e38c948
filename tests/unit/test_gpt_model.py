"""GPTModel: equivalence with HF GPT-2, state-dict layout, init, masks, precision, pipeline hooks."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.model import (
    Float16Module,
    GPTModel,
    TransformerConfig,
    get_num_parameters,
    unwrap_model,
)
from megatron.model.utils import erf_gelu, openai_gelu, scaled_init_method_normal

VOCAB, SEQ, HIDDEN, HEADS, LAYERS, BATCH = 64, 16, 32, 4, 2, 2


def make_config(**overrides) -> TransformerConfig:
    kwargs = {
        "num_layers": LAYERS,
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "openai_gelu": True,
    }
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def make_model(seed: int = 0, tied: bool = True, **overrides) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(make_config(**overrides), VOCAB, SEQ, share_embeddings_and_output_weights=tied)


def make_batch(seed: int = 1, seq: int = SEQ):
    """tokens [b, s], labels [b, s] (next tokens), position ids [b, s]."""
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, VOCAB, (BATCH, seq + 1), generator=gen)
    position_ids = torch.arange(seq).expand(BATCH, seq)
    return stream[:, :-1], stream[:, 1:], position_ids


def copy_weights(dst: GPTModel, src: GPTModel) -> GPTModel:
    dst.load_state_dict(src.state_dict())
    return dst


# ---------------------------------------------------------------- HuggingFace GPT-2 reference


def _qkv_to_hf_order(t: torch.Tensor) -> torch.Tensor:
    """Fused QKV rows [np, 3, hn] (Megatron) -> [3, np, hn] (HF: all q, all k, all v)."""
    hn = HIDDEN // HEADS
    rest = t.shape[1:]
    return t.reshape(HEADS, 3, hn, *rest).transpose(0, 1).reshape(3 * HEADS * hn, *rest)


def megatron_to_hf(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map Megatron names/layouts to GPT2LMHeadModel's (Conv1D weights are [in, out])."""
    out = {
        "transformer.wte.weight": tensors["embedding.word_embeddings.weight"],
        "transformer.wpe.weight": tensors["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": tensors["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": tensors["decoder.final_layernorm.bias"],
    }
    if "output_layer.weight" in tensors:
        out["lm_head.weight"] = tensors["output_layer.weight"]
    for i in range(LAYERS):
        m, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for mname, hname in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[h + hname + ".weight"] = tensors[m + mname + ".weight"]
            out[h + hname + ".bias"] = tensors[m + mname + ".bias"]
        out[h + "attn.c_attn.weight"] = _qkv_to_hf_order(tensors[m + "self_attention.linear_qkv.weight"]).t()
        out[h + "attn.c_attn.bias"] = _qkv_to_hf_order(tensors[m + "self_attention.linear_qkv.bias"])
        for mname, hname in (
            ("self_attention.linear_proj", "attn.c_proj"),
            ("mlp.linear_fc1", "mlp.c_fc"),
            ("mlp.linear_fc2", "mlp.c_proj"),
        ):
            out[h + hname + ".weight"] = tensors[m + mname + ".weight"].t()
            out[h + hname + ".bias"] = tensors[m + mname + ".bias"]
    return out


def make_hf_model(model: GPTModel, tied: bool):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        attn_implementation="eager",
    )
    hf = transformers.GPT2LMHeadModel(config)
    missing, unexpected = hf.load_state_dict(megatron_to_hf(model.state_dict()), strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"} and (tied or not missing)
    return hf


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_matches_hf_gpt2_logits_loss_and_grads(tied):
    # A large init std puts the GeLU in its non-linear range (tanh and erf GeLU differ there);
    # random norm and bias values catch any mix-up between weights and biases.
    model = make_model(tied=tied, init_method_std=0.3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".bias", "layernorm.weight")):
                param.add_(0.1 * torch.randn_like(param))
    hf = make_hf_model(model, tied)
    tokens, labels, position_ids = make_batch()

    logits = model(tokens, position_ids)
    hf_out = hf(input_ids=tokens, position_ids=position_ids, labels=tokens)
    torch.testing.assert_close(logits, hf_out.logits, rtol=1e-4, atol=1e-5)

    losses = model(tokens, position_ids, labels=labels)  # [b, s]
    assert losses.shape == (BATCH, SEQ) and losses.dtype == torch.float32
    expected = F.cross_entropy(hf_out.logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(losses, expected.view(BATCH, SEQ), rtol=1e-4, atol=1e-5)

    # HF shifts internally: its loss is the mean over the first s - 1 positions.
    loss = losses[:, :-1].mean()
    torch.testing.assert_close(loss, hf_out.loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    hf_out.loss.backward()

    grads = megatron_to_hf({n: p.grad for n, p in model.named_parameters()})
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(hf_grads) <= set(grads) and len(hf_grads) >= 4 + 12 * LAYERS
    for name, hf_grad in hf_grads.items():
        assert hf_grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], hf_grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- state dict and parameters


def expected_keys(tied: bool):
    keys = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
    for i in range(LAYERS):
        for sub in (
            "input_layernorm",
            "self_attention.linear_qkv",
            "self_attention.linear_proj",
            "pre_mlp_layernorm",
            "mlp.linear_fc1",
            "mlp.linear_fc2",
        ):
            keys += [f"decoder.layers.{i}.{sub}.weight", f"decoder.layers.{i}.{sub}.bias"]
    keys += ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias"]
    return keys if tied else keys + ["output_layer.weight"]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_state_dict_keys_and_shapes(tied):
    model = make_model(tied=tied)
    state = model.state_dict()
    assert list(state) == expected_keys(tied)
    assert list(model.state_dict_for_save_checkpoint()) == expected_keys(tied)
    hn = HIDDEN // HEADS
    assert state["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (HEADS * 3 * hn, HIDDEN)
    assert state["decoder.layers.0.mlp.linear_fc1.weight"].shape == (4 * HIDDEN, HIDDEN)
    assert state["embedding.position_embeddings.weight"].shape == (SEQ, HIDDEN)
    weight = model.shared_embedding_or_output_weight()
    if tied:
        assert weight is model.embedding.word_embeddings.weight
    else:
        assert weight is model.output_layer.weight
        assert not torch.equal(weight, model.embedding.word_embeddings.weight)


def test_no_bias_linear_drops_linear_biases():
    model = make_model(add_bias_linear=False)
    keys = list(model.state_dict())
    assert not any(k.startswith("decoder.layers.0.") and "linear_" in k and k.endswith(".bias") for k in keys)
    assert "decoder.layers.0.input_layernorm.bias" in keys


def test_get_num_parameters_counts_tied_weight_once():
    h, per_layer = HIDDEN, 12 * HIDDEN**2 + 13 * HIDDEN
    tied = VOCAB * h + SEQ * h + LAYERS * per_layer + 2 * h
    assert get_num_parameters(make_model(tied=True)) == tied
    assert get_num_parameters(make_model(tied=False)) == tied + VOCAB * h
    assert get_num_parameters([make_model(), make_model()]) == 2 * tied


# ---------------------------------------------------------------- initialisation


def test_init_std_of_output_projections_is_scaled_by_depth():
    std = 0.02
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, init_method_std=std)
    model = GPTModel(config, vocab_size=256, max_sequence_length=32)

    def pooled_std(suffixes):
        values = [p.detach().flatten() for n, p in model.named_parameters() if n.endswith(suffixes)]
        return torch.cat(values).std().item()

    scaled = std / math.sqrt(2 * config.num_layers)
    assert pooled_std(("linear_proj.weight", "linear_fc2.weight")) == pytest.approx(scaled, rel=0.03)
    assert pooled_std(("linear_qkv.weight", "linear_fc1.weight")) == pytest.approx(std, rel=0.03)
    assert pooled_std(("word_embeddings.weight", "position_embeddings.weight")) == pytest.approx(std, rel=0.03)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight"):
            assert torch.all(param == 1), name
        elif name.endswith(".bias"):
            assert torch.all(param == 0), name


def test_scaled_init_method_on_a_large_tensor():
    torch.manual_seed(0)
    weight = torch.empty(512, 512)
    scaled_init_method_normal(0.02, num_layers=8)(weight)
    assert weight.mean().item() == pytest.approx(0.0, abs=1e-4)
    assert weight.std().item() == pytest.approx(0.02 / 4, rel=0.01)


# ---------------------------------------------------------------- forward variants


def test_logits_shape_when_labels_none():
    tokens, _, position_ids = make_batch()
    logits = make_model(tied=False)(tokens, position_ids)
    assert logits.shape == (BATCH, SEQ, VOCAB) and logits.dtype == torch.float32


def test_kv_channels_allows_hidden_not_divisible_by_heads():
    torch.manual_seed(0)
    config = make_config(hidden_size=30, num_attention_heads=4, kv_channels=8)
    model = GPTModel(config, VOCAB, SEQ)
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.shape == (3 * 32, 30)
    assert model.decoder.layers[0].self_attention.linear_proj.weight.shape == (30, 32)
    tokens, labels, position_ids = make_batch()
    assert model(tokens, position_ids, labels=labels).shape == (BATCH, SEQ)


def _zero_residual_branches(model: GPTModel) -> None:
    with torch.no_grad():
        for layer in model.decoder.layers:
            for linear in (layer.self_attention.linear_proj, layer.mlp.linear_fc2):
                linear.weight.zero_()
                linear.bias.zero_()


def test_residual_post_layernorm_takes_residual_from_the_norm():
    # With the branch outputs zeroed a layer is its residual path: x (pre-LN) or ln2(ln1(x)).
    tokens, _, position_ids = make_batch()
    outputs = {}
    for post_ln in (False, True):
        torch.manual_seed(0)
        config = make_config(num_layers=1, apply_residual_connection_post_layernorm=post_ln)
        model = GPTModel(config, VOCAB, SEQ, post_process=False)
        _zero_residual_branches(model)
        outputs[post_ln] = model(tokens, position_ids)  # [s, b, h], no final norm
    embeddings = model.embedding(tokens, position_ids)  # [s, b, h]
    torch.testing.assert_close(outputs[False], embeddings)
    twice_normed = F.layer_norm(F.layer_norm(embeddings, (HIDDEN,)), (HIDDEN,))
    torch.testing.assert_close(outputs[True], twice_normed, rtol=1e-5, atol=1e-5)


def test_residual_post_layernorm_differs_and_trains():
    tokens, labels, position_ids = make_batch()
    pre = make_model()
    post = copy_weights(make_model(apply_residual_connection_post_layernorm=True), pre)
    assert not torch.allclose(pre(tokens, position_ids), post(tokens, position_ids), atol=1e-3)
    optimizer = torch.optim.Adam(post.parameters(), lr=1e-2)
    first = None
    for _ in range(8):
        optimizer.zero_grad()
        loss = post(tokens, position_ids, labels=labels).mean()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in post.parameters())
        first = loss.item() if first is None else first
        optimizer.step()
    assert post(tokens, position_ids, labels=labels).mean().item() < first - 0.1


def test_query_key_layer_scaling_gives_the_same_fp32_output():
    tokens, _, position_ids = make_batch()
    plain = make_model()
    scaled = copy_weights(make_model(apply_query_key_layer_scaling=True), plain)
    assert scaled.config.attention_softmax_in_fp32  # forced on by the config
    core = scaled.decoder.layers[1].self_attention.core_attention
    assert core.softmax_scale == 2.0 and core.norm_factor == pytest.approx(2.0 * math.sqrt(HIDDEN // HEADS))
    torch.testing.assert_close(scaled(tokens, position_ids), plain(tokens, position_ids), rtol=1e-5, atol=1e-5)


def causal_mask(seq: int) -> torch.Tensor:
    """Hand-built bool [1, 1, s, s] causal mask, True = masked out."""
    return ~torch.tril(torch.ones(seq, seq, dtype=torch.bool)).view(1, 1, seq, seq)


def test_attention_mask_none_equals_explicit_causal_mask():
    model = make_model()
    tokens, _, position_ids = make_batch()
    implicit = model(tokens, position_ids, attention_mask=None)
    torch.testing.assert_close(model(tokens, position_ids, attention_mask=causal_mask(SEQ)), implicit)
    per_sample = causal_mask(SEQ).expand(BATCH, 1, SEQ, SEQ)
    torch.testing.assert_close(model(tokens, position_ids, attention_mask=per_sample), implicit)
    with pytest.raises(TypeError, match="bool"):
        model(tokens, position_ids, attention_mask=causal_mask(SEQ).float())
    no_mask = torch.zeros(1, 1, SEQ, SEQ, dtype=torch.bool)
    assert not torch.allclose(model(tokens, position_ids, attention_mask=no_mask), implicit, atol=1e-3)


def test_block_diagonal_mask_isolates_documents():
    # reset_attention_mask / reset_position_ids style: two documents [0, k) and [k, s).
    k = 6
    model = make_model()
    tokens, _, plain_positions = make_batch()
    doc = (torch.arange(SEQ) >= k).long()
    mask = causal_mask(SEQ) | (doc.view(SEQ, 1) != doc.view(1, SEQ)).view(1, 1, SEQ, SEQ)
    positions = torch.cat([torch.arange(k), torch.arange(SEQ - k)]).expand(BATCH, SEQ)
    logits = model(tokens, positions, attention_mask=mask)

    first = model(tokens[:, :k], plain_positions[:, :k])
    second = model(tokens[:, k:], plain_positions[:, : SEQ - k])
    torch.testing.assert_close(logits[:, :k], first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:, k:], second, rtol=1e-5, atol=1e-5)
    causal = model(tokens, positions)
    assert not torch.allclose(logits[:, k:], causal[:, k:], atol=1e-3)


@pytest.mark.parametrize("which", ["hidden_dropout", "attention_dropout"])
def test_dropout_active_in_train_mode_only(which):
    tokens, _, position_ids = make_batch()
    reference = make_model()
    model = copy_weights(make_model(**{which: 0.5}), reference)
    model.train()
    torch.manual_seed(1)
    first = model(tokens, position_ids)
    assert not torch.allclose(first, model(tokens, position_ids))
    model.eval()
    torch.testing.assert_close(model(tokens, position_ids), reference(tokens, position_ids))


def test_dropout_sites():
    # Embeddings, attention probabilities and both residual branches (Megatron's placement).
    # unfused bias-dropout-add: the residual dropouts run as modules the hook below can see
    model = make_model(hidden_dropout=0.1, attention_dropout=0.1, bias_dropout_fusion=False)
    calls = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout):
            module.register_forward_hook(lambda m, args, out, n=name: calls.append((n, tuple(args[0].shape))))
    tokens, _, position_ids = make_batch()
    model(tokens, position_ids)
    s_b_h, b_np_s_s = (SEQ, BATCH, HIDDEN), (BATCH, HEADS, SEQ, SEQ)
    expected = [("embedding.embedding_dropout", s_b_h)]
    for i in range(LAYERS):
        expected += [
            (f"decoder.layers.{i}.self_attention.core_attention.attention_dropout", b_np_s_s),
            (f"decoder.layers.{i}.hidden_dropout", s_b_h),
            (f"decoder.layers.{i}.hidden_dropout", s_b_h),
        ]
    assert calls == expected


def test_gelu_variants_match_hf_activations():
    activations = pytest.importorskip("transformers.activations")
    x = torch.linspace(-6, 6, 1001)
    torch.testing.assert_close(openai_gelu(x), activations.ACT2FN["gelu_new"](x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(erf_gelu(x), activations.ACT2FN["gelu"](x), rtol=1e-6, atol=1e-6)
    assert (openai_gelu(x) - erf_gelu(x)).abs().max() > 1e-4
    assert make_model(openai_gelu=True).decoder.layers[0].mlp.activation_func is openai_gelu
    assert make_model(openai_gelu=False).decoder.layers[0].mlp.activation_func is erf_gelu


def test_pipeline_stages_compose_to_the_full_model():
    full = make_model()
    tokens, labels, position_ids = make_batch()
    state = full.state_dict()
    first = GPTModel(make_config(num_layers=1), VOCAB, SEQ, post_process=False)
    last = GPTModel(make_config(num_layers=1), VOCAB, SEQ, pre_process=False)
    assert list(last.state_dict())[-1] == "output_layer.weight"  # its copy of the tied weight
    assert torch.all(last.output_layer.weight == 0) and last.output_layer.weight.shared_embedding
    first.load_state_dict({k: v for k, v in state.items() if not k.startswith(("decoder.layers.1", "decoder.final"))})
    last_state = {k.replace("layers.1", "layers.0"): v for k, v in state.items() if k.startswith("decoder.layers.1")}
    last_state.update({k: v for k, v in state.items() if k.startswith("decoder.final")})
    last_state["output_layer.weight"] = state["embedding.word_embeddings.weight"]
    last.load_state_dict(last_state)

    hidden = first(tokens, position_ids)  # [s, b, h]
    assert hidden.shape == (SEQ, BATCH, HIDDEN)
    last.set_input_tensor([hidden])
    torch.testing.assert_close(last(None, None, labels=labels), full(tokens, position_ids, labels=labels))


# ---------------------------------------------------------------- precision


def test_float16_module_bf16_returns_fp32_close_to_fp32_model():
    tokens, labels, position_ids = make_batch()
    model = make_model()
    reference = model(tokens, position_ids, labels=labels)
    fp32_state = copy.deepcopy(model.state_dict())
    wrapped = Float16Module(dataclasses.replace(model.config, bf16=True), model)

    assert all(p.dtype == torch.bfloat16 for p in wrapped.parameters())
    losses = wrapped(tokens, position_ids, labels=labels)
    assert losses.dtype == torch.float32 and losses.shape == (BATCH, SEQ)
    torch.testing.assert_close(losses, reference, rtol=2e-2, atol=2e-2)
    assert not torch.equal(losses, reference)  # really ran in bf16
    logits = wrapped(tokens, position_ids)
    assert logits.dtype == torch.float32 and logits.shape == (BATCH, SEQ, VOCAB)

    assert list(wrapped.state_dict()) == expected_keys(tied=True)
    assert list(wrapped.state_dict_for_save_checkpoint()) == expected_keys(tied=True)
    wrapped.load_state_dict(fp32_state)
    assert wrapped.module.embedding.word_embeddings.weight.dtype == torch.bfloat16
    assert unwrap_model(wrapped) is model and unwrap_model([wrapped]) == [model]


def test_float16_module_needs_a_half_precision_flag():
    with pytest.raises(ValueError, match="config.fp16 or config.bf16"):
        Float16Module(make_config(), make_model())


def test_fp16_with_fp32_residual_connection_stays_close():
    tokens, labels, position_ids = make_batch()
    model = make_model()
    reference = model(tokens, position_ids, labels=labels)
    config = dataclasses.replace(model.config, fp16=True, fp32_residual_connection=True)
    half = copy_weights(GPTModel(config, VOCAB, SEQ), model)
    embeddings = Float16Module(config, half).module.embedding(tokens, position_ids)
    assert embeddings.dtype == torch.float32  # the residual stream stays fp32
    losses = Float16Module(config, half)(tokens, position_ids, labels=labels)
    assert losses.dtype == torch.float32
    torch.testing.assert_close(losses, reference, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("fp16_lm_cross_entropy, dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_cross_entropy_precision(fp16_lm_cross_entropy, dtype):
    tokens, labels, position_ids = make_batch()
    model = make_model(fp16_lm_cross_entropy=fp16_lm_cross_entropy).to(torch.bfloat16)
    assert model(tokens, position_ids, labels=labels).dtype == dtype


# ---------------------------------------------------------------- config


def test_config_derived_values():
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    assert config.ffn_hidden_size == 128 and config.kv_channels == 8
    assert config.hidden_dropout == 0.1 and config.attention_dropout == 0.1
    assert not config.attention_softmax_in_fp32
    assert TransformerConfig(2, 32, 4, apply_query_key_layer_scaling=True).attention_softmax_in_fp32


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"hidden_size": 30}, "hidden_size"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_attention_heads": -1}, "num_attention_heads"),
        ({"ffn_hidden_size": 0}, "ffn_hidden_size"),
        ({"fp16": True, "bf16": True}, "fp16"),
        ({"hidden_dropout": 1.5}, "hidden_dropout"),
        ({"attention_dropout": -0.1}, "attention_dropout"),
    ],
)
def test_config_validation_names_the_field(overrides, field):
    kwargs = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**kwargs)


def test_unsupported_position_embedding_type_is_rejected():
    with pytest.raises(ValueError, match="'relative' is not supported.*learned_absolute, rope, alibi, none"):
        GPTModel(make_config(), VOCAB, SEQ, position_embedding_type="relative")
