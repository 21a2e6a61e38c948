"""megatron-core's MoE GPTModel (0.16.1, local spec, run on CPU) and ours: one state dict, the same
logits, loss, balancing-loss values and gradients, both ways.

One megatron-core snippet (tests/mcore_reference.py) builds megatron-core's GPTModel with
get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm") (every
layer MoE): top-2 softmax router with the aux loss and the z-loss, SwiGLU experts, RMSNorm, RoPE,
query groups, no bias, untied output layer, fp32, dropout 0. It perturbs the weights (norms away
from 1, so a mix-up shows), and for each token dispatcher (allgather, alltoall: both run on one
rank) runs one training step on a fixed batch: loss = mean of the per-token losses, backward with
MoEAuxLossAutoScaler's scale 1 (ours: AuxLossAutoScaler.set_loss_scale(1)), so every gradient holds
the aux-loss and z-loss terms too. It saves the per-token losses, the logits (a no-grad forward,
which adds no balancing losses in either), the per-layer values of its aux-losses tracker
(get_moe_layer_wise_logging_tracker: load_balancing_loss and z_loss, without their coefficients) and
every gradient. Then it loads *our* model's state dict (saved by the fixture first) into a fresh
megatron-core model and saves the same outputs.

The tests load megatron-core's state dict strictly into our GPTModel (the same keys and shapes;
megatron-core adds only `_extra_state` entries, None for its own linears, which are dropped) and
compare in fp32 against our values: logits, loss, the balancing losses from
megatron.core.aux_losses.collect, and all gradients (the router's hold the aux-loss gradient).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core import aux_losses
from megatron.core.aux_losses import AuxLossAutoScaler
from megatron.model import GPTModel, TransformerConfig
from tests.mcore_reference import require_mcore, run_mcore

VOCAB, SEQ, BATCH = 128, 12, 3
# the same keyword arguments for megatron-core's TransformerConfig and ours
SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
             num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
             moe_router_load_balancing_type="aux_loss", normalization="RMSNorm", gated_linear_unit=True,
             add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5,
             init_method_std=0.2)
DISPATCHERS = ("allgather", "alltoall")
LOSSES = ("load_balancing_loss", "z_loss")

MCORE_MOE = '''
import torch, torch.nn.functional as F
patch_for_cpu()
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_utils import (MoEAuxLossAutoScaler, clear_aux_losses_tracker,
                                                     get_moe_layer_wise_logging_tracker)
from megatron.core.transformer.transformer_config import TransformerConfig
init_one_rank(1234)
batch = torch.load("@DIR@/batch.pt")
MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))

def build(dispatcher):
    config = TransformerConfig(**@SHAPE@, activation_func=F.silu, apply_rope_fusion=False,
                               moe_token_dispatcher_type=dispatcher, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=@VOCAB@, max_sequence_length=@SEQ@, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)

def perturb(model):
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)

def step(model):
    """One training step's numbers (module doc)."""
    model.train()
    model.zero_grad()
    clear_aux_losses_tracker()
    losses = model(batch["tokens"], None, None, labels=batch["labels"])  # [b, s]
    losses.mean().backward()
    tracker = get_moe_layer_wise_logging_tracker()
    with torch.no_grad():
        logits = model(batch["tokens"], None, None)  # [b, s, v]
    return {"losses": losses.detach(), "logits": logits,
            "aux": {name: tracker[name]["values"].clone() for name in @LOSSES@},
            "grads": {name: param.grad.clone() for name, param in model.named_parameters()}}

def load_ours(model):
    missing, unexpected = model.load_state_dict(torch.load("@DIR@/ours.pt"), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)

model = build("allgather")
perturb(model)
state = model.state_dict()
out = {"state": state}
for dispatcher in @DISPATCHERS@:
    theirs = build(dispatcher)
    theirs.load_state_dict(state)
    out[dispatcher] = step(theirs)
    theirs = build(dispatcher)
    load_ours(theirs)
    out["ours_in_mcore_" + dispatcher] = step(theirs)
torch.save(out, "@DIR@/mcore.pt")
'''


def _snippet(folder) -> str:
    template = MCORE_MOE
    for key, value in {"@DIR@": folder, "@SHAPE@": repr(SHAPE), "@VOCAB@": VOCAB, "@SEQ@": SEQ,
                       "@DISPATCHERS@": repr(DISPATCHERS), "@LOSSES@": repr(LOSSES)}.items():
        template = template.replace(key, str(value))
    return template


def _batch():
    gen = torch.Generator().manual_seed(3)
    return {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
            "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)}


def _ours(dispatcher: str, **overrides) -> GPTModel:
    config = TransformerConfig(**{**SHAPE, **overrides}, activation_func=F.silu, moe_token_dispatcher_type=dispatcher)
    return GPTModel(config, VOCAB, SEQ, position_embedding_type="rope", share_embeddings_and_output_weights=False)


def _perturb(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)


def _step(model: GPTModel, batch) -> dict:
    """Our side of the snippet's step(): per-token losses, logits, balancing losses, gradients."""
    model.train()
    model.zero_grad()
    aux_losses.clear()
    AuxLossAutoScaler.set_loss_scale(1.0)
    losses = model(batch["tokens"], None, labels=batch["labels"])  # [b, s]
    losses.mean().backward()
    stats = aux_losses.collect(list(LOSSES), model.config.num_layers, model.config.num_moe_experts,
                               data_parallel_size=1, num_microbatches=1)
    with torch.no_grad():
        logits = model(batch["tokens"], None)  # [b, s, v]
    return {"losses": losses.detach(), "logits": logits,
            "aux": {name: stats.losses[name].to(torch.float32) for name in LOSSES},
            "grads": {name: param.grad.clone() for name, param in model.named_parameters()}}


def _strip_extra_state(state):
    extra = [k for k in state if k.endswith("_extra_state")]
    assert all(state[k] is None or torch.is_tensor(state[k]) and state[k].numel() == 0 for k in extra)
    return {k: v for k, v in state.items() if k not in extra}


def _assert_same_step(ours, reference):
    for name in ("losses", "logits"):
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-5, msg=name)
    for name in LOSSES:
        assert reference["aux"][name].abs().min() > 0  # each layer recorded its value
        torch.testing.assert_close(ours["aux"][name], reference["aux"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert set(ours["grads"]) == set(reference["grads"])
    for name, grad in ours["grads"].items():
        torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def mcore_runs(tmp_path_factory):
    require_mcore()
    folder = tmp_path_factory.mktemp("mcore_moe")
    batch = _batch()
    torch.save(batch, folder / "batch.pt")
    torch.manual_seed(11)
    ours = _ours("allgather")  # the weights do not depend on the dispatcher
    _perturb(ours)
    torch.save(ours.state_dict(), folder / "ours.pt")
    run_mcore(_snippet(folder))
    return torch.load(folder / "mcore.pt"), batch, ours.state_dict()


def test_megatron_core_moe_state_dict_has_our_keys_and_shapes(mcore_runs):
    saved, _, ours = mcore_runs
    state = _strip_extra_state(saved["state"])
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in ours.items()}
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in state
    assert tuple(state["decoder.layers.0.mlp.router.weight"].shape) == (SHAPE["num_moe_experts"], SHAPE["hidden_size"])


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_megatron_core_moe_loads_strictly_and_gives_its_step(mcore_runs, dispatcher):
    """megatron-core's weights in our model: its logits, loss, balancing losses and gradients."""
    saved, batch, _ = mcore_runs
    model = _ours(dispatcher)
    model.load_state_dict(_strip_extra_state(saved["state"]), strict=True)
    _assert_same_step(_step(model, batch), saved[dispatcher])


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_our_moe_in_megatron_core_gives_our_step(mcore_runs, dispatcher):
    """Our weights in megatron-core's model (loaded with only its _extra_state entries missing):
    our logits, loss, balancing losses and gradients."""
    saved, batch, ours = mcore_runs
    model = _ours(dispatcher)
    model.load_state_dict(ours, strict=True)
    _assert_same_step(_step(model, batch), saved["ours_in_mcore_" + dispatcher])


def test_the_balancing_losses_reach_the_router_gradient(mcore_runs):
    """Without the aux and z losses the router gradients differ (else the gradient check proves
    nothing about them)."""
    saved, batch, _ = mcore_runs
    model = _ours("allgather", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    model.load_state_dict(_strip_extra_state(saved["state"]), strict=True)
    plain = _step(model, batch)["grads"]["decoder.layers.0.mlp.router.weight"]
    assert not torch.allclose(plain, saved["allgather"]["grads"]["decoder.layers.0.mlp.router.weight"],
                              rtol=1e-4, atol=1e-6)
