"""The planner's formulas (megatron/planner): FLOPs per step are the log line's (and, for MoE, the
log line is Megatron-LM's count), bytes per parameter are Megatron's optimizer table, the bubble is
(p - 1) / (v m), the in-flight micro-batches are the schedules' warm-up counts, the GPT layer's
activations are Korthikanti et al.'s plus the norms' statistics; MoE layers' expert rows follow the
capacity rules; tools/plan.py and pretrain_gpt.py --dry-run print a plan and exit 0 without a model,
and --search varies EP for a Mixtral-style model."""

from dataclasses import replace

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.model.activation_memory import paper_activation_bytes
from megatron.planner.model import (
    Layout,
    bytes_per_parameter,
    in_flight_units,
    layer_activation_bytes,
    pipeline_bubble,
    shape_from_args,
)
from megatron.planner.report import plan_from_args
from megatron.training.training_log import num_floating_point_operations

SMALL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3",
         "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]
LLAMA_7B = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
            "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--global-batch-size", "1024", "--bf16",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--lr", "3e-4", "--train-iters", "10",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--swiglu",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--use-flash-attn"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-layer-freq", "2",
       "--moe-shared-expert-intermediate-size", "32"]
# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh, its layout left out
MIXTRAL = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
           "--group-query-attention", "--num-query-groups", "8", "--seq-length", "4096",
           "--max-position-embeddings", "32768", "--micro-batch-size", "1", "--global-batch-size", "256", "--bf16",
           "--use-distributed-optimizer", "--overlap-grad-reduce", "--use-flash-attn", "--swiglu", "--normalization",
           "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--lr", "1e-4", "--train-iters", "10",
           "--mock-data", "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
           "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall"]


def _args(argv, world_size=1, capsys=None):
    args = parse_args(argv=list(argv))
    args.world_size, args.rank = world_size, 0
    validate_args(args, {})
    if capsys is not None:
        capsys.readouterr()
    return args


@pytest.mark.parametrize("extra", [[], ["--swiglu", "--group-query-attention", "--num-query-groups", "2"],
                                   ["--kv-channels", "32", "--ffn-hidden-size", "100"], MOE + ["--swiglu"]],
                         ids=["gpt", "gqa", "odd", "moe"])
def test_flops_per_step_are_the_log_lines(extra, capsys):
    args = _args(SMALL + extra, capsys=capsys)
    plan = plan_from_args(args)
    assert plan.flops_per_step == num_floating_point_operations(args, args.global_batch_size)
    big = _args(LLAMA_7B + ["--tensor-model-parallel-size", "2"], world_size=64, capsys=capsys)
    assert plan_from_args(big).flops_per_step == num_floating_point_operations(big, 1024)


def _megatron_lm_flops(args, batch_size):
    """Megatron-LM's num_floating_point_operations (megatron/training/training.py, transformer_flops)
    for a GQA MoE GPT without MTP or MLA, restated term by term: per token 3 (forward + 2 backward)
    x 2 (multiply-add) x [h (f_dense x ffe x dense layers + f_moe x k x ffe x MoE layers + f_shared x
    ffe x MoE layers) + layers x (h (q + 2 kv) + q h) + h V], plus per sequence s^2 x layers x 3 x 2 x q
    (causal QK^T and x V); ffe = 3 with SwiGLU, else 2."""
    tokens, ffe = batch_size * args.seq_length, 3 if args.swiglu else 2
    pattern = [1 if i % args.moe_layer_freq == 0 else 0 for i in range(args.num_layers)]
    moe_layers = sum(pattern)
    q, kv = args.kv_channels * args.num_attention_heads, args.kv_channels * args.num_query_groups
    mlp = args.hidden_size * (args.ffn_hidden_size * ffe * (args.num_layers - moe_layers)
                              + args.moe_ffn_hidden_size * args.moe_router_topk * ffe * moe_layers
                              + (args.moe_shared_expert_intermediate_size or 0) * ffe * moe_layers)
    attention = args.num_layers * (args.hidden_size * (q + 2 * kv) + q * args.hidden_size)
    per_token = 3 * 2 * (mlp + attention + args.hidden_size * args.padded_vocab_size)
    return tokens * per_token + batch_size * args.seq_length ** 2 * args.num_layers * 3 * 2 * q


@pytest.mark.parametrize("extra,world_size", [(MIXTRAL + ["--expert-model-parallel-size", "8"], 64),
                                              (SMALL + MOE + ["--swiglu", "--group-query-attention",
                                                              "--num-query-groups", "2"], 1)], ids=["mixtral", "small"])
def test_moe_flops_are_megatron_lms(extra, world_size, capsys):
    """The log line counts the experts a token runs (top-k + shared) as Megatron-LM does, and the
    planner's FLOPs per step are the log line's."""
    args = _args(extra, world_size=world_size, capsys=capsys)
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    planned = plan_from_args(args).flops_per_step  # builds the tokenizer: sets padded_vocab_size
    logged = num_floating_point_operations(args, args.global_batch_size)
    assert planned == logged
    assert logged == pytest.approx(_megatron_lm_flops(args, args.global_batch_size), rel=1e-12)


def test_expert_rows_follow_the_capacity_rules():
    """(pairs, expert rows) per rank: balanced T k / E per expert without a capacity; at most C =
    ceil(T k / E f) with one; exactly C with padding, or every token when C >= T."""
    from megatron.planner.model import MoEShape, ModelShape, expert_rows

    def rows(etp=1, **moe):
        m = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4, kv_channels=16,
                       ffn_hidden_size=256, padded_vocab_size=128, seq_length=32, max_position_embeddings=32,
                       moe=MoEShape(num_experts=4, layers=(1, 2), ffn_hidden_size=64, topk=2, **moe))
        return expert_rows(m, Layout(tp=2, dp=2, ep=2, etp=etp, sequence_parallel=True, micro_batch_size=2))

    assert rows() == (64, 64)  # T = 32 tokens x 2 / 4 experts = 16 each
    assert rows(etp=2) == (64, 128)  # the ETP peers' tokens too
    assert rows(capacity_factor=2.0) == (64, 64)  # C = 32 >= 16: nothing dropped
    assert rows(capacity_factor=0.5) == (32, 32)  # C = 8
    assert rows(capacity_factor=0.5, pad_to_capacity=True) == (32, 32)
    assert rows(capacity_factor=1.5, pad_to_capacity=True) == (96, 96)  # C = 24, padded
    assert rows(capacity_factor=2.0, pad_to_capacity=True) == (128, 128)  # C = 32 >= T: every token


@pytest.mark.parametrize("d", [1, 2, 4, 8])
def test_bytes_per_parameter_are_megatrons_table(d):
    table = {("fp16", False): (20, 4 + 16 / d), ("bf16", True): (18, 6 + 12 / d), ("fp32", True): (16, 8 + 8 / d)}
    for (dtype, fp32_grads), (plain, sharded) in table.items():
        assert bytes_per_parameter(dtype, fp32_grads, False, d)["total"] == plain
        assert bytes_per_parameter(dtype, fp32_grads, True, d)["total"] == pytest.approx(sharded, abs=1e-12)


def test_bubble_and_in_flight_micro_batches():
    lay = Layout(pp=4, vpp=2, dp=1, micro_batch_size=1, global_batch_size=8)
    assert pipeline_bubble(lay) == 3 / 16
    assert pipeline_bubble(Layout(pp=4, global_batch_size=8)) == 3 / 8
    assert [in_flight_units(Layout(pp=4, global_batch_size=8), r) for r in range(4)] == [[4], [3], [2], [1]]
    assert in_flight_units(Layout(pp=4, global_batch_size=2), 0) == [2]  # at most m
    for r in range(4):  # the interleaved warm-up: (p - r - 1) x 2 + (v - 1) x p, plus the first 1F1B forward
        assert sum(in_flight_units(lay, r)) == (4 - r - 1) * 2 + 4 + 1
    assert in_flight_units(lay, 0) == [7, 4]  # chunk 0 takes micro-batches 0-3 and 4-6, chunk 1 0-3


@pytest.mark.parametrize("tp,sp,recompute", [(1, False, None), (4, False, None), (4, True, None),
                                             (4, False, "selective"), (4, True, "selective")])
def test_gpt_layer_is_the_paper_plus_the_norm_statistics(tp, sp, recompute, capsys):
    args = _args(["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128",
                  "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "2",
                  "--lr", "1", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
                  "--vocab-size", "100", "--bf16"], capsys=capsys)
    args.padded_vocab_size = 128
    lay = Layout(tp=tp, micro_batch_size=2, global_batch_size=2, sequence_parallel=sp, recompute=recompute)
    paper = paper_activation_bytes(128, 2, 512, 8, tp, sequence_parallel=sp, recompute=recompute)
    statistics = 2 * 8 * (128 // tp if sp else 128) * 2  # two LayerNorms' fp32 mean and 1/std
    assert layer_activation_bytes(shape_from_args(args), lay, recompute) == paper + statistics


def test_the_search_pads_the_vocabulary_per_tp_size(capsys):
    from megatron.planner.model import shape_at_tp
    from megatron.planner.plan import flops_per_step

    base = plan_from_args(_args(LLAMA_7B, world_size=64, capsys=capsys)).shape
    for tp in (1, 2, 8):
        args = _args(LLAMA_7B + ["--tensor-model-parallel-size", str(tp)], world_size=64, capsys=capsys)
        plan = plan_from_args(args)
        assert shape_at_tp(base, tp) == plan.shape
        assert flops_per_step(shape_at_tp(base, tp), 1024) == num_floating_point_operations(args, 1024)


def test_plan_tool_and_search_for_a_7b_model(capsys):
    from tools.plan import main

    assert main(SMALL + ["--world-size", "4", "--pipeline-model-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "pipeline bubble" in out and "\n      1 |" in out
    assert main(SMALL + ["--world-size", "3"]) == 2  # a batch that does not split: the flag's one-line error
    assert main(SMALL + MOE + ["--moe-z-loss-coeff", "1e-3"]) == 2  # not modelled: said so
    assert main(SMALL + MOE + ["--moe-router-load-balancing-type", "sinkhorn"]) == 2
    assert main(SMALL + MOE + ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]) == 2
    capsys.readouterr()
    assert main(LLAMA_7B + ["--world-size", "64", "--search", "--top", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    best = lines[2].split("|")[1].strip()
    tp, pp = (int(part[2:]) for part in best.split("-")[:2])
    assert tp <= 2 and pp <= 2, lines  # Megatron's published 7B layouts: TP 1-2, PP 1-2


def test_search_varies_ep_for_a_mixtral_model(capsys):
    """Megatron-LM trains Mixtral 8x7B at TP 1, PP 4, EP 8 (examples/mixtral/README.md): the search over
    TP x PP x DP x EP x ETP on 64 devices keeps EP 8 in its best layouts, and takes SP with TP > 1."""
    from tools.plan import main

    assert main(MIXTRAL + ["--world-size", "64", "--search", "--top", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    layouts = [line.split("|")[1].strip() for line in lines[2:7]]
    assert all("-ep8-" in name for name in layouts), lines
    assert all("-sp" in name for name in layouts if not name.startswith("tp1-")), lines
    assert int(layouts[0].split("-")[1][2:]) >= 2, lines  # 47 B parameters: not without a pipeline


def test_dry_run_prints_the_plan_and_exits_before_the_model(monkeypatch, capsys):
    import pretrain_gpt
    from megatron.training import training

    def refuse(*args, **kwargs):
        raise AssertionError("--dry-run built the model")

    monkeypatch.setattr(training, "setup_model_and_optimizer", refuse)
    monkeypatch.setattr(training, "initialize_megatron", refuse)
    with pytest.raises(SystemExit) as exit_info:
        training.pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                          pretrain_gpt.ModelType.encoder_or_decoder, pretrain_gpt.forward_step,
                          argv=SMALL + ["--dry-run"])
    assert exit_info.value.code == 0
    assert "plan: tp1-pp1-dp1-mbs2" in capsys.readouterr().out


# ------------------------------------------------------------------------------ context parallelism

def _cp_shape(llama: bool, seq: int = 64):
    """measure_layer_activation_bytes' layers at h 64, a 8 (bf16): the paper's, the Llama-style one (2 groups)."""
    from megatron.model.activation_memory import llama_ffn_hidden_size
    from megatron.planner.model import ModelShape

    common = dict(num_layers=1, hidden_size=64, num_attention_heads=8, kv_channels=8, padded_vocab_size=128,
                  seq_length=seq, max_position_embeddings=seq, params_dtype="bf16")
    if llama:
        return ModelShape(num_query_groups=2, ffn_hidden_size=llama_ffn_hidden_size(64), swiglu=True, layernorm=False,
                          add_bias_linear=False, learned_positions=False, rope=True, **common)
    return ModelShape(num_query_groups=8, ffn_hidden_size=256, **common)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_cp_layer_bytes_are_the_measured_serial_layer_over_cp(recompute):
    """With recompute a CP rank keeps exactly 1/c of the serial layer's saved bytes, for every comm type
    (measured: tests/parallel/test_context_parallel.py::test_activation_bytes_per_cp_rank_are_the_serial_bytes_over_n,
    on the same layers): the planner's serial layer is the measured one here, and its CP layer 1/c of it."""
    import torch

    from megatron.model.activation_memory import measure_layer_activation_bytes
    from megatron.planner.model import full_recompute_kept_bytes

    def planned(m, lay):
        return full_recompute_kept_bytes(m, lay) if recompute == "full" else layer_activation_bytes(m, lay, recompute)

    for llama in (False, True):
        m = _cp_shape(llama)
        serial = planned(m, Layout(micro_batch_size=2, recompute=recompute))
        assert serial == measure_layer_activation_bytes(64, 2, 64, 8, dtype=torch.bfloat16, recompute=recompute,
                                                        llama_query_groups=2 if llama else None)
        for cp, kind in [(2, "p2p"), (2, "allgather"), (2, "a2a"), (4, "p2p"), (4, "allgather"), (4, "a2a")]:
            lay = Layout(micro_batch_size=2, recompute=recompute, cp=cp, cp_comm_type=kind)
            assert planned(m, lay) * cp == serial, (llama, cp, kind)


def test_cp_plan_divides_tokens_flops_and_shards_over_dp_x_cp(capsys):
    """--context-parallel-size 2 on 4 ranks: world = t c p d, the optimizer sharded and the gradients
    reduced over DP x CP, a rank's FLOPs 1/c of its replica's, its CP traffic the bench's formula
    (3/2 with recompute), its activations the s/c-token terms."""
    from megatron.core.context_parallel import cp_exchange_bytes
    from megatron.planner.model import chunk_activation_bytes, layout_from_args
    from megatron.planner.plan import Device, make_plan

    argv = SMALL + ["--bf16", "--use-distributed-optimizer", "--context-parallel-size", "2", "--cp-comm-type", "a2a"]
    args = _args(argv, world_size=4, capsys=capsys)
    lay = layout_from_args(args)
    assert (lay.cp, lay.dp, lay.cp_comm_type, lay.world_size) == (2, 2, "a2a", 4)
    plan = plan_from_args(args)
    m, rank = plan.shape, plan.ranks[0]
    per_param = bytes_per_parameter("bf16", True, True, 4)  # sharded over DP x CP = 4
    assert rank.memory["optimizer_state"] == round(per_param["optimizer_state"] * rank.parameters)
    no_cp = make_plan(m, Layout(dp=2, micro_batch_size=2, global_batch_size=16, distributed_optimizer=True), Device())
    assert rank.flops * 2 == pytest.approx(no_cp.ranks[0].flops, rel=1e-12)
    grads = rank.parameters * 4  # fp32 main grads: reduce-scatter + all-gather (bf16 params) over 4 ranks
    assert rank.comm["dp"] == pytest.approx(3 / 4 * grads + 3 / 4 * rank.parameters * 2)
    exchange = cp_exchange_bytes("a2a", 2, 4, 32, 2, 4, 4, 16, element_bytes=2)
    assert rank.comm["cp"] == pytest.approx(4 * exchange)  # 16 / (2 x 2) = 4 micro-batches, 4 layers
    selective = make_plan(m, replace(lay, recompute="selective"), Device()).ranks[0]
    assert selective.comm["cp"] == pytest.approx(1.5 * 4 * exchange)
    # the first-and-last chunk of a CP rank: a per-token model at s/c (no s x s term without a mask: selective)
    half = replace(m, seq_length=16, max_position_embeddings=32)
    assert chunk_activation_bytes(m, replace(lay, recompute="selective"), 0, 0) == \
        chunk_activation_bytes(half, replace(lay, cp=1, recompute="selective"), 0, 0) + 16 * 16
    assert plan.flops_per_step == num_floating_point_operations(args, 16)  # the log line's, CP or not


def test_cp_exchange_formula_by_comm_type():
    """cp_exchange_bytes (shared by bench/context_parallel.py and the planner) by hand: L 2, s 64, b 1,
    a 4, g 2, hn 16, fp32, CP 4."""
    from megatron.core.context_parallel import cp_exchange_bytes

    kv = 64 // 4 * 2 * 16 * 4  # one rank's K (or V) block [s/c, b, g, hn] in bytes
    assert cp_exchange_bytes("p2p", 4, 2, 64, 1, 4, 2, 16) == 2 * 2 * 3 * 2 * kv  # 3 shifts of K and V, each way
    assert cp_exchange_bytes("allgather", 4, 2, 64, 1, 4, 2, 16) == 2 * 2 * 2 * 4 * kv
    assert cp_exchange_bytes("allgather", 4, 2, 64, 1, 4, 2, 16, sent=True) == 2 * 2 * 2 * 3 * kv
    # a2a: 4 does not divide 2 groups, so K/V go as 4 heads: q, k, v, context of [s/c, b, 4, hn], 3/4 leave
    assert cp_exchange_bytes("a2a", 4, 2, 64, 1, 4, 2, 16) == 2 * 2 * 3 / 4 * 4 * (2 * kv)
    assert cp_exchange_bytes("a2a", 1, 2, 64, 1, 4, 2, 16) == 0.0


def test_plan_tool_prints_and_searches_cp_layouts(capsys):
    """tools/plan.py: a CP layout's plan names its CP group and traffic; --search-context-parallel-sizes
    adds CP (each comm type) to the search, which by default leaves CP out; what is not modelled says so."""
    from tools.plan import main

    assert main(SMALL + ["--world-size", "4", "--context-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "plan: tp1-cp2-pp1-dp2-mbs2" in out and "context parallel: 2 ranks (p2p) of 16 tokens each" in out
    assert "TP / CP / PP / DP / EP sent per step" in out
    long_seq = list(LLAMA_7B)
    for flag in ("--seq-length", "--max-position-embeddings"):
        long_seq[long_seq.index(flag) + 1] = "32768"
    assert main(long_seq + ["--world-size", "64", "--search", "--top", "3"]) == 0
    assert "-cp" not in capsys.readouterr().out
    assert main(long_seq + ["--world-size", "64", "--search", "--top", "3", "--search-context-parallel-sizes",
                            "1", "2", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "-cp" in lines[2], lines  # at 32k tokens CP beats spending the devices elsewhere
    assert main(SMALL + ["--world-size", "4", "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                         "--hierarchical-context-parallel-sizes", "2", "2"]) == 2
    assert "a2a+p2p is not modelled" in capsys.readouterr().err
    assert main(SMALL + ["--world-size", "2", "--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a", "p2p",
                         "a2a"]) == 2
    assert "a different type per layer is not modelled" in capsys.readouterr().err


def test_dry_run_prints_the_cp_plan(monkeypatch, capsys):
    import pretrain_gpt
    from megatron.training import training

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(training, "initialize_megatron", lambda *a, **k: pytest.fail("--dry-run initialized"))
    with pytest.raises(SystemExit) as exit_info:
        training.pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                          pretrain_gpt.ModelType.encoder_or_decoder, pretrain_gpt.forward_step,
                          argv=SMALL + ["--dry-run", "--context-parallel-size", "2", "--cp-comm-type", "allgather"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "plan: tp1-cp2allgather-pp1-dp1-mbs2" in out and "context parallel: 2 ranks (allgather)" in out
