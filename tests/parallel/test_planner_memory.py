"""The planner's per-rank memory (parameters + gradients + optimizer state + activations) against
what 4 gloo ranks allocate for the 12 dense (2 with GPT-2's vocabulary), 4 MoE and 1 context-parallel (CP 2 x DP 2)
layouts of docs/planner.md (megatron/planner/measure.py:
the optimizer side measured exactly after a step, activations as the saved tensors of one
forward per model chunk times the micro-batches the schedule keeps in flight; and the peak of the
saved tensors during one real train_step, which checks the in-flight counts; and the peak of the
CPU allocator's live bytes over 2 more train_steps against the plan's peak)."""

import pytest

from megatron.planner.measure import LAYOUTS, measure_layouts, table_rows


@pytest.fixture(scope="module")
def per_rank(dist_pool):
    return dist_pool.run(measure_layouts)


@pytest.fixture(scope="module")
def rows(per_rank):
    return table_rows(per_rank)


def test_seventeen_layouts_are_measured(rows):
    assert len(LAYOUTS) == 17 and sum("moe" in name for name in LAYOUTS) == 4
    assert sum("gpt2-vocab" in name for name in LAYOUTS) == 2 and sum(name.startswith("cp") for name in LAYOUTS) == 1
    assert {row[0] for row in rows} == set(LAYOUTS)


def test_predicted_memory_is_within_5_percent_of_measured_on_every_rank(rows):
    worst = max(rows, key=lambda row: abs(row[5]))
    assert abs(worst[5]) < 0.05, worst
    # in fact the model is exact up to the distributed optimizer's bucket padding: 0.1% here
    assert abs(worst[5]) < 0.001, worst


def test_the_real_schedules_peak_is_the_in_flight_model(per_rank):
    """One real train_step (1F1B / interleaved / no pipeline) with every saved tensor tracked until
    autograd frees it: its peak is the predicted activations (in-flight micro-batches x bytes per
    chunk); with full recompute the plan's peak (activations + one layer rerun) is an upper bound."""
    for results in per_rank:
        for name, r in results.items():
            if "full" in name:
                assert r["schedule_peak"] <= r["predicted_peak"], (name, r["schedule_peak"], r["predicted_peak"])
            else:
                assert abs(r["schedule_peak"] - r["predicted_peak"]) <= 0.02 * r["schedule_peak"], (name, r)


def test_parameters_are_counted_exactly(per_rank):
    for results in per_rank:
        for r in results.values():
            assert r["num_parameters"] == r["predicted_parameters"]


def test_each_category_matches(rows):
    for name, rank, stage, measured, predicted, *_ in rows:
        for key in ("model_params", "grads", "optimizer_state"):
            assert abs(predicted[key] - measured[key]) <= 0.01 * measured[key], (name, rank, key)
        assert abs(predicted["activations"] - measured["activations"]) <= 0.01 * measured["activations"], (name, rank)


def test_the_planned_peak_is_within_5_percent_of_the_allocators_peak(per_rank):
    """The plan's peak (saved state + activations + the largest transient of the forward, the loss
    and the backward) against the most live bytes of PyTorch's CPU allocator over 2 real
    train_steps (megatron/planner/measure.py: the profiler's allocation events), every rank."""
    for results in per_rank:
        for name, r in results.items():
            measured, predicted = r["iteration_peak"], r["predicted_iteration_peak"]
            assert abs(predicted - measured) <= 0.05 * measured, (name, predicted, measured)


def test_a_large_vocabulary_peaks_well_above_what_is_saved(per_rank):
    """GPT-2's vocabulary at hidden 64: the loss's [s, b, V] transients put the real peak more than
    20% above parameters + gradients + optimizer + saved activations, at TP 1 and TP 2: a plan of
    what is saved alone says 'fits' where the run would not."""
    for results in per_rank:
        for name in ("tp1-pp1-dp4 fp32 gpt2-vocab", "tp2-dp2 bf16 gpt2-vocab"):
            r = results[name]
            assert r["iteration_peak"] > 1.2 * r["measured"]["total"], (name, r["iteration_peak"], r["measured"])


def _cp_layer_bytes_without_recompute() -> dict:
    """At CP 2 (4 ranks: CP 2 x DP 2), no recompute: the bytes one bf16 layer saves per CP rank
    (activation_memory.measure_layer_activation_bytes, s 64, b 2, h 64, a 8) and the planner's, for
    allgather and a2a, the paper's layer and the Llama-style one with 2 and 8 K/V groups."""
    import torch

    from megatron.core import parallel_state
    from megatron.model import activation_memory
    from megatron.model.activation_memory import llama_ffn_hidden_size
    from megatron.planner.model import Layout, ModelShape, layer_activation_bytes

    original = activation_memory.layer_config
    out = {}
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        for kind in ("allgather", "a2a"):
            def with_kind(*args, **kwargs):  # the measurement's config takes the default comm type
                config = original(*args, **kwargs)
                config.cp_comm_type = kind
                return config

            activation_memory.layer_config = with_kind
            for groups in (None, 2, 8):
                measured = activation_memory.measure_layer_activation_bytes(64, 2, 64, 8, dtype=torch.bfloat16,
                                                                            llama_query_groups=groups)
                common = dict(num_layers=1, hidden_size=64, num_attention_heads=8, kv_channels=8,
                              padded_vocab_size=128, seq_length=64, max_position_embeddings=64, params_dtype="bf16")
                shape = ModelShape(num_query_groups=8, ffn_hidden_size=256, **common) if groups is None else \
                    ModelShape(num_query_groups=groups, ffn_hidden_size=llama_ffn_hidden_size(64), swiglu=True,
                               layernorm=False, add_bias_linear=False, learned_positions=False, rope=True, **common)
                planned = layer_activation_bytes(shape, Layout(micro_batch_size=2, cp=2, cp_comm_type=kind))
                out[(kind, groups)] = (measured, planned)
    finally:
        activation_memory.layer_config = original
        parallel_state.destroy_model_parallel()
    return out


def test_cp_layer_without_recompute_is_planned_exactly_for_allgather_and_a2a(dist_pool):
    """The comm types' own extra tensors without recompute (planner.model._cp_core_extra_bytes: a2a's
    permutations and values, allgather's order and all-s keys / values) against the measured layer."""
    for per_rank in dist_pool.run(_cp_layer_bytes_without_recompute):
        for case, (measured, planned) in per_rank.items():
            assert planned == measured, case


def _cp_exchange_counts() -> dict:
    """At CP 2: the bytes communication.py counts on the CP group for one Llama-style fp32 layer's
    forward and backward (s 64, b 2, h 64, a 8, 2 K/V groups), per comm type, without and with
    selective recompute, next to cp_exchange_bytes (the planner's and bench/context_parallel.py's)."""
    import torch

    from megatron.core import communication, parallel_state
    from megatron.core.context_parallel import cp_exchange_bytes, split_for_cp_rank
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.model.activation_memory import layer_config
    from megatron.model.layer_specs import layer_spec_from_config
    from megatron.model.positions import RotaryEmbedding
    from megatron.model.transformer_layer import TransformerLayer
    from megatron.model.utils import get_causal_attention_mask

    out = {}
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        rank = parallel_state.get_context_parallel_rank()
        mask = split_for_cp_rank(get_causal_attention_mask(64), 2, 2, rank)
        freqs = split_for_cp_rank(RotaryEmbedding(8)(64), 0, 2, rank)
        for kind in ("p2p", "allgather", "a2a"):
            for recompute in (None, "selective"):
                config = layer_config(64, 8, dtype=torch.float32, recompute=recompute, dropout=0.0,
                                      llama_query_groups=2)
                config.cp_comm_type = kind
                model_parallel_cuda_manual_seed(1)
                layer = TransformerLayer(config, layer_spec_from_config(config).submodules, layer_number=1)
                x = torch.randn(32, 2, 64, requires_grad=True)
                with communication.count_communication() as counter:
                    layer(x, mask, True, rotary_pos_emb=freqs).sum().backward()
                counted = sum(nbytes for (op, group), (_, nbytes) in counter.summary().items() if group == "cp")
                formula = cp_exchange_bytes(kind, 2, 1, 64, 2, 8, 2, 8) * (1.5 if recompute else 1.0)
                out[(kind, recompute)] = (counted, formula)
    finally:
        parallel_state.destroy_model_parallel()
    return out


def test_cp_exchange_bytes_are_the_counted_bytes(dist_pool):
    for per_rank in dist_pool.run(_cp_exchange_counts):
        for case, (counted, formula) in per_rank.items():
            assert counted == formula, case
