"""Group-limited routing and the aux-loss-free expert bias against megatron-core 0.16.1 (run on CPU
through tests/helpers/mcore_reference.py).

One megatron-core snippet computes, on the same logits [T, E] (E = 8 experts, 4 groups of 2):
topk_routing_with_score_function for each of CASES (group-limited softmax, pre-softmax, sigmoid; the
expert bias alone and with groups); and a whole TopKRouter (sigmoid, groups, expert bias, z-loss,
our weight and a nonzero bias) run on two micro-batches in training, its counts, then
finalize_model_grads' _update_router_expert_bias (the all-reduce over a one-rank group), giving the
updated bias. The tests compare ours (topk_routing, TopKRouter, update_router_expert_bias) with it,
and check that the cases are not trivial (the groups and the bias change the routing).
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.distributed.finalize_model_grads import update_router_expert_bias
from megatron.model import TransformerConfig
from megatron.model.moe.router import TopKRouter, topk_routing
from tests.helpers.mcore_reference import require_mcore, run_mcore

TOKENS, EXPERTS, HIDDEN, RATE = 48, 8, 16, 0.01
# name -> keyword arguments of topk_routing_with_score_function (megatron-core's names)
CASES = {
    "groups-softmax": dict(topk=4, num_groups=4, group_topk=2),
    "groups-pre-softmax": dict(topk=4, num_groups=4, group_topk=2, use_pre_softmax=True, scaling_factor=2.0),
    "groups-sigmoid": dict(topk=4, num_groups=4, group_topk=2, score_function="sigmoid"),
    "groups-sigmoid-one-group": dict(topk=2, num_groups=4, group_topk=1, score_function="sigmoid"),
    "bias-sigmoid": dict(topk=2, score_function="sigmoid", expert_bias=True),
    "bias-groups-sigmoid": dict(topk=4, num_groups=4, group_topk=2, score_function="sigmoid", expert_bias=True,
                                scaling_factor=2.5),
}
ROUTER = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS, moe_router_topk=4,
              moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
              moe_router_enable_expert_bias=True, moe_router_bias_update_rate=RATE,
              moe_router_load_balancing_type="none", moe_z_loss_coeff=1e-3, add_bias_linear=False)

MCORE = '''
import torch
patch_for_cpu()
init_one_rank(1)
from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig
inputs = torch.load("@DIR@/inputs.pt")
out = {}
for name, kwargs in @CASES@.items():
    kwargs = dict(kwargs)
    if kwargs.pop("expert_bias", False):
        kwargs["expert_bias"] = inputs["bias"]
    out[name] = topk_routing_with_score_function(inputs["logits"], **kwargs)
config = TransformerConfig(**@ROUTER@, use_cpu_initialization=True)
router = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
router.train()
missing, unexpected = router.load_state_dict({"weight": inputs["weight"], "expert_bias": inputs["bias"]},
                                             strict=False)
assert not unexpected and not missing, (missing, unexpected)
steps = [router(x) for x in inputs["micro_batches"]]
counts = router.local_tokens_per_expert.clone()
_update_router_expert_bias([router], config)
out["router"] = {"steps": [(p.detach(), m) for p, m in steps], "counts": counts,
                 "bias": router.expert_bias.clone(), "keys": sorted(router.state_dict())}
torch.save(out, "@DIR@/mcore.pt")
'''


def _inputs():
    gen = torch.Generator().manual_seed(17)
    return {"logits": torch.randn(TOKENS, EXPERTS, generator=gen) * 2,
            "bias": torch.randn(EXPERTS, generator=gen) * 0.3,
            "weight": torch.randn(EXPERTS, HIDDEN, generator=gen),
            "micro_batches": [torch.randn(6, 2, HIDDEN, generator=gen) for _ in range(2)]}  # [s, b, h]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    require_mcore()
    folder = tmp_path_factory.mktemp("mcore_router")
    inputs = _inputs()
    torch.save(inputs, folder / "inputs.pt")
    snippet = MCORE.replace("@DIR@", str(folder)).replace("@CASES@", repr(CASES)).replace("@ROUTER@", repr(ROUTER))
    run_mcore(snippet)
    return inputs, torch.load(folder / "mcore.pt")


def _ours(inputs, case):
    kwargs = dict(CASES[case])
    bias = inputs["bias"] if kwargs.pop("expert_bias", False) else None
    return topk_routing(inputs["logits"], kwargs.pop("topk"), kwargs.pop("score_function", "softmax"),
                        kwargs.pop("use_pre_softmax", False), kwargs.pop("scaling_factor", None),
                        kwargs.pop("num_groups", None), kwargs.pop("group_topk", None), bias)


@pytest.mark.parametrize("case", CASES)
def test_routing_is_megatron_cores(reference, case):
    inputs, theirs = reference
    probs, routing_map = _ours(inputs, case)
    torch.testing.assert_close(probs, theirs[case][0], rtol=1e-6, atol=1e-7)
    assert torch.equal(routing_map, theirs[case][1])
    # the case is not trivial: without the groups and the bias the choice differs for some tokens
    plain = dict(CASES[case], expert_bias=False, num_groups=None, group_topk=None)
    kwargs = dict(plain)
    _, plain_map = topk_routing(inputs["logits"], kwargs.pop("topk"), kwargs.pop("score_function", "softmax"),
                                kwargs.pop("use_pre_softmax", False))
    assert not torch.equal(routing_map, plain_map)


def test_the_bias_chooses_the_experts_but_does_not_weight_them(reference):
    """The weights of the chosen experts are their unbiased sigmoid scores, normalised."""
    inputs = reference[0]
    probs, routing_map = _ours(inputs, "bias-sigmoid")
    scores = torch.sigmoid(inputs["logits"]) * routing_map
    torch.testing.assert_close(probs, scores / scores.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    chosen = torch.topk(torch.sigmoid(inputs["logits"]) + inputs["bias"], k=2).indices
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, chosen, True))


def test_router_counts_and_bias_update_are_megatron_cores(reference):
    """Our TopKRouter on megatron-core's weight and bias: the same probs and routing map on two
    micro-batches, the same counts, and the same bias after the update; the counts are then zero."""
    inputs, theirs = reference[0], reference[1]["router"]
    router = TopKRouter(TransformerConfig(**ROUTER), layer_number=1)
    router.train()
    router.load_state_dict({"weight": inputs["weight"], "expert_bias": inputs["bias"]}, strict=True)
    assert sorted(router.state_dict()) == theirs["keys"] == ["expert_bias", "weight"]
    for x, (probs, routing_map) in zip(inputs["micro_batches"], theirs["steps"]):
        ours = router(x)
        torch.testing.assert_close(ours[0].detach(), probs, rtol=1e-6, atol=1e-7)
        assert torch.equal(ours[1], routing_map)
    torch.testing.assert_close(router.local_tokens_per_expert, theirs["counts"], rtol=0, atol=0)
    counts = router.local_tokens_per_expert.clone()
    update_router_expert_bias([router])
    expected = inputs["bias"] + RATE * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(router.expert_bias, theirs["bias"], rtol=0, atol=1e-7)
    torch.testing.assert_close(router.expert_bias, expected, rtol=0, atol=1e-7)
    assert not torch.equal(router.expert_bias, inputs["bias"])
    assert router.local_tokens_per_expert.sum() == 0


def test_no_counts_without_autograd_and_the_bias_stays_fp32():
    """Evaluation (no autograd) adds no counts; a bf16 cast of the model keeps the bias and counts
    in fp32 (Megatron's rule: the small update steps would be lost)."""
    router = TopKRouter(TransformerConfig(**ROUTER), layer_number=1)
    x = torch.randn(4, 2, HIDDEN)
    with torch.no_grad():
        router(x)
    assert router.local_tokens_per_expert.sum() == 0
    router.to(torch.bfloat16)
    router(x.to(torch.bfloat16))
    assert router.expert_bias.dtype == router.local_tokens_per_expert.dtype == torch.float32
    assert router.local_tokens_per_expert.sum() == 8 * ROUTER["moe_router_topk"]
    assert router.state_dict()["expert_bias"].dtype == torch.float32


@pytest.mark.parametrize("fields, message", [
    (dict(moe_router_score_function="softmax"), "moe_router_enable_expert_bias.*needs.*sigmoid"),
    (dict(moe_router_num_groups=3), "num_moe_experts.*8.*divisible by.*moe_router_num_groups.*3"),
    (dict(moe_router_group_topk=5), "moe_router_group_topk.*5.*cannot exceed.*moe_router_num_groups.*4"),
    (dict(moe_router_num_groups=None), "moe_router_group_topk.*needs.*moe_router_num_groups"),
    (dict(moe_router_group_topk=None), "moe_router_num_groups.*needs.*moe_router_group_topk"),
    (dict(moe_router_topk=1), "moe_router_topk.*1.*at least.*moe_router_group_topk.*2"),
    (dict(moe_router_topk=5, moe_router_group_topk=1), "moe_router_topk.*5.*at most the chosen groups' experts"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_enable_expert_bias.*sinkhorn"),
], ids=["bias-softmax", "groups-not-dividing", "group-topk-over-groups", "no-groups", "no-group-topk",
        "topk-under-group-topk", "topk-over-chosen-experts", "bias-sinkhorn"])
def test_config_rules(fields, message):
    from megatron.model.transformer_config import ConfigRuleError

    with pytest.raises(ConfigRuleError, match=message):
        TransformerConfig(**{**ROUTER, **fields})
