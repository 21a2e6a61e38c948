"""The MoE layer on one rank: HF Mixtral's sparse MoE block with copied weights, the router's score
functions and capacity rules, and every balancing loss against a direct computation written here
from its definition (values and the gradient each adds)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core import aux_losses
from megatron.core.aux_losses import AuxLossAutoScaler
from megatron.model import GPTModel, TransformerConfig
from megatron.model.mlp import MLP
from megatron.model.moe import MoELayer
from megatron.model.moe.router import drop_tokens, expert_capacity, sinkhorn

H, FFN, E = 16, 24, 4


def _config(**overrides) -> TransformerConfig:
    fields = dict(num_layers=2, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_ffn_hidden_size=FFN,
                  add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, moe_router_topk=2,
                  hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _layer(seed: int = 0, **overrides) -> MoELayer:
    torch.manual_seed(seed)
    return MoELayer(_config(**overrides), layer_number=1)


def _x(s: int = 6, b: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(s, b, H, generator=torch.Generator().manual_seed(seed), requires_grad=True)


@pytest.fixture(autouse=True)
def _fresh_record():
    aux_losses.clear()
    AuxLossAutoScaler.set_loss_scale(1.0)
    yield
    aux_losses.clear()


# ----------------------------------------------------------------------------- HF Mixtral

def _hf_block(layer: MoELayer):
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(hidden_size=H, intermediate_size=FFN, num_local_experts=E,
                                        num_experts_per_tok=2, hidden_act="silu")
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        for e, expert in enumerate(layer.experts.local_experts):
            block.experts.gate_up_proj[e].copy_(expert.linear_fc1.weight)  # [gate ; up]
            block.experts.down_proj[e].copy_(expert.linear_fc2.weight)
    return block


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped-gemm"])
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_moe_layer_equals_hf_mixtral_sparse_moe_block(dispatcher, grouped):
    layer = _layer(moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped)
    block = _hf_block(layer)
    layer.eval(), block.eval()
    x = _x()
    ours, bias = layer(x)
    assert bias is None
    x_hf = x.detach().transpose(0, 1).contiguous().requires_grad_(True)  # HF: [b, s, h]
    theirs = block(x_hf)
    theirs = (theirs[0] if isinstance(theirs, tuple) else theirs).transpose(0, 1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(ours)
    ours.backward(grad)
    theirs.backward(grad)
    torch.testing.assert_close(x.grad, x_hf.grad.transpose(0, 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.router.weight.grad, block.gate.weight.grad, rtol=1e-5, atol=1e-6)
    for e, expert in enumerate(layer.experts.local_experts):
        torch.testing.assert_close(expert.linear_fc1.weight.grad, block.experts.gate_up_proj.grad[e], rtol=1e-5,
                                   atol=1e-6)
        torch.testing.assert_close(expert.linear_fc2.weight.grad, block.experts.down_proj.grad[e], rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("ffn", [24, 10], ids=["grouped_mm", "batched"])  # 10: rows not 16-byte aligned
def test_grouped_gemm_equals_one_matmul_pair_per_expert(ffn):
    sequential = _layer(moe_ffn_hidden_size=ffn)
    grouped = _layer(moe_ffn_hidden_size=ffn, moe_grouped_gemm=True)
    assert all(torch.equal(a, b) for a, b in zip(sequential.state_dict().values(), grouped.state_dict().values()))
    x1, x2 = _x(), _x()
    (sequential(x1)[0] ** 2).sum().backward()
    (grouped(x2)[0] ** 2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(sequential.named_parameters(), grouped.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_state_dict_keys_are_megatron_cores_local_spec_names():
    layer = _layer(moe_shared_expert_intermediate_size=32)
    keys = set(layer.state_dict())
    assert {"router.weight", "experts.local_experts.0.linear_fc1.weight", "experts.local_experts.3.linear_fc2.weight",
            "shared_experts.linear_fc1.weight", "shared_experts.linear_fc2.weight"} <= keys
    assert layer.experts.local_experts[0].linear_fc1.weight.shape == (2 * FFN, H)
    for name, param in layer.named_parameters():
        assert getattr(param, "allreduce", True) is (not name.startswith("experts.")), name


# ----------------------------------------------------------------------------- routing

def _direct_probs(logits: torch.Tensor, k: int, score: str, pre_softmax: bool, scale: float | None):
    """Row by row from the definitions."""
    probs = torch.zeros_like(logits)
    for t, row in enumerate(logits):
        if score == "softmax" and pre_softmax:
            scores = torch.exp(row) / torch.exp(row).sum()
            top = torch.argsort(scores, descending=True)[:k]
            weights = scores[top]
        elif score == "softmax":
            top = torch.argsort(row, descending=True)[:k]
            weights = torch.exp(row[top]) / torch.exp(row[top]).sum()
        else:
            scores = 1 / (1 + torch.exp(-row))
            top = torch.argsort(scores, descending=True)[:k]
            weights = scores[top] / scores[top].sum() if k > 1 else scores[top]
        probs[t, top] = weights * (scale or 1.0)
    return probs


@pytest.mark.parametrize("score, pre_softmax, scale", [("softmax", False, None), ("softmax", True, None),
                                                       ("sigmoid", False, None), ("softmax", True, 2.5)])
def test_router_probabilities_follow_the_score_function(score, pre_softmax, scale):
    layer = _layer(moe_router_score_function=score, moe_router_pre_softmax=pre_softmax,
                   moe_router_topk_scaling_factor=scale, moe_router_load_balancing_type="none")
    layer.eval()
    x = _x()
    probs, routing_map = layer.router(x)
    logits = x.detach().reshape(-1, H) @ layer.router.weight.detach().t()
    torch.testing.assert_close(probs.detach(), _direct_probs(logits, 2, score, pre_softmax, scale), rtol=1e-5, atol=1e-7)
    assert torch.equal(routing_map, probs.detach() > 0)


def test_sinkhorn_routes_by_the_balanced_matrix_while_training_and_by_the_scores_in_eval():
    layer = _layer(moe_router_load_balancing_type="sinkhorn", moe_router_topk=2)
    x = _x(s=16, b=2)
    logits = (x.detach().reshape(-1, H) @ layer.router.weight.detach().t()).float()
    # Sinkhorn-Knopp, written out: alternate row and column scalings of exp(logits) until stable.
    cost = torch.exp(logits)
    rows, cols = torch.ones(cost.shape[0]), torch.ones(cost.shape[1])
    for _ in range(10000):
        rows = 1.0 / (cost.shape[0] * ((cost * cols).sum(1) + 1e-8))
        new_cols = 1.0 / (cost.shape[1] * ((cost * rows[:, None]).sum(0) + 1e-8))
        done = (new_cols - cols).abs().mean() <= 1e-4
        cols = new_cols
        if done:
            break
    balanced = cost * rows[:, None] * cols
    torch.testing.assert_close(sinkhorn(logits), balanced, rtol=1e-4, atol=1e-9)
    layer.train()
    probs, routing_map = layer.router(x)
    chosen = torch.zeros_like(routing_map).scatter(1, balanced.topk(2, dim=1).indices, True)
    assert torch.equal(routing_map, chosen)
    torch.testing.assert_close(probs.detach(), torch.softmax(logits, -1) * chosen)  # k > 1: softmax over all
    layer.eval()
    _, eval_map = layer.router(x)
    assert torch.equal(eval_map, torch.zeros_like(routing_map).scatter(1, logits.topk(2, dim=1).indices, True))


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_keeps_the_largest_weights_or_the_first_tokens(policy, pad):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(20, E, generator=generator)
    top = logits.topk(2, dim=1)
    probs = torch.zeros_like(logits).scatter(1, top.indices, torch.softmax(top.values, -1))
    routing_map = probs > 0
    capacity = expert_capacity(20, 2, E, 0.5)
    assert capacity == math.ceil(20 * 2 / E * 0.5) == 5
    kept_probs, kept_map = drop_tokens(probs, routing_map, 2, 0.5, policy, pad)
    for e in range(E):
        routed = routing_map[:, e].nonzero().flatten().tolist()
        if policy == "probs":
            routed.sort(key=lambda t: -float(probs[t, e]))
        expected = set(routed[:capacity])
        assert set(((kept_map[:, e]) & routing_map[:, e]).nonzero().flatten().tolist()) == expected, e
        if pad:
            assert int(kept_map[:, e].sum()) == capacity, e  # padded with weight-0 tokens
        else:
            assert set(kept_map[:, e].nonzero().flatten().tolist()) == expected, e
    assert torch.equal(kept_probs, probs * kept_map)


def test_padding_to_capacity_changes_no_output():
    plain = _layer(moe_expert_capacity_factor=0.75)
    padded = _layer(moe_expert_capacity_factor=0.75, moe_pad_expert_input_to_capacity=True)
    x = _x(s=8, b=2)
    torch.testing.assert_close(plain(x)[0], padded(x)[0], rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- balancing losses

def _direct_switch_loss(scores: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """Switch Transformer: E * sum_e f_e P_e, f_e = n_e / (T k), P_e = mean_t scores[t, e]."""
    tokens = scores.shape[0]
    fraction = chosen.float().sum(0) / (tokens * k)
    mean_prob = scores.mean(0)
    return E * (fraction * mean_prob).sum()


def _aux_run(kind: str, s: int = 8, b: int = 3, coeff: float = 0.1, **overrides):
    layer = _layer(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=coeff if kind != "none" else 0.0,
                   **overrides)
    layer.train()
    x = _x(s=s, b=b)
    out, _ = layer(x)
    return layer, x, out


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_balancing_loss_value_and_gradient_equal_the_direct_computation(kind):
    layer, x, out = _aux_run(kind, s=8, b=3)
    weight = layer.router.weight
    logits = x.detach().reshape(-1, H) @ weight.t()  # depends on the router weight: its own gradient
    scores = torch.softmax(logits, -1)
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, scores.topk(2, dim=1).indices, True)
    if kind == "aux_loss":
        direct = _direct_switch_loss(scores, chosen, 2)
    else:  # per sequence (batch column b of the [s, b] tokens), then the mean over the batch
        s_scores, s_chosen = scores.reshape(8, 3, E), chosen.reshape(8, 3, E)
        direct = torch.stack([_direct_switch_loss(s_scores[:, j], s_chosen[:, j], 2) for j in range(3)]).mean()
    name = "load_balancing_loss" if kind == "aux_loss" else "seq_load_balancing_loss"
    stats = aux_losses.collect([name], 2, E, 1, 1)
    assert stats.losses[name][0].item() == pytest.approx(direct.item(), rel=1e-6)
    # The gradient the router weight gets = that of (the output's objective) + coeff * direct.
    out.sum().backward()
    with_aux = weight.grad.clone()
    weight.grad = None
    layer2, x2, out2 = _aux_run("none", s=8, b=3)  # the same weights and input, no balancing loss
    out2.sum().backward()
    (0.1 * direct).backward()
    torch.testing.assert_close(with_aux, layer2.router.weight.grad + weight.grad, rtol=1e-5, atol=1e-7)


def test_z_loss_value_and_gradient_equal_the_direct_computation():
    layer = _layer(moe_router_load_balancing_type="none", moe_z_loss_coeff=0.01)
    layer.train()
    x = _x()
    out, _ = layer(x)
    logits = x.detach().reshape(-1, H) @ layer.router.weight.t()
    direct = (torch.logsumexp(logits, -1) ** 2).mean()
    stats = aux_losses.collect(["z_loss"], 2, E, 1, 1)
    assert stats.losses["z_loss"][0].item() == pytest.approx(direct.item(), rel=1e-6)
    out.sum().backward()
    with_z = layer.router.weight.grad.clone()
    layer.router.weight.grad = None
    plain = _layer(moe_router_load_balancing_type="none")
    plain.load_state_dict(layer.state_dict())
    plain.train()
    plain(x.detach())[0].sum().backward()
    (0.01 * direct).backward()
    torch.testing.assert_close(with_z, plain.router.weight.grad + layer.router.weight.grad, rtol=1e-5, atol=1e-7)


def test_no_balancing_loss_and_no_record_in_evaluation_or_without_a_coefficient():
    layer, x, out = _aux_run("none")
    assert aux_losses.collect(["load_balancing_loss"], 2, E, 1, 1).losses["load_balancing_loss"].sum() == 0
    layer = _layer(moe_aux_loss_coeff=0.1)
    layer.eval()
    with torch.no_grad():
        layer(_x())
    assert not aux_losses.has_records()


def test_aux_loss_gradient_takes_the_schedules_scale():
    layer, x, out = _aux_run("aux_loss", coeff=10.0)
    AuxLossAutoScaler.set_loss_scale(0.25)  # 4 micro-batches
    out.sum().backward()
    scaled = layer.router.weight.grad.clone()
    layer2, x2, out2 = _aux_run("aux_loss", coeff=10.0)
    AuxLossAutoScaler.set_loss_scale(1.0)
    out2.sum().backward()
    plain = layer2.router.weight.grad
    layer3, x3, out3 = _aux_run("none")
    out3.sum().backward()
    main = layer3.router.weight.grad
    torch.testing.assert_close(scaled - main, 0.25 * (plain - main), rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- in the model

def test_shared_experts_add_a_dense_mlp_of_their_size():
    layer = _layer(moe_shared_expert_intermediate_size=32)
    assert isinstance(layer.shared_experts, MLP)
    x = _x()
    routed_only = _layer(moe_shared_expert_intermediate_size=None)
    routed_only.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("shared")})
    shared, bias = layer.shared_experts(x)
    torch.testing.assert_close(layer(x)[0], routed_only(x)[0] + shared, rtol=1e-6, atol=1e-7)


def test_moe_layer_freq_puts_moe_mlps_where_megatron_does():
    config = _config(num_layers=4, moe_layer_freq=2)
    model = GPTModel(config, vocab_size=64, max_sequence_length=8)
    kinds = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    assert kinds == ["MoELayer", "MLP", "MoELayer", "MLP"]
    config = _config(num_layers=4, moe_layer_freq=[0, 1, 1, 0])
    kinds = [type(layer.mlp).__name__ for layer in GPTModel(config, vocab_size=64, max_sequence_length=8).decoder.layers]
    assert kinds == ["MLP", "MoELayer", "MoELayer", "MLP"]
    assert [layer.mlp.router.layer_number for layer in GPTModel(config, 64, 8).decoder.layers[1:3]] == [2, 3]


@pytest.mark.parametrize("overrides, message", [
    (dict(moe_router_topk=5), "moe_router_topk (5) cannot exceed num_moe_experts (4)"),
    (dict(expert_model_parallel_size=3), "num_moe_experts (4) must be divisible by expert_model_parallel_size (3)"),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.1),
     "moe_router_load_balancing_type sinkhorn takes no aux loss"),
    (dict(moe_pad_expert_input_to_capacity=True), "moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor"),
    (dict(moe_layer_freq=[1, 0, 1]), "moe_layer_freq as a list must hold num_layers (2) values"),
    (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type must be one of"),
    (dict(tensor_model_parallel_size=2), "num_moe_experts with tensor_model_parallel_size > 1 needs sequence_parallel"),
])
def test_bad_moe_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(**overrides)


def test_full_recompute_gives_the_same_gradients_and_records_each_loss_once():
    def run(**recompute):
        torch.manual_seed(5)
        config = _config(num_layers=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, **recompute)
        model = GPTModel(config, vocab_size=64, max_sequence_length=8, position_embedding_type="rope")
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(6))
        model(tokens, None, labels=tokens).mean().backward()
        stats = aux_losses.collect(["load_balancing_loss", "z_loss"], 2, E, 1, 1)
        return {n: p.grad.clone() for n, p in model.named_parameters()}, stats

    plain, plain_stats = run()
    recomputed, stats = run(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    for name in ("load_balancing_loss", "z_loss"):
        torch.testing.assert_close(stats.losses[name], plain_stats.losses[name])
        assert (stats.losses[name] > 0).all()
    assert torch.equal(stats.routed, plain_stats.routed)


def test_the_record_keeps_its_values_when_collected_for_more_layers():
    aux_losses.record_loss("z_loss", 2, 2, torch.tensor(3.0))
    aux_losses.record_tokens(1, 2, torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 3, 3]))
    stats = aux_losses.collect(["z_loss"], 4, E, 1, 1)  # a record made for 2 layers, read for 4
    assert stats.losses["z_loss"].tolist() == [0.0, 3.0, 0.0, 0.0]
    assert stats.routed[0].tolist() == [1, 2, 3, 4] and stats.kept[0].tolist() == [1, 2, 3, 3]
    assert not stats.routed[1:].any()
