"""Activation recompute on one process: selective (core attention), full uniform and full block give
the loss and gradients of the run without recompute, bit for bit, with dropout on.

Recompute reruns the same ops on the same inputs with every generator set back to its forward
state, so the comparison is torch.equal, not a tolerance. A control shows the comparison can fail:
with the RNG restore disabled, the recomputed dropout masks differ and so do the gradients.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.tensor_parallel import random as tp_random
from megatron.model import Float16Module, GPTModel, TransformerConfig
from megatron.model.transformer_block import TransformerBlock

VOCAB, SEQ, BATCH, HIDDEN, HEADS, LAYERS, SEED = 96, 16, 2, 32, 4, 4, 1234

MODES = {
    "selective": dict(recompute_granularity="selective"),
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "full-block-3": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    "full-block-all": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=LAYERS),
}


def _config(**overrides) -> TransformerConfig:
    kwargs = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.2,
                  attention_dropout=0.2)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _model(config: TransformerConfig, position_embedding_type: str = "learned_absolute") -> torch.nn.Module:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type=position_embedding_type)
    return Float16Module(config, model) if config.bf16 else model


def _loss_and_grads(config: TransformerConfig, steps: int = 2, position_embedding_type: str = "learned_absolute"):
    """Two micro-batches of forward + backward (gradients accumulate); the dropout seed is fixed."""
    model = _model(config, position_embedding_type)
    generator = torch.Generator().manual_seed(7)
    torch.manual_seed(99)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        loss = model(tokens[:, :-1], positions, labels=tokens[:, 1:]).mean()
        loss.backward()
        losses.append(loss.detach())
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    return torch.stack(losses), grads, torch.get_rng_state()


def _assert_identical(expected, actual) -> None:
    assert torch.equal(expected[0], actual[0]), (expected[0], actual[0])
    differ = [name for name, grad in expected[1].items() if not torch.equal(grad, actual[1][name])]
    assert not differ, differ
    assert torch.equal(expected[2], actual[2])  # the generator ends where it would without recompute


@pytest.fixture(scope="module")
def reference():
    return _loss_and_grads(_config())


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_recompute_equals_no_recompute_with_dropout(reference, mode):
    _assert_identical(reference, _loss_and_grads(_config(**MODES[mode])))


@pytest.mark.parametrize("mode", ["selective", "full-uniform-2", "full-block-3"])
def test_recompute_equals_no_recompute_in_bf16(mode):
    _assert_identical(_loss_and_grads(_config(bf16=True, params_dtype=torch.bfloat16)),
                      _loss_and_grads(_config(bf16=True, params_dtype=torch.bfloat16, **MODES[mode])))


# A Llama-style layer: RMSNorm, SwiGLU, grouped K/V, QK norm, no biases; RoPE or ALiBi reach the
# recomputed layers through the checkpoint's arguments.
LLAMA = dict(normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
             num_query_groups=2, qk_layernorm=True)


@pytest.mark.parametrize("position", ["rope", "alibi"])
@pytest.mark.parametrize("mode", ["selective", "full-uniform-2", "full-block-1"])
def test_llama_layers_recompute_bit_for_bit(mode, position):
    _assert_identical(_loss_and_grads(_config(**LLAMA), position_embedding_type=position),
                      _loss_and_grads(_config(**LLAMA, **MODES[mode]), position_embedding_type=position))


def test_dropout_is_on_and_the_rng_restore_is_what_makes_the_gradients_equal(reference, monkeypatch):
    no_dropout = _loss_and_grads(_config(hidden_dropout=0.0, attention_dropout=0.0))
    assert not torch.equal(no_dropout[0], reference[0])
    one_step = _loss_and_grads(_config(), steps=1)
    monkeypatch.setattr(tp_random, "_set_rng_states", lambda states: None)
    for mode in ("selective", "full-uniform-1"):
        broken = _loss_and_grads(_config(**MODES[mode]), steps=1)
        assert torch.equal(broken[0], one_step[0])  # the forward is untouched ...
        assert any(not torch.equal(g, broken[1][n]) for n, g in one_step[1].items())  # ... the recompute is not


def _count_checkpoints(model: torch.nn.Module, train: bool, grad: bool, monkeypatch) -> int:
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    model.train(train)
    calls = []
    original = tensor_parallel.checkpoint
    monkeypatch.setattr(tensor_parallel, "checkpoint", lambda *args: calls.append(1) or original(*args))
    with torch.set_grad_enabled(grad):
        model(tokens, positions)
    monkeypatch.undo()
    return len(calls)


@pytest.mark.parametrize("mode, units", [("selective", LAYERS), ("full-uniform-2", LAYERS // 2),
                                         ("full-block-3", 3), ("full-uniform-1", LAYERS)])
def test_recompute_units_and_only_when_training_with_grad(mode, units, monkeypatch):
    model = _model(_config(**MODES[mode]))
    assert _count_checkpoints(model, True, True, monkeypatch) == units
    assert _count_checkpoints(model, False, True, monkeypatch) == 0  # eval
    assert _count_checkpoints(model, True, False, monkeypatch) == 0  # no_grad


def test_checkpoint_restores_every_generator_and_passes_non_tensor_args():
    tensor_parallel.model_parallel_cuda_manual_seed(5)

    def function(x, mask, scale):
        assert mask is None
        y = F.dropout(x, 0.5) * scale  # the default generator
        with get_cuda_rng_tracker().fork():
            y = F.dropout(y, 0.5)  # the tracker's model-parallel stream
        return y.sin()

    x = torch.randn(8, 4, requires_grad=True)
    states = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
    function(x, None, 3.0).sum().backward()
    expected_grad, expected_states = x.grad.clone(), (torch.get_rng_state(), get_cuda_rng_tracker().get_states())

    x.grad = None
    torch.set_rng_state(states[0])
    get_cuda_rng_tracker().set_states(states[1])
    out = tensor_parallel.checkpoint(function, False, x, None, 3.0)
    torch.randn(100)  # draws between forward and backward (other micro-batches) must not matter
    with get_cuda_rng_tracker().fork():
        torch.randn(100)
    after_forward = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
    out.sum().backward()
    assert torch.equal(x.grad, expected_grad)
    assert torch.equal(torch.get_rng_state(), after_forward[0])  # backward leaves the generators as it found them
    assert all(torch.equal(s, after_forward[1][k]) for k, s in get_cuda_rng_tracker().get_states().items())
    assert not torch.equal(after_forward[0], expected_states[0])


def test_distributing_over_one_tensor_parallel_rank_keeps_the_input_whole():
    x = torch.randn(6, 2, 4, requires_grad=True) * 1.0
    out = tensor_parallel.checkpoint(torch.tanh, True, x)
    assert x.shape == (6, 2, 4)  # nothing to split it over
    out.sum().backward()


def test_checkpoint_refuses_autograd_grad():
    x = torch.randn(3, requires_grad=True)
    out = tensor_parallel.checkpoint(lambda t: t.exp(), False, x)
    with pytest.raises(RuntimeError, match="torch.autograd.backward"):
        torch.autograd.grad(out.sum(), x)


BAD_CONFIGS = [
    (dict(recompute_granularity="full", recompute_num_layers=1),
     'recompute_granularity full needs recompute_method "uniform" or "block"'),
    (dict(recompute_granularity="full", recompute_method="uniform"),
     "recompute_granularity full needs recompute_num_layers between 1 and the"),
    (dict(recompute_granularity="partial"), 'recompute_granularity must be "full" or "selective"'),
    (dict(recompute_granularity="selective", recompute_method="block"),
     "recompute_method: recompute method is not yet supported for selective recomputing granularity"),
    (dict(recompute_num_layers=1), "recompute_num_layers needs recompute_granularity full"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=0),
     "recompute_num_layers must be a positive integer"),
    (dict(recompute_granularity="selective", distribute_saved_activations=True, tensor_model_parallel_size=2),
     "distribute_saved_activations: distributed recompute activations is only applicable to full"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1, sequence_parallel=True,
          distribute_saved_activations=True, tensor_model_parallel_size=2),
     "distribute_saved_activations cannot be combined with sequence_parallel"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS)
def test_config_rejects_inconsistent_recompute_fields(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


@pytest.mark.parametrize("method, size, message", [
    ("uniform", 3, "must divide the 4 layers of each pipeline stage"),
    ("block", 5, "between 1 and the 4 layers of each pipeline stage (model chunk), got 5")])
def test_the_config_checks_recompute_num_layers_against_each_stage(method, size, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _config(recompute_granularity="full", recompute_method=method, recompute_num_layers=size)
    config = _config(recompute_granularity="full", recompute_method=method, recompute_num_layers=size,
                     num_layers=2 * size if method == "block" else 3)
    TransformerBlock(config)


def test_pretrain_gpt_trains_to_the_same_losses_with_the_recompute_flags(capsys):
    import pretrain_gpt
    from tests.helpers.training import MOCK, TINY

    argv = [*TINY, *MOCK, "--eval-iters", "0", "--train-iters", "3"]  # dropout 0.1 (the default)
    runs = {}
    try:
        for name, flags in {"none": [], "selective": ["--recompute-activations"],
                            "uniform": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
                            "block": "--recompute-granularity full --recompute-method block --recompute-num-layers 1"
                            }.items():
            result = pretrain_gpt.main(argv + (flags.split() if isinstance(flags, str) else flags),
                                       record_history=True)
            runs[name] = [record.losses["lm loss"] for record in result.history]
    finally:
        from megatron.training.initialize import _destroy_distributed

        _destroy_distributed()  # in-process runs leave the (1-rank) process group for the next tests otherwise
    capsys.readouterr()
    assert len(runs["none"]) == 3 and all(losses == runs["none"] for losses in runs.values()), runs
