"""A 2-layer GPT split over 2 and 4 tensor-parallel ranks (with and without sequence
parallelism) against the same GPT on one rank: same initial weights, same loss, same gradients.

The vocabulary (300 ids) is not a multiple of 128 x t: the TP=1 model pads it to 384 rows, the
TP=2 and TP=4 models to 512. Padding must change neither the loss nor the real rows' gradients.
Every rank builds the serial model itself (TP = 1) and then its shard of the parallel one, from
the same seed; gradients of split parameters are gathered over the TP group before comparing.
"""

import pytest
import torch

from megatron.core import communication, parallel_state, tensor_parallel
from megatron.model.layer_specs import layer_spec_from_config
from megatron.model.transformer_layer import TransformerLayer
from megatron.model.utils import get_causal_attention_mask, get_num_parameters, get_num_parameters_across_model_parallel
from tests.helpers import tp_gpt
from tests.helpers.tp_gpt import BATCH, HIDDEN, SEED, SEQ, VOCAB, VOCAB_PARAMS
from tests.parallel.harness import init_parallel


def _compare_with_serial(tp: int, sp: bool, untied: bool):
    init_parallel(tp=1)
    serial_loss, serial_grads, serial_weights = tp_gpt.loss_and_grads(tp_gpt.build(1, False, untied))
    parallel_state.destroy_model_parallel()

    init_parallel(tp=tp)
    model = tp_gpt.build(tp, sp, untied)
    loss, grads, weights = tp_gpt.loss_and_grads(model)
    params = dict(model.named_parameters())
    grad_errors, weight_errors, padding_grad = tp_gpt.errors_against_serial(model, grads, weights, serial_grads,
                                                                            serial_weights, VOCAB, VOCAB_PARAMS)
    return {"serial_loss": serial_loss, "loss": loss, "grad_errors": grad_errors, "weight_errors": weight_errors,
            "padding_grad": padding_grad, "names": sorted(params), "serial_names": sorted(serial_grads)}


@pytest.mark.parametrize("tp, sp, untied", [(2, False, False), (2, True, False), (4, False, False),
                                            (4, True, False), (2, True, True), (4, False, True)],
                         ids=["tp2", "tp2-sp", "tp4", "tp4-sp", "tp2-sp-untied", "tp4-untied"])
def test_loss_and_gradients_equal_the_serial_model(dist_pool, tp, sp, untied):
    for rank, result in enumerate(dist_pool.run(_compare_with_serial, tp, sp, untied)):
        assert result["names"] == result["serial_names"], rank
        assert result["loss"] == pytest.approx(result["serial_loss"], rel=1e-5), rank
        assert max(result["weight_errors"].values()) == 0.0, (rank, result["weight_errors"])  # same init, bit for bit
        bad = {name: error for name, error in result["grad_errors"].items() if error > 1e-5}
        assert not bad, (rank, bad)
        assert result["padding_grad"] == 0.0, rank


def _dropout_runs():
    init_parallel(tp=2)
    results = []
    for _ in range(2):
        model = tp_gpt.build(2, True, dropout=0.2)
        loss, grads, _ = tp_gpt.loss_and_grads(model)
        results.append((loss, grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    no_dropout_loss, _, _ = tp_gpt.loss_and_grads(tp_gpt.build(2, True, dropout=0.0))
    same_grads = all(torch.equal(grads_a[name], grads_b[name]) for name in grads_a)
    return {"losses": (loss_a, loss_b), "same_grads": same_grads, "no_dropout_loss": no_dropout_loss}


def test_dropout_is_deterministic_for_a_fixed_seed(dist_pool):
    results = dist_pool.run(_dropout_runs)
    for result in results:
        loss_a, loss_b = result["losses"]
        assert loss_a == loss_b and result["same_grads"]
        assert loss_a != pytest.approx(result["no_dropout_loss"], rel=1e-4)  # dropout did act
    # the loss is replicated: every TP rank reports the same value
    assert results[0]["losses"] == results[1]["losses"]


def _layer_communication(sp: bool):
    """Collectives of one transformer layer's forward and backward, on the TP group."""
    init_parallel(tp=2)
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = tp_gpt.model_config(2, sp)
    layer = TransformerLayer(config, layer_spec_from_config(config).submodules, layer_number=1)
    rows = SEQ // 2 if sp else SEQ
    x = torch.randn(rows, BATCH, HIDDEN, requires_grad=True)  # [s(/t), b, h]
    mask = get_causal_attention_mask(SEQ)
    with communication.count_communication() as forward:
        out = layer(x, mask)
    with communication.count_communication() as backward:
        out.sum().backward()
    as_tuples = lambda counter: [(e.op, e.group, e.numel, e.nbytes) for e in counter.events]  # noqa: E731
    return as_tuples(forward), as_tuples(backward)


def test_communication_per_layer_without_sequence_parallelism(dist_pool):
    sbh = SEQ * BATCH * HIDDEN
    for forward, backward in dist_pool.run(_layer_communication, False):
        # attention output and MLP output are summed over the TP ranks ...
        assert forward == [("all_reduce", "tp", sbh, 4 * sbh)] * 2
        # ... and the gradients of the two column-parallel inputs on the way back
        assert backward == [("all_reduce", "tp", sbh, 4 * sbh)] * 2


def test_communication_per_layer_with_sequence_parallelism(dist_pool):
    sbh = SEQ * BATCH * HIDDEN
    gather, scatter = ("all_gather", "tp", sbh, 4 * sbh), ("reduce_scatter", "tp", sbh, 4 * sbh)
    for forward, backward in dist_pool.run(_layer_communication, True):
        # each all-reduce of the TP region became an all-gather before the column-parallel
        # linear and a reduce-scatter after the row-parallel one, of the same s*b*h tensor
        assert forward == [gather, scatter, gather, scatter]
        # backward: the conjugates (all-gather for each reduce-scatter, reduce-scatter for
        # each all-gather), plus the re-gather of each column-parallel input for its weight
        # gradient: only the s/t shard was kept for backward (activation memory s*b*h/t)
        assert sorted(backward) == sorted([gather] * 4 + [scatter] * 2)
        assert backward.count(gather) == 4 and backward.count(scatter) == 2


def _parameter_counts(tp: int):
    init_parallel(tp=1)
    serial = tp_gpt.build(1, False)
    serial_total = get_num_parameters_across_model_parallel(serial)
    parallel_state.destroy_model_parallel()
    init_parallel(tp=tp)
    model = tp_gpt.build(tp, True)
    replicated = sum(p.numel() for p in model.parameters() if not getattr(p, "tensor_model_parallel", False))
    return {"serial": serial_total, "serial_local": get_num_parameters(serial),
            "local": get_num_parameters(model), "total": get_num_parameters_across_model_parallel(model),
            "replicated": replicated, "tp_rank": parallel_state.get_tensor_model_parallel_rank()}


@pytest.mark.parametrize("tp", [2, 4])
def test_parameter_counts_add_up_to_the_serial_model(dist_pool, tp):
    results = dist_pool.run(_parameter_counts, tp)
    padding_difference = (tp_gpt.padded(tp) - tp_gpt.padded(1)) * HIDDEN  # extra zero rows of the word embedding
    one_group = [r for r in results if r["tp_rank"] in range(tp)][:tp]
    for result in results:
        assert result["serial"] == result["serial_local"]
        assert result["total"] == result["serial"] + padding_difference
    # the per-rank counts Megatron prints sum to the total once the replicas are counted once
    assert sum(r["local"] for r in one_group) - (tp - 1) * one_group[0]["replicated"] == one_group[0]["total"]
