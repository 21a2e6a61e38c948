"""megatron-core's MoE GPTModel (0.16.1, local specs, run on CPU) and ours: one state dict, the same
logits, loss, balancing-loss values and gradients, both ways.

One megatron-core snippet (tests/helpers/mcore_reference.py) builds megatron-core's GPTModel for each of
VARIANTS: "top2" from get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False,
normalization="RMSNorm") (every layer MoE; top-2 softmax router, aux loss and z-loss), and two from
get_gpt_decoder_block_spec(config, use_transformer_engine=False) (a dense layer then an MoE layer
with a shared expert, capacity dropping by probs, pre-softmax, seq_aux_loss; a sigmoid top-3 router
with a scaling factor). All have SwiGLU experts, RMSNorm, RoPE, query groups, no bias, an untied
output layer, fp32, dropout 0. The snippet perturbs the weights (norms away from 1, so a mix-up
shows), and for each token dispatcher (allgather, alltoall: both run on one rank) runs one training
step on a fixed batch: loss = mean of the per-token losses, backward with MoEAuxLossAutoScaler's
scale 1 (ours: AuxLossAutoScaler.set_loss_scale(1)), so every gradient, the router's included,
holds the aux-loss and z-loss terms. It saves the per-token losses, the logits (a no-grad forward,
which adds no balancing losses in either), the per-layer values of its aux-losses tracker
(get_moe_layer_wise_logging_tracker, without the coefficients) and every gradient; then loads *our*
model's state dict (saved by the fixture first) into a fresh megatron-core model and saves the same.

The tests load megatron-core's state dict strictly into our GPTModel (the same keys and shapes;
megatron-core adds only `_extra_state` entries, None for its own linears, which are dropped; loading
ours into megatron-core misses only those) and compare in fp32 (rel 1e-5) with our values: logits,
loss, the balancing losses from megatron.core.aux_losses.collect, all gradients.

Capacity dropping is also compared function to function (apply_router_token_dropping against our
drop_tokens): the "probs" policy agrees; the "position" policy differs by design -- megatron-core's
keeps whichever routed tokens torch.topk's tie order gives, ours the first C (see that test).
The CPU patches megatron-core's MoE needs are in bench/mcore_cpu_patches.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core import aux_losses
from megatron.core.aux_losses import AuxLossAutoScaler
from megatron.model import GPTModel, TransformerConfig
from megatron.model.moe.router import drop_tokens, expert_capacity
from tests.helpers.mcore_reference import require_mcore, run_mcore

VOCAB, SEQ, BATCH = 128, 12, 3
# the same keyword arguments for megatron-core's TransformerConfig and ours
SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
             num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
             moe_router_load_balancing_type="aux_loss", normalization="RMSNorm", gated_linear_unit=True,
             add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5,
             init_method_std=0.2)
# name -> (overrides of SHAPE, the tracker's loss names). "top2" is built from megatron-core's
# get_gpt_layer_local_spec (every layer MoE), the others from get_gpt_decoder_block_spec (which
# reads moe_layer_freq) with use_transformer_engine=False: its local layer specs.
VARIANTS = {
    "top2": ({}, ("load_balancing_loss", "z_loss")),
    # layer 1 dense, layer 2 MoE with a shared expert; expert capacity 1.0 drops tokens (C = 18 of the
    # 36 tokens x 2 choices over 4 experts); softmax over all experts before the top-k
    "dense-then-moe-shared-capacity-seq-aux": (
        dict(moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=40, moe_ffn_hidden_size=24,
             moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs", moe_router_pre_softmax=True,
             moe_router_load_balancing_type="seq_aux_loss"),
        ("seq_load_balancing_loss", "z_loss")),
    "sigmoid-scaled-top3": (
        dict(moe_router_score_function="sigmoid", moe_router_topk=3, moe_router_topk_scaling_factor=2.5),
        ("load_balancing_loss", "z_loss")),
}
DISPATCHERS = ("allgather", "alltoall")

MCORE_MOE = '''
import torch, torch.nn.functional as F
patch_for_cpu()
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_utils import (MoEAuxLossAutoScaler, clear_aux_losses_tracker,
                                                     get_moe_layer_wise_logging_tracker)
from megatron.core.transformer.transformer_config import TransformerConfig
init_one_rank(1234)
batch = torch.load("@DIR@/batch.pt")
MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))

def build(variant, dispatcher):
    config = TransformerConfig(**{**@SHAPE@, **@VARIANTS@[variant][0]}, activation_func=F.silu,
                               apply_rope_fusion=False, moe_token_dispatcher_type=dispatcher,
                               use_cpu_initialization=True)
    if variant == "top2":
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                        normalization="RMSNorm")
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=@VOCAB@, max_sequence_length=@SEQ@, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)

def perturb(model):
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)

def step(model, names):
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
            "aux": {name: tracker[name]["values"].clone() for name in names},
            "grads": {name: param.grad.clone() for name, param in model.named_parameters()}}

def load_ours(model, variant):
    missing, unexpected = model.load_state_dict(torch.load("@DIR@/ours_" + variant + ".pt"), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)

out = {}
for variant, (_, names) in @VARIANTS@.items():
    model = build(variant, "allgather")
    perturb(model)
    state = model.state_dict()
    out[variant] = {"state": state}
    for dispatcher in @DISPATCHERS@:
        theirs = build(variant, dispatcher)
        theirs.load_state_dict(state)
        out[variant][dispatcher] = step(theirs, names)
        theirs = build(variant, dispatcher)
        load_ours(theirs, variant)
        out[variant]["ours_in_mcore_" + dispatcher] = step(theirs, names)
from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping, topk_routing_with_score_function
probs, routing_map = topk_routing_with_score_function(batch["drop_logits"], 2, score_function="softmax")
out["drop"] = {"input": (probs, routing_map)}
for policy in ("probs", "position"):
    for pad in (False, True):
        out["drop"][policy, pad] = apply_router_token_dropping(probs, routing_map, router_topk=2, capacity_factor=1.0,
                                                               drop_policy=policy, pad_to_capacity=pad)
torch.save(out, "@DIR@/mcore.pt")
'''


def _snippet(folder) -> str:
    template = MCORE_MOE
    for key, value in {"@DIR@": folder, "@SHAPE@": repr(SHAPE), "@VOCAB@": VOCAB, "@SEQ@": SEQ,
                       "@DISPATCHERS@": repr(DISPATCHERS), "@VARIANTS@": repr(VARIANTS)}.items():
        template = template.replace(key, str(value))
    return template


def _batch():
    gen = torch.Generator().manual_seed(3)
    return {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
            "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
            "drop_logits": torch.randn(40, 4, generator=gen) * 2}  # [T, E] for the token-dropping checks


def _ours(variant: str, dispatcher: str, **overrides) -> GPTModel:
    config = TransformerConfig(**{**SHAPE, **VARIANTS[variant][0], **overrides}, activation_func=F.silu,
                               moe_token_dispatcher_type=dispatcher)
    return GPTModel(config, VOCAB, SEQ, position_embedding_type="rope", share_embeddings_and_output_weights=False)


def _perturb(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)


def _step(model: GPTModel, batch, names) -> dict:
    """Our side of the snippet's step(): per-token losses, logits, balancing losses, gradients."""
    model.train()
    model.zero_grad()
    aux_losses.clear()
    AuxLossAutoScaler.set_loss_scale(1.0)
    losses = model(batch["tokens"], None, labels=batch["labels"])  # [b, s]
    losses.mean().backward()
    stats = aux_losses.collect(list(names), model.config.num_layers, model.config.num_moe_experts,
                               data_parallel_size=1, num_microbatches=1)
    with torch.no_grad():
        logits = model(batch["tokens"], None)  # [b, s, v]
    dropped = (stats.routed - stats.kept).sum(1) if stats.routed is not None else None  # [L] tokens
    return {"losses": losses.detach(), "logits": logits, "dropped": dropped,
            "aux": {name: stats.losses[name].to(torch.float32) for name in names},
            "grads": {name: param.grad.clone() for name, param in model.named_parameters()}}


def _strip_extra_state(state):
    extra = [k for k in state if k.endswith("_extra_state")]
    assert all(state[k] is None or torch.is_tensor(state[k]) and state[k].numel() == 0 for k in extra)
    return {k: v for k, v in state.items() if k not in extra}


def _assert_same_step(ours, reference, moe_layers):
    for name in ("losses", "logits"):
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-5, msg=name)
    assert set(ours["aux"]) == set(reference["aux"])
    for name in ours["aux"]:
        assert (reference["aux"][name] != 0).tolist() == moe_layers  # each MoE layer recorded its value
        torch.testing.assert_close(ours["aux"][name], reference["aux"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert set(ours["grads"]) == set(reference["grads"])
    for name, grad in ours["grads"].items():
        torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-5, atol=_grad_atol(reference["grads"][name]),
                                   msg=name)


def _grad_atol(reference: torch.Tensor) -> float:
    """fp32 round-off relative to a gradient's scale. The embedding's rows sum every position's
    gradient (entries up to ~0.5); its small entries carry a few 1e-7 of round-off from the large
    ones, which varies from run to run (threaded reductions) and with the CPU kind."""
    return max(1e-6, 1e-5 * reference.abs().max().item())


@pytest.fixture(scope="module")
def mcore_runs(tmp_path_factory):
    require_mcore()
    folder = tmp_path_factory.mktemp("mcore_moe")
    batch = _batch()
    torch.save(batch, folder / "batch.pt")
    ours = {}
    for variant in VARIANTS:
        torch.manual_seed(11)
        model = _ours(variant, "allgather")  # the weights do not depend on the dispatcher
        _perturb(model)
        ours[variant] = model.state_dict()
        torch.save(ours[variant], folder / f"ours_{variant}.pt")
    run_mcore(_snippet(folder))
    return torch.load(folder / "mcore.pt"), batch, ours


def _moe_layers(variant: str) -> list[bool]:
    config = TransformerConfig(**{**SHAPE, **VARIANTS[variant][0]})
    return [config.is_moe_layer(n) for n in range(1, config.num_layers + 1)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_megatron_core_moe_state_dict_has_our_keys_and_shapes(mcore_runs, variant):
    saved, _, ours = mcore_runs
    state = _strip_extra_state(saved[variant]["state"])
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in ours[variant].items()}
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in state
    assert tuple(state["decoder.layers.1.mlp.router.weight"].shape) == (SHAPE["num_moe_experts"], SHAPE["hidden_size"])
    if VARIANTS[variant][0].get("moe_shared_expert_intermediate_size"):
        assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in state
        assert "decoder.layers.0.mlp.linear_fc1.weight" in state  # the dense layer


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_megatron_core_moe_loads_strictly_and_gives_its_step(mcore_runs, variant, dispatcher):
    """megatron-core's weights in our model: its logits, loss, balancing losses and gradients."""
    saved, batch, _ = mcore_runs
    model = _ours(variant, dispatcher)
    model.load_state_dict(_strip_extra_state(saved[variant]["state"]), strict=True)
    ours = _step(model, batch, VARIANTS[variant][1])
    _assert_same_step(ours, saved[variant][dispatcher], _moe_layers(variant))
    if VARIANTS[variant][0].get("moe_expert_capacity_factor"):
        assert ours["dropped"][1] > 0  # the capacity dropped tokens, so the check covers it


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_our_moe_in_megatron_core_gives_our_step(mcore_runs, variant, dispatcher):
    """Our weights in megatron-core's model (loaded with only its _extra_state entries missing):
    our logits, loss, balancing losses and gradients."""
    saved, batch, ours = mcore_runs
    model = _ours(variant, dispatcher)
    model.load_state_dict(ours[variant], strict=True)
    _assert_same_step(_step(model, batch, VARIANTS[variant][1]), saved[variant]["ours_in_mcore_" + dispatcher],
                      _moe_layers(variant))


def test_the_balancing_losses_reach_the_router_gradient(mcore_runs):
    """Without the aux and z losses the router gradients differ (else the gradient check proves
    nothing about them)."""
    saved, batch, _ = mcore_runs
    model = _ours("top2", "allgather", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    model.load_state_dict(_strip_extra_state(saved["top2"]["state"]), strict=True)
    plain = _step(model, batch, ())["grads"]["decoder.layers.0.mlp.router.weight"]
    reference = saved["top2"]["allgather"]["grads"]["decoder.layers.0.mlp.router.weight"]
    assert not torch.allclose(plain, reference, rtol=1e-4, atol=10 * _grad_atol(reference))  # 10x the check's


def test_capacity_dropping_by_probs_is_megatron_cores(mcore_runs):
    """apply_router_token_dropping's "probs" policy (top-C weights per expert) and ours keep the same
    tokens; padded to capacity, both run C tokens per expert with the same weights (which zero-weight
    tokens fill an expert up is a tie, broken differently: torch.topk's order against our stable sort)."""
    saved = mcore_runs[0]["drop"]
    probs, routing_map = saved["input"]
    capacity = expert_capacity(probs.shape[0], 2, probs.shape[1], 1.0)
    assert (routing_map.sum(0) > capacity).any() and (routing_map.sum(0) < capacity).any()  # drops and pads
    ours = drop_tokens(probs, routing_map, 2, 1.0, "probs", pad_to_capacity=False)
    torch.testing.assert_close(ours[0], saved["probs", False][0], rtol=0, atol=0)
    assert torch.equal(ours[1], saved["probs", False][1])
    ours = drop_tokens(probs, routing_map, 2, 1.0, "probs", pad_to_capacity=True)
    torch.testing.assert_close(ours[0], saved["probs", True][0], rtol=0, atol=0)
    assert ours[1].sum(0).tolist() == saved["probs", True][1].sum(0).tolist() == [capacity] * probs.shape[1]
    assert torch.equal(ours[1] & routing_map, saved["probs", True][1] & routing_map)


def test_capacity_dropping_by_position_keeps_the_first_tokens_where_megatron_core_ties(mcore_runs):
    """A difference, megatron-core's: its "position" policy takes torch.topk(routing_map.int(), C,
    dim=0, sorted=False), a top-k of 0/1 values, so which of an expert's routed tokens it keeps is
    torch.topk's tie order (on CPU not the first ones); ours keeps the first C (the policy's name,
    and Megatron's documentation: drop by position in the sequence). Both keep min(routed, C) tokens per
    expert, all routed ones, with their weights."""
    saved = mcore_runs[0]["drop"]
    probs, routing_map = saved["input"]
    capacity = expert_capacity(probs.shape[0], 2, probs.shape[1], 1.0)
    theirs_probs, theirs_map = saved["position", False]
    ours_probs, ours_map = drop_tokens(probs, routing_map, 2, 1.0, "position", pad_to_capacity=False)
    assert ours_map.sum(0).tolist() == theirs_map.sum(0).tolist() == routing_map.sum(0).clamp(max=capacity).tolist()
    assert not (theirs_map & ~routing_map).any()
    torch.testing.assert_close(theirs_probs, probs * theirs_map, rtol=0, atol=0)
    torch.testing.assert_close(ours_probs, probs * ours_map, rtol=0, atol=0)
    first = routing_map & (routing_map.long().cumsum(0) <= capacity)  # the first C routed tokens per expert
    assert torch.equal(ours_map, first)
    # on this input (torch's CPU topk) megatron-core keeps later tokens of experts 0 and 3 instead
    assert not torch.equal(theirs_map, first), "megatron-core's position policy now keeps the first tokens"


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_our_grouped_gemm_gives_megatron_cores_step(mcore_runs, dispatcher):
    """--moe-grouped-gemm changes only our computation: megatron-core's (sequential) experts' weights
    in our grouped-GEMM experts give its step too."""
    saved, batch, _ = mcore_runs
    model = _ours("top2", dispatcher, moe_grouped_gemm=True)
    model.load_state_dict(_strip_extra_state(saved["top2"]["state"]), strict=True)
    _assert_same_step(_step(model, batch, VARIANTS["top2"][1]), saved["top2"][dispatcher], _moe_layers("top2"))
