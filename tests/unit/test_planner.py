"""The planner's formulas (megatron/planner): FLOPs per step are the log line's, bytes per parameter
are Megatron's optimizer table, the bubble is (p - 1) / (v m), the in-flight micro-batches are the
schedules' warm-up counts, the GPT layer's activations are Korthikanti et al.'s plus the norms'
statistics; tools/plan.py and pretrain_gpt.py --dry-run print a plan and exit 0 without a model."""

import pytest

from megatron.arguments import parse_args, validate_args
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
from megatron.training_log import num_floating_point_operations

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


def _args(argv, world_size=1, capsys=None):
    args = parse_args(argv=list(argv))
    args.world_size, args.rank = world_size, 0
    validate_args(args, {})
    if capsys is not None:
        capsys.readouterr()
    return args


@pytest.mark.parametrize("extra", [[], ["--swiglu", "--group-query-attention", "--num-query-groups", "2"],
                                   ["--kv-channels", "32", "--ffn-hidden-size", "100"]], ids=["gpt", "gqa", "odd"])
def test_flops_per_step_are_the_log_lines(extra, capsys):
    args = _args(SMALL + extra, capsys=capsys)
    plan = plan_from_args(args)
    assert plan.flops_per_step == num_floating_point_operations(args, args.global_batch_size)
    big = _args(LLAMA_7B + ["--tensor-model-parallel-size", "2"], world_size=64, capsys=capsys)
    assert plan_from_args(big).flops_per_step == num_floating_point_operations(big, 1024)


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
    assert main(SMALL + ["--num-experts", "4"]) == 2  # not modelled: said so
    capsys.readouterr()
    assert main(LLAMA_7B + ["--world-size", "64", "--search", "--top", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    best = lines[2].split("|")[1].strip()
    tp, pp = (int(part[2:]) for part in best.split("-")[:2])
    assert tp <= 2 and pp <= 2, lines  # Megatron's published 7B layouts: TP 1-2, PP 1-2


def test_dry_run_prints_the_plan_and_exits_before_the_model(monkeypatch, capsys):
    import pretrain_gpt
    from megatron import training

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
