"""The fused ops in the model: each fusion flag on and off gives the same training step, the fused
ops run exactly when their flag is on, --fused-kernels-cpu-impl compiled matches the reference,
and the flags reach the config.

A training step here is one forward + backward of a small fp32 GPT with dropout 0.1 from a fixed
seed: the loss and every parameter gradient are compared. Bias-dropout-add's CPU reference is the
unfused ops' math and draws the same masks, so that comparison is torch.equal; the fused softmax
and bias-GeLU round differently from the unfused ops (their backward formulas, the bias added
outside the GEMM), so those compare within 1e-6. The fused bias-GeLU is the tanh approximation
(Megatron's), so it is compared with the unfused model running the tanh GeLU (openai_gelu); with
the default erf GeLU the unfused model differs by the two GeLUs' gap (at most 4.7e-4 an element).
"""

from __future__ import annotations

import pytest
import torch

from megatron import fused_kernels
from megatron.fused_kernels import fused_core_attention
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args, parse_args
from megatron.model import GPTModel, TransformerConfig
from megatron.model.layers import fused_impl

VOCAB, SEQ, BATCH, HIDDEN, HEADS, LAYERS, SEED = 64, 16, 2, 32, 4, 2, 1234
ALL_OFF = dict(masked_softmax_fusion=False, bias_gelu_fusion=False, bias_dropout_fusion=False)
FUSIONS = ("masked_softmax_fusion", "bias_gelu_fusion", "bias_dropout_fusion")
OPS_OF = {"masked_softmax_fusion": "scale_mask_softmax", "bias_gelu_fusion": "bias_gelu",
          "bias_dropout_fusion": "bias_dropout_add"}


TINY_RUN = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 32 --seq-length 32 "
            "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 100").split()


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _config(**overrides) -> TransformerConfig:
    kwargs = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.1,
                  attention_dropout=0.1, **ALL_OFF)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _step(config: TransformerConfig, attention_mask: torch.Tensor | None = None):
    """(loss, {name: grad}) of one forward + backward in train mode; weights and dropout seeded."""
    torch.manual_seed(SEED)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    torch.manual_seed(99)
    loss = model(tokens[:, :-1], positions, attention_mask, labels=tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in model.named_parameters()}


def _assert_same_step(fused, unfused, exact: bool, atol: float = 1e-6) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = fused, unfused
    assert grads_a.keys() == grads_b.keys()
    if exact:
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(grads_a[name], grads_b[name]) for name in grads_a)
    else:
        torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=atol)
        for name in grads_a:
            torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=atol, msg=name)


def _document_mask() -> torch.Tensor:
    """Causal within two documents of SEQ/2 tokens: [1, 1, s, s], True = masked out."""
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu_(1)
    document = torch.arange(SEQ) // (SEQ // 2)
    return (causal | (document[:, None] != document[None, :])).view(1, 1, SEQ, SEQ)


# ---------------------------------------------------------------- (a) on vs off: the same step


@pytest.mark.parametrize("overrides", [{}, {"add_bias_linear": False},
                                       {"apply_residual_connection_post_layernorm": True}],
                         ids=["bias", "no-bias", "post-ln-residual"])
def test_bias_dropout_fusion_gives_the_same_bits(overrides):
    _assert_same_step(_step(_config(bias_dropout_fusion=True, **overrides)), _step(_config(**overrides)), exact=True)


def test_bias_dropout_fusion_same_bits_in_selective_recompute():
    config = dict(recompute_granularity="selective")
    _assert_same_step(_step(_config(bias_dropout_fusion=True, **config)), _step(_config(**config)), exact=True)


@pytest.mark.parametrize("mask", ["causal-hint", "document-mask"])
def test_masked_softmax_fusion_matches_unfused(mask):
    attention_mask = None if mask == "causal-hint" else _document_mask()
    _assert_same_step(_step(_config(masked_softmax_fusion=True), attention_mask),
                      _step(_config(), attention_mask), exact=False)


def test_masked_softmax_fusion_with_query_key_layer_scaling():
    config = dict(apply_query_key_layer_scaling=True)
    _assert_same_step(_step(_config(masked_softmax_fusion=True, **config)), _step(_config(**config)), exact=False)


def test_bias_gelu_fusion_matches_the_unfused_tanh_gelu():
    _assert_same_step(_step(_config(bias_gelu_fusion=True)), _step(_config(openai_gelu=True)), exact=False)
    _assert_same_step(_step(_config(bias_gelu_fusion=True, openai_gelu=True)), _step(_config(openai_gelu=True)),
                      exact=False)


def test_bias_gelu_fusion_is_the_tanh_gelu_not_the_default_erf_one():
    # Weights of std 1 put the GeLU's inputs where the two GeLUs differ (near 0 they agree to 1e-8).
    fused, _ = _step(_config(bias_gelu_fusion=True, init_method_std=1.0))
    tanh, _ = _step(_config(openai_gelu=True, init_method_std=1.0))
    erf, _ = _step(_config(init_method_std=1.0))
    assert (fused - tanh).abs() <= 1e-6 * tanh.abs() < (fused - erf).abs()  # rounding vs the GeLUs' gap


def test_all_fusions_on_match_all_off():
    defaults = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    assert all(getattr(defaults, name) for name in FUSIONS)  # Megatron's defaults: on
    on = {name: True for name in FUSIONS}
    _assert_same_step(_step(_config(**on)), _step(_config(openai_gelu=True)), exact=False)


# ---------------------------------------------------------------- (b) the fused ops run when on


def _count_calls(monkeypatch) -> dict:
    """Wrap every fused op the model may call; returns {op: [impl of each call]}."""
    calls = {name: [] for name in (*OPS_OF.values(), "layer_norm")}
    for name in calls:
        original = getattr(fused_kernels, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name].append(kwargs.get("impl"))
            return _original(*args, **kwargs)

        monkeypatch.setattr(fused_kernels, name, counted)
    return calls


@pytest.mark.parametrize("fusion", FUSIONS)
def test_each_fused_op_runs_only_when_its_flag_is_on(fusion, monkeypatch):
    per_layer = {"masked_softmax_fusion": 1, "bias_gelu_fusion": 1, "bias_dropout_fusion": 2}[fusion]
    for on in (True, False):
        calls = _count_calls(monkeypatch)
        _step(_config(**{fusion: on}))
        assert len(calls[OPS_OF[fusion]]) == (per_layer * LAYERS if on else 0), (fusion, on)
        others = [OPS_OF[name] for name in FUSIONS if name != fusion]
        assert all(not calls[op] for op in others)
        assert len(calls["layer_norm"]) == 2 * LAYERS + 1  # always: input, pre-MLP and final norms
        assert set(sum(calls.values(), [])) == {"native"}  # config.fused_kernels_cpu_impl on CPU (its default)
        monkeypatch.undo()


def test_the_block_built_causal_mask_reaches_the_fused_softmax_as_causal_true(monkeypatch):
    seen = []
    original = fused_kernels.scale_mask_softmax

    def spy(scores, mask=None, scale=1.0, causal=False, **kwargs):
        seen.append((mask is None, causal))
        return original(scores, mask, scale, causal, **kwargs)

    monkeypatch.setattr(fused_kernels, "scale_mask_softmax", spy)
    _step(_config(masked_softmax_fusion=True))  # no mask given: the block builds the causal one
    assert seen == [(True, True)] * LAYERS
    seen.clear()
    _step(_config(masked_softmax_fusion=True), _document_mask())  # a mask given: passed as it is
    assert seen == [(False, False)] * LAYERS


@pytest.mark.parametrize("groups", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask", ["causal-hint", "document-mask"])
def test_native_cpu_attention_core_matches_unfused_without_attention_dropout(mask, groups, monkeypatch):
    """--fused-kernels-cpu-impl native (the default), attention dropout 0: the fused softmax runs as
    fused_kernels.core_attention (causal given as causal=True, a mask passed as it is; with query
    groups K and V once per group, queries_per_key heads each) and the step equals the unfused
    model's (which repeats K and V per head); with "reference" the composed matmul +
    scale_mask_softmax runs."""
    attention_mask = None if mask == "causal-hint" else _document_mask()
    seen = []
    original = fused_core_attention.core_attention

    def spy(q, k, v, *, scale, heads, mask=None, causal=False, queries_per_key=1):
        seen.append((mask is None, causal, heads, queries_per_key))
        return original(q, k, v, scale=scale, heads=heads, mask=mask, causal=causal, queries_per_key=queries_per_key)

    monkeypatch.setattr(fused_core_attention, "core_attention", spy)
    unfused = _step(_config(attention_dropout=0.0, num_query_groups=groups), attention_mask)
    native = _step(_config(masked_softmax_fusion=True, attention_dropout=0.0, num_query_groups=groups),
                   attention_mask)
    per_key = 1 if groups is None else HEADS // groups
    assert seen == [(attention_mask is None, attention_mask is None, groups or HEADS, per_key)] * LAYERS
    _assert_same_step(native, unfused, exact=False)
    seen.clear()
    reference = _step(_config(masked_softmax_fusion=True, attention_dropout=0.0, fused_kernels_cpu_impl="reference",
                              num_query_groups=groups), attention_mask)
    assert not seen
    _assert_same_step(reference, unfused, exact=False)


def test_the_cpu_implementation_comes_from_the_config_and_other_devices_choose_their_own():
    config = _config(fused_kernels_cpu_impl="compiled")
    assert fused_impl(config, torch.zeros(1)) == "compiled"
    assert fused_impl(config, torch.zeros(1, device="meta")) is None  # e.g. CUDA: Triton, or MEGATRON_FUSED_IMPL
    with pytest.raises(ValueError, match="fused_kernels_cpu_impl"):
        _config(fused_kernels_cpu_impl="triton")


# ---------------------------------------------------------------- (c) the compiled CPU path


@pytest.mark.slow
def test_compiled_cpu_impl_matches_reference():
    # One small case: the first call of each op pays torch.compile's start-up (seconds).
    on = {name: True for name in FUSIONS}
    small = dict(num_layers=1, **on)
    compiled = _step(_config(fused_kernels_cpu_impl="compiled", **small))
    reference = _step(_config(**small))
    _assert_same_step(compiled, reference, exact=False, atol=1e-5)
    assert fused_kernels.select_implementation("bias_gelu", "cpu", "compiled") == "compiled"


# ---------------------------------------------------------------- (d) the flags reach the config


def test_fusion_flags_parse_into_the_config(single_process):
    config = core_transformer_config_from_args(parse_and_validate_args(argv=TINY_RUN))
    assert all(getattr(config, name) for name in FUSIONS) and config.fused_kernels_cpu_impl == "native"
    flags = ("--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm "
             "--no-gradient-accumulation-fusion --fused-kernels-cpu-impl compiled").split()
    args = parse_and_validate_args(argv=TINY_RUN + flags)
    config = core_transformer_config_from_args(args)
    assert not any(getattr(config, name) for name in FUSIONS) and config.fused_kernels_cpu_impl == "compiled"
    assert args.persist_layer_norm is False and args.gradient_accumulation_fusion is False
    assert config.gradient_accumulation_fusion is False


def test_persist_layer_norm_and_gradient_accumulation_fusion_defaults(single_process):
    args = parse_args(argv=TINY_RUN)
    assert args.persist_layer_norm is True  # Megatron's default; no effect here
    assert args.gradient_accumulation_fusion is True  # Megatron's default
    with pytest.raises(SystemExit):
        parse_args(argv=TINY_RUN + ["--fused-kernels-cpu-impl", "triton"])
