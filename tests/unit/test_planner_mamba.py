"""The planner's hybrid Mamba models (megatron/planner/mamba.py): parameters equal the model's, the
activation bytes of a whole hybrid chunk (Mamba, attention-only, MLP-only and MoE-only layers, embedding, loss)
equal what autograd saves in an fp32 training forward, the inference state equals InferenceContext's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron.planner.mamba import mamba_state_bytes
from megatron.planner.model import Layout, chunk_activation_bytes, chunk_parameters, shape_from_args
from megatron.training.arguments import parse_args, validate_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _args(extra, seq, capsys):
    argv = ["--num-layers", "5", "--hybrid-override-pattern", "M*-MM", "--hidden-size", "32",
            "--num-attention-heads", "4", "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups",
            "2", "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", "2",
            "--global-batch-size", "2", "--lr", "1", "--train-iters", "1", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100", "--normalization", "RMSNorm", "--disable-bias-linear",
            "--position-embedding-type", "none", "--untie-embeddings-and-output-weights", *extra]
    args = parse_args(argv=argv)
    args.world_size, args.rank = 1, 0
    validate_args(args, {})
    capsys.readouterr()
    args.padded_vocab_size = 128
    return args


def _model(args):
    from megatron.model.mamba import MambaModel
    from megatron.training.config_builders import core_transformer_config_from_args, mamba_model_kwargs

    return MambaModel(core_transformer_config_from_args(args), vocab_size=128, max_sequence_length=args.seq_length,
                      share_embeddings_and_output_weights=False, **mamba_model_kwargs(args))


MOE = ["--hybrid-override-pattern", "M*-EM", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
       "24", "--moe-aux-loss-coeff", "0.01", "--moe-shared-expert-intermediate-size", "16", "--swiglu"]


@pytest.mark.parametrize("seq, extra", [(200, []), (64, ["--swiglu", "--hidden-dropout", "0.1"]), (64, MOE)],
                         ids=["two-chunks", "one-chunk-swiglu-dropout", "moe-layer"])
def test_hybrid_chunk_parameters_and_activations_are_the_models(seq, extra, capsys):
    from megatron.model.activation_memory import saved_tensor_bytes

    args = _args(extra, seq, capsys)
    m, lay = shape_from_args(args), Layout(micro_batch_size=2, global_batch_size=2)
    # Seeded: the weights (so the routing: an expert that gets no token saves no index tensor) must not
    # depend on what ran before in this process
    torch.manual_seed(1234)
    model = _model(args).train()
    if "--num-experts" in extra:  # the E layer, 4th, is the planner's one MoE layer
        assert m.moe.layers == (4,) and type(model.decoder.layers[3].mlp).__name__ == "MoELayer"
    assert chunk_parameters(m, lay, 0, 0) == sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq).repeat(2, 1)
    measured = saved_tensor_bytes(lambda: model(tokens, positions, None, labels=tokens),
                                  exclude=list(model.parameters()))
    assert chunk_activation_bytes(m, lay, 0, 0) == measured


def test_mamba_state_bytes_are_the_inference_contexts(capsys):
    from megatron.inference.context import InferenceContext

    args = _args([], 16, capsys)
    m = shape_from_args(args)
    model = _model(args).eval()
    context = InferenceContext(3, 16)
    with torch.no_grad():
        model(torch.zeros(3, 4, dtype=torch.long), None, inference_context=context)
    held = sum(t.numel() * t.element_size() for states in context.mamba_state_dict.values() for t in states)
    assert held == 3 * m.hybrid.pattern.count("M") * mamba_state_bytes(m.hybrid, 1, 4)


def test_the_logged_flops_of_a_hybrid_model_are_megatrons(capsys):
    """num_floating_point_operations (the log's TFLOP/s) of M*-MM and M*-EM: Megatron-LM's hybrid_flops,
    written out: 3 x per sequence (Mamba: in_proj with d_in = 2h, scan 7 s d_in n, out_proj; attention;
    MLP; MoE; logits)."""
    from megatron.training.training_log import num_floating_point_operations

    args = _args(["--swiglu"], 64, capsys)
    args.is_hybrid_model = True
    s, h, v = 64, 32, 128
    d_in, nh = 64, 8
    mamba = 2 * s * h * (2 * d_in + 2 * 2 * 8 + nh) + 7 * s * d_in * 8 + 2 * s * d_in * h
    attention = 4 * s * h * 1 * (h + h + s / 2)
    mlp = 4 * s * h * args.ffn_hidden_size * 1.5
    expected = 3 * 2 * (3 * mamba + attention + mlp + 2 * s * h * v)
    assert num_floating_point_operations(args, 2) == pytest.approx(expected, rel=1e-12)
    # M*-EM: the MoE layer counts the experts a token runs (top 2 of 24, the shared 16), Megatron's moe_layer_flops
    args = _args(MOE, 64, capsys)
    args.is_hybrid_model = True
    moe = 4 * s * h * (24 * 2 + 16) * 1.5
    expected = 3 * 2 * (2 * mamba + attention + mlp + moe + 2 * s * h * v)
    assert num_floating_point_operations(args, 2) == pytest.approx(expected, rel=1e-12)


def test_cp_with_mamba_layers_is_refused_in_one_line(capsys):
    from megatron.planner.model import PlanError
    from megatron.planner.plan import Device, make_plan

    m = shape_from_args(_args([], 16, capsys))
    with pytest.raises(PlanError, match="--context-parallel-size > 1 with Mamba layers is not modelled"):
        make_plan(m, Layout(micro_batch_size=2, global_batch_size=2, cp=2), Device())


@pytest.mark.parametrize("extra", [[], ["--group-query-attention", "--num-query-groups", "2"], MOE],
                         ids=["hybrid", "gqa", "moe-layer"])
def test_hybrid_flops_are_the_log_lines_and_the_stages_share_them(extra, capsys):
    """The planner counts a hybrid model's layers by kind (Mamba, attention, MLP, MoE), as the log line
    (training_log.hybrid_flops) does: its FLOPs per step are the log line's, the ranks' FLOPs add up to
    them over PP2 x DP2, full recompute adds the forward of every layer, selective that of the scores."""
    from megatron.planner.plan import _stage_flops, flops_per_step
    from megatron.training.training_log import num_floating_point_operations

    hybrid = ["--is-hybrid-model", "--num-layers", "6", "--hybrid-override-pattern"]  # pretrain_mamba.py's default
    args = _args([*extra, *hybrid, "M*-EM-" if "--num-experts" in extra else "M*-MM-"], 64, capsys)
    m = shape_from_args(args)
    logged = num_floating_point_operations(args, 8)
    assert flops_per_step(m, 8) == pytest.approx(logged, rel=1e-12)
    dense_gpt = shape_from_args(_args([*hybrid, "******"], 64, capsys))
    assert flops_per_step(m, 8) != flops_per_step(dense_gpt, 8)  # not the GPT count of 6 layers
    lay = Layout(pp=2, dp=2, micro_batch_size=2, global_batch_size=8)
    assert 2 * sum(_stage_flops(m, lay, stage) for stage in range(2)) == pytest.approx(logged, rel=1e-12)
    logits = 8 // 2 * 6 * m.hidden_size * m.padded_vocab_size * m.seq_length  # one DP rank's, last stage
    plain = sum(_stage_flops(m, lay, stage) for stage in range(2)) - logits
    full = sum(_stage_flops(m, replace(lay, recompute="full"), stage) for stage in range(2)) - logits
    assert full == pytest.approx(plain * 4 / 3, rel=1e-12)
    selective = sum(_stage_flops(m, replace(lay, recompute="selective"), stage) for stage in range(2)) - logits
    s, h = m.seq_length, m.hidden_size
    assert selective - plain == pytest.approx(8 // 2 * 2 * s * s * h * m.kv_channels * m.num_attention_heads / h,
                                              rel=1e-12)  # the one attention layer's scores and x V


@pytest.mark.parametrize("pattern, blocks", [("M*-MM-", 6), ("M*-EM-", 5)], ids=["dense", "moe-layer-no-shared"])
def test_hybrid_tp_traffic_is_one_collective_per_layer_and_direction(pattern, blocks, capsys):
    """TP2: every Mamba, attention and MLP layer is one block (a column- then row-parallel pair: one
    all-reduce forward, one backward), an MoE layer without shared experts none (its dispatcher moves the
    tokens); plus the embedding's and the output layer's all-reduce."""
    from megatron.planner.plan import Device, _ring, make_plan

    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24"] if "E" in pattern else []
    args = _args([*moe, "--is-hybrid-model", "--num-layers", "6", "--hybrid-override-pattern", pattern], 64, capsys)
    m = shape_from_args(args)
    lay = Layout(tp=2, micro_batch_size=2, global_batch_size=4)
    rank = make_plan(m, lay, Device()).ranks[0]
    act = 4 * 64 * 2 * m.hidden_size  # fp32 [s, b, h]
    assert rank.comm["tp"] == pytest.approx(2 * (blocks * 2 + 2) * _ring("all_reduce", act, 2), rel=1e-12)
