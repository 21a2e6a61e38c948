"""HF NemotronHForCausalLM <-> our hybrid MambaModel (megatron/convert/nemotron_h.py).

A tiny random NemotronH with every kind of layer (pattern M*-EME: Mamba-2, attention, squared-ReLU MLP,
sigmoid-routed MoE with a shared expert) converted to ours: the same logits, loss and gradients as HF's
torch path, the same greedy tokens as HF generate, and the state dict back bit for bit; our args of such a
model -> HF config and weights -> the same logits; tools/checkpoint/convert.py HF -> TP = 2, PP = 2 -> HF
bit for bit (convert.py compares logits at each step), also from files under transformers 5's module names
and through Megatron-LM's megatron-core names; pretrain_mamba.py --load-hf; the settings HF ignores
accepted, and those HF has and ours lacks (or the reverse) refused with one message naming them.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron.convert.hf_files import ARCHITECTURE_FLAGS, HFCheckpoint, hf_arg_values
from megatron.convert.huggingface import config_from_hf, hf_config_from_args, state_dict_from_hf, state_dict_to_hf
from megatron.model import TransformerConfig
from megatron.model.mamba import MambaModel
from megatron.training.checkpoint_safety import load_file
from megatron.training.checkpointing import get_checkpoint_name
from tests.helpers.convert import run_convert, save_hf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PATTERN = "M*-EME"
OUR_FLAGS = [  # pretrain_mamba.py's flags of a hybrid model NemotronH can hold (pattern E-*M, k = 1)
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--kv-channels", "8", "--ffn-hidden-size", "40", "--seq-length", "16",
    "--max-position-embeddings", "64", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--is-hybrid-model",
    "--hybrid-override-pattern", "E-*M", "--mamba-state-dim", "8", "--mamba-head-dim", "8",
    "--mamba-num-groups", "2", "--mamba-num-heads", "8", "--normalization", "RMSNorm", "--disable-bias-linear",
    "--squared-relu", "--position-embedding-type", "none", "--untie-embeddings-and-output-weights",
    "--num-experts", "4", "--moe-router-topk", "1", "--moe-ffn-hidden-size", "16",
    "--moe-shared-expert-intermediate-size", "24",
    "--moe-router-score-function", "sigmoid", "--moe-router-topk-scaling-factor", "2.0",
    "--moe-router-enable-expert-bias",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--init-method-std", "0.1"]


def tiny_nemotron_h(**overrides):
    kwargs = dict(vocab_size=96, hidden_size=32, hybrid_override_pattern=PATTERN, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=48, ssm_state_size=8, mamba_num_heads=8,
                  mamba_head_dim=8, n_groups=2, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, routed_scaling_factor=1.5,
                  initializer_range=0.1, pad_token_id=0, bos_token_id=0, eos_token_id=1)
    return transformers.NemotronHConfig(**{**kwargs, **overrides})


def _perturb(model):
    """Norms and D away from their constant init, so that a mix-up shows; the expert biases nonzero."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".D"):
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)


# Nemotron-H's trained routers: group-limited (2 groups of 2 experts, the best one kept per token: k = 2 =
# 2 x topk_group) with a nonzero e_score_correction_bias (_perturb), Megatron's aux-loss-free expert bias
ROUTING = dict(n_group=2, topk_group=1)


@pytest.fixture(scope="module")
def hf_and_ours():
    hf_config = tiny_nemotron_h(**ROUTING)
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(hf_config).eval()
    _perturb(hf)
    config_kwargs, model_kwargs = config_from_hf(hf_config, seq_length=64)
    assert (config_kwargs["moe_router_num_groups"], config_kwargs["moe_router_group_topk"]) == (2, 1)
    assert config_kwargs["moe_router_enable_expert_bias"]
    ours = MambaModel(TransformerConfig(**config_kwargs), **model_kwargs).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), hf_config))
    return hf_config, hf, ours


def test_converted_hf_nemotron_h_gives_the_same_logits_loss_and_gradients(hf_and_ours):
    hf_config, hf, ours = hf_and_ours
    assert ours.hybrid_pattern == PATTERN
    ids = torch.randint(2, 96, (2, 21), generator=torch.Generator().manual_seed(3))  # s = 21: a partial chunk
    hf_out = hf(ids, labels=ids)
    torch.testing.assert_close(ours(ids, None), hf_out.logits, rtol=1e-4, atol=1e-4)
    loss = ours(ids[:, :-1], None, labels=ids[:, 1:]).mean()  # HF shifts the labels itself
    torch.testing.assert_close(loss, hf_out.loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    hf_out.loss.backward()
    our_grads = state_dict_to_hf({name: p.grad for name, p in ours.named_parameters()}, hf_config)
    for name, p in hf.named_parameters():
        scale = p.grad.abs().max().clamp(min=1e-3)
        torch.testing.assert_close(our_grads[name] / scale, p.grad / scale, rtol=0, atol=1e-4, msg=name)
    hf.zero_grad(), ours.zero_grad()
    # and back: HF's state dict bit for bit, under its module names (experts fused, zero expert bias)
    hf_state, back = hf.state_dict(), state_dict_to_hf(ours.state_dict(), hf_config)
    assert sorted(back) == sorted(hf_state)
    assert not [k for k in hf_state if not torch.equal(hf_state[k], back[k])]
    bias = hf_state["model.layers.3.mixer.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0 and torch.equal(ours.decoder.layers[3].mlp.router.expert_bias, bias)


def test_the_groups_and_the_expert_bias_change_the_routing(hf_and_ours):
    """Without the groups, or with a zero expert bias, the logits differ: the equality above covers both."""
    hf_config, hf, ours = hf_and_ours
    ids = torch.randint(2, 96, (2, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = ours(ids, None)
        for changes in (dict(n_group=1, topk_group=1), "zero bias"):
            config = hf_config if changes == "zero bias" else tiny_nemotron_h(**changes)
            config_kwargs, model_kwargs = config_from_hf(config, seq_length=64)
            other = MambaModel(TransformerConfig(**config_kwargs), **model_kwargs).eval()
            state = dict(ours.state_dict())
            if changes == "zero bias":
                state = {k: torch.zeros_like(v) if k.endswith("expert_bias") else v for k, v in state.items()}
            other.load_state_dict(state)
            assert not torch.allclose(other(ids, None), reference, rtol=1e-4, atol=1e-4), changes


def test_greedy_generation_equals_hf_generate(hf_and_ours):
    """generate_tokens with the Mamba states and the attention KV cache: HF generate's greedy tokens."""
    from megatron.inference.generation import generate_tokens

    _, hf, ours = hf_and_ours
    prompts = torch.randint(2, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([9, 6])
    with torch.no_grad():
        out = generate_tokens(ours, prompts, lengths, 6, top_k=1, stop_early=False)
    for row, length in enumerate(lengths.tolist()):
        expected = hf.generate(prompts[row:row + 1, :length], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert out.tokens[row, :length + 6].tolist() == expected[0].tolist()


def test_our_hybrid_args_give_the_hf_config_and_weights():
    """A hybrid MambaModel of pretrain_mamba.py's flags -> hf_config_from_args and state_dict_to_hf -> an HF
    NemotronH with the same logits, whose config gives the flags back."""
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.config_builders import core_transformer_config_from_args, mamba_model_kwargs

    args = parse_and_validate_args(argv=OUR_FLAGS)
    torch.manual_seed(1)
    ours = MambaModel(core_transformer_config_from_args(args), vocab_size=96, max_sequence_length=64,
                      share_embeddings_and_output_weights=False, **mamba_model_kwargs(args)).eval()
    fields = hf_config_from_args(args, 96)
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    assert hf_config.hybrid_override_pattern == "E-*M" and not hf_config.norm_topk_prob
    hf = transformers.NemotronHForCausalLM(hf_config).eval()
    hf.load_state_dict(state_dict_to_hf(ours.state_dict(), hf_config))
    ids = torch.randint(2, 96, (1, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        # (no cache: HF's cache asks layer 0 for its length, and an MoE layer 0 keeps none)
        torch.testing.assert_close(ours(ids, None), hf(ids, use_cache=False).logits, rtol=1e-4, atol=1e-4)
    derived = hf_arg_values(hf_config)
    assert {dest: getattr(args, dest) for dest in ARCHITECTURE_FLAGS if dest in derived} == \
        {dest: value for dest, value in derived.items() if dest in ARCHITECTURE_FLAGS}


def test_settings_hf_ignores_change_nothing():
    """HF's NemotronH never ties lm_head and masks its attention causally whatever tie_word_embeddings and
    sliding_window say: the converted model is untied and runs at the full length."""
    from megatron.convert.hf_files import hf_seq_length

    hf_config = tiny_nemotron_h(tie_word_embeddings=True, sliding_window=4, max_position_embeddings=64)
    hf = transformers.NemotronHForCausalLM(hf_config)
    assert hf.lm_head.weight is not hf.model.embeddings.weight
    assert config_from_hf(hf_config)[1]["share_embeddings_and_output_weights"] is False
    assert hf_seq_length(hf_config) == 64


@pytest.mark.parametrize("hf_setting, ours_setting, message", [
    (dict(n_group=2, topk_group=1, num_experts_per_tok=1, norm_topk_prob=False), None,
     "n_group 2, topk_group 1 and num_experts_per_tok 1 .*top 2 experts"),
    (dict(n_group=3, topk_group=1), None, "n_group 3 not dividing n_routed_experts 4"),
    (dict(moe_latent_size=16), None, "moe_latent_size 16"),
    (dict(mlp_hidden_act="silu"), None, "mlp_hidden_act 'silu'"),
    (dict(num_nextn_predict_layers=1), None, "num_nextn_predict_layers 1"),
    (None, dict(untie_embeddings_and_output_weights=False), "tied embeddings cannot be converted to HF"),
    (None, dict(moe_router_score_function="softmax"), "routed by softmax"),
    (None, dict(moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk=1), "--moe-router-topk 1 and "
     "--moe-router-group-topk 1 cannot be converted to HF"),
], ids=["group-topk-not-half-of-k", "groups-not-dividing-experts", "latent-moe", "mlp-activation", "mtp", "tied-to-hf",
        "softmax-to-hf", "group-topk-not-half-of-k-to-hf"])
def test_what_nemotron_h_or_ours_lacks_is_refused(hf_setting, ours_setting, message):
    """One ValueError naming the setting, HF -> ours (config or weights) and ours -> HF."""
    from argparse import Namespace

    if ours_setting is not None:
        args = dict(num_layers=4, hybrid_override_pattern="M*-E", normalization="RMSNorm", add_bias_linear=False,
                    position_embedding_type="none", swiglu=False, squared_relu=True,
                    untie_embeddings_and_output_weights=True, moe_router_score_function="sigmoid",
                    moe_router_load_balancing_type="aux_loss", moe_shared_expert_intermediate_size=24)
        with pytest.raises(ValueError, match=message):
            hf_config_from_args(Namespace(is_hybrid_model=True, **{**args, **ours_setting}), 96)
        return
    with pytest.raises(ValueError, match=message):
        config_from_hf(tiny_nemotron_h(**hf_setting))


def test_a_nonzero_expert_bias_in_files_reaches_our_router(tmp_path):
    """The converter's HF loader reads every E layer's e_score_correction_bias (fp32 in the files, as HF
    keeps it) into our mlp.router.expert_bias."""
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(tiny_nemotron_h(**ROUTING))
    with torch.no_grad():
        model.model.layers[5].mixer.gate.e_score_correction_bias[2] = 0.25
    model.save_pretrained(str(tmp_path))
    checkpoint = HFCheckpoint(str(tmp_path))
    rules = {rule.ours: rule for rule in checkpoint.rules()}
    bias = checkpoint.ours(rules["decoder.layers.5.mlp.router.expert_bias"])
    assert bias.dtype == torch.float32 and bias.tolist() == [0.0, 0.0, 0.25, 0.0]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemotron_h")
    save_hf(tiny_nemotron_h(vocab_size=200, initializer_range=0.02, **ROUTING), root / "hf")
    run_convert(root / "hf", root / "tp2pp2", "hf", "megatron", "--target-tensor-parallel-size", "2",
                "--target-pipeline-parallel-size", "2")
    run_convert(root / "tp2pp2", root / "back", "megatron", "hf")
    return root


def _safetensors(path):
    return safetensors_torch.load_file(str(path / "model.safetensors"))


def test_hf_to_tp2pp2_to_hf_is_bit_identical(converted):
    source, back = _safetensors(converted / "hf"), _safetensors(converted / "back")
    assert "backbone.layers.3.mixer.experts.0.up_proj.weight" in source  # the file names (as released)
    assert sorted(source) == sorted(back)
    assert not [k for k in source if not torch.equal(source[k], back[k])]
    with open(converted / "hf" / "config.json") as a, open(converted / "back" / "config.json") as b:
        assert json.load(a) == json.load(b)
    # tensor-parallel rank 1 holds its halves: of layer 0's Mamba heads, and (second stage, its layer 0 is
    # the model's layer 3, an E) of each expert's and the shared expert's fc1 rows
    def rank1(stage):
        return load_file(get_checkpoint_name(str(converted / "tp2pp2"), 0, release=True, pipeline_parallel=True,
                                             tensor_rank=1, pipeline_rank=stage))["model"]
    assert torch.equal(rank1(0)["decoder.layers.0.mixer.dt_bias"], source["backbone.layers.0.mixer.dt_bias"][4:])
    moe = rank1(1)
    assert torch.equal(moe["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"],
                       source["backbone.layers.3.mixer.experts.3.up_proj.weight"][8:])
    assert torch.equal(moe["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"],
                       source["backbone.layers.3.mixer.shared_experts.up_proj.weight"][12:])


def test_files_under_the_module_names_read_the_same(converted, tmp_path):
    """A NemotronH saved with save_original_format=False (model., experts fused) gives the same tensors."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(converted / "hf"))
    model.save_pretrained(str(tmp_path), save_original_format=False)
    assert "model.layers.3.mixer.experts.up_proj" in _safetensors(tmp_path)
    original, modules = HFCheckpoint(str(converted / "hf")), HFCheckpoint(str(tmp_path))
    rules = {rule.ours: rule for rule in modules.rules()}
    for rule in original.rules():
        assert torch.equal(modules.ours(rules[rule.ours]), original.ours(rule)), rule.ours


def test_megatron_lm_names_round_trip(converted):
    """Ours -> Megatron-LM's megatron-core files (Transformer Engine's fused norm names: Nemotron-H's own
    training format) -> ours -> HF: the source bit for bit."""
    run_convert(converted / "tp2pp2", converted / "core", "megatron", "core")
    names = load_file(get_checkpoint_name(str(converted / "core"), 0, release=True, pipeline_parallel=True,
                                          tensor_rank=0, pipeline_rank=0))["model"]
    assert {"decoder.layers.0.mixer.in_proj.layer_norm_weight", "decoder.layers.1.self_attention.linear_qkv."
            "layer_norm_weight", "decoder.layers.2.mlp.linear_fc1.layer_norm_weight"} <= set(names)
    run_convert(converted / "core", converted / "core-back", "core", "hf", "--true-vocab-size", "200")
    source, back = _safetensors(converted / "hf"), _safetensors(converted / "core-back")
    assert sorted(source) == sorted(back) and all(torch.equal(source[k], back[k]) for k in source)


def test_pretrain_mamba_load_hf_starts_from_the_hf_weights(converted, tmp_path):
    """pretrain_mamba.py --load-hf of the NemotronH: after one step at lr 0 (and expert-bias rate 0) the
    checkpoint holds HF's tensors; the run takes HF's group-limited routing and expert bias."""
    import pretrain_mamba
    from megatron.training.initialize import reset_megatron

    ckpt = str(tmp_path / "ckpt")
    try:
        pretrain_mamba.main(["--load-hf", str(converted / "hf"), "--micro-batch-size", "2", "--global-batch-size", "2",
                             "--train-iters", "1", "--lr", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", "199", "--seq-length", "16", "--eval-iters", "0", "--save", ckpt,
                             "--save-interval", "1", "--ckpt-format", "torch", "--moe-router-bias-update-rate", "0"])
    finally:
        reset_megatron()
    saved = load_file(get_checkpoint_name(ckpt, 1))["model"]
    assert "decoder.layers.3.mlp.router.expert_bias" in saved
    expected = state_dict_from_hf(_safetensors(converted / "hf"),
                                  transformers.AutoConfig.from_pretrained(str(converted / "hf")))
    assert sorted(k for k in saved if not k.endswith("_extra_state")) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(saved[name][:tensor.shape[0]], tensor), name  # (the vocabulary padded to 256 rows)


@pytest.mark.parametrize("expert_bias", [True, False], ids=["expert-bias", "no-expert-bias"])
def test_a_trained_hybrid_checkpoint_converts_to_hf(tmp_path, expert_bias):
    """pretrain_mamba.py of OUR_FLAGS saves a checkpoint; --saver hf writes a NemotronH from its args (the
    converter's logits check: the checkpoint against the HF folder read back) that transformers loads with
    no missing or unexpected tensor and whose logits equal those of the folder converted to ours. The
    expert bias after the training step is HF's e_score_correction_bias; trained without one, HF's is zero."""
    import pretrain_mamba
    from megatron.training.initialize import reset_megatron

    ckpt = str(tmp_path / "ckpt")
    flags = [f for f in OUR_FLAGS if expert_bias or f != "--moe-router-enable-expert-bias"]
    try:
        pretrain_mamba.main([*flags, "--global-batch-size", "1", "--eval-iters", "0", "--save", ckpt,
                             "--save-interval", "1", "--ckpt-format", "torch"])
    finally:
        reset_megatron()
    run_convert(ckpt, tmp_path / "hf", "megatron", "hf", "--true-vocab-size", "96")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert type(hf).__name__ == "NemotronHForCausalLM" and hf.config.hybrid_override_pattern == "E-*M"
    assert not any(info.values()), info
    bias = hf.model.layers[0].mixer.gate.e_score_correction_bias  # (pattern E-*M: layer 0 is the E)
    assert bool(bias.abs().max() > 0) == expert_bias
    config_kwargs, model_kwargs = config_from_hf(hf.config, seq_length=64)
    ours = MambaModel(TransformerConfig(**config_kwargs), **model_kwargs).eval()
    ours.load_state_dict(state_dict_from_hf(_safetensors(tmp_path / "hf"), hf.config))
    ids = torch.randint(2, 96, (1, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, None), hf.eval()(ids, use_cache=False).logits, rtol=1e-4, atol=1e-4)
