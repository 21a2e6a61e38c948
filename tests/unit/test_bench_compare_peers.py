"""bench/compare_peers.py and bench/peak.py: the FLOPs formula, MFU, the ratio lines and how a
framework that cannot run is reported, and bf16 skipped with its reason on a CPU without a fast bf16
path (the probe replaced). No timings are asserted."""

from __future__ import annotations

import re
import sys

import pytest

from bench import compare_peers as cp
from bench import peak
from megatron.training.training_log import num_floating_point_operations
from tests.helpers.args import run_args

RATIO_LINE = re.compile(r"^(fp32|bf16): ratio vs transformers (\d+\.\d\dx|missing \(.+\)) "
                        r"\| ratio vs megatron-core (\d+\.\d\dx|missing \(.+\))$")


def measured(framework: str, ms: float | None, missing: str | None = None) -> cp.Measured:
    return cp.Measured(framework, "fp32", step_ms=[] if ms is None else [ms, ms * 0.9, ms * 1.1], missing=missing)


def test_flops_formula_is_megatrons():
    s = cp.SHAPE
    assert cp.matmul_params() == 12 * 4 * 256 ** 2 + 8192 * 256 == 5_242_880
    args = run_args(seq_length=s.seq, num_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
                    kv_channels=s.hidden // s.heads, ffn_hidden_size=4 * s.hidden, padded_vocab_size=s.vocab)
    # the log line's count (core_v0.13) takes the causal half of the s x s scores: 6 B L s^2 h fewer
    causal_half = 6 * s.micro_batch * s.layers * s.seq ** 2 * s.hidden
    assert cp.flops_per_step() - causal_half == pytest.approx(num_floating_point_operations(args, s.micro_batch),
                                                              rel=1e-12)
    # 72 B s L h^2 (1 + s/6h + V/12Lh), the paper's closed form.
    closed = 72 * 8 * 256 * 4 * 256 ** 2 * (1 + 256 / (6 * 256) + 8192 / (12 * 4 * 256))
    assert cp.flops_per_step() == pytest.approx(closed, rel=1e-12)


def test_mfu_is_model_flops_over_the_measured_ceiling():
    assert cp.mfu(step_seconds=0.5, flops=70e9, peak_gflops=200.0) == pytest.approx(0.7)
    assert cp.mfu(1.0, 1e9, 1.0) == pytest.approx(1.0)


def test_tokens_per_s_uses_the_median_step():
    m = measured("ours", 1000.0)  # steps 900, 1000, 1100 ms
    assert m.median_ms == 1000.0
    assert m.tokens_per_s == pytest.approx(cp.SHAPE.tokens_per_step)


def test_ratio_line_is_ours_tokens_per_s_over_the_peers():
    results = {"ours": measured("ours", 500.0), "transformers": measured("transformers", 1000.0),
               "megatron-core": measured("megatron-core", 400.0)}
    line = cp.ratio_line("fp32", results)
    assert line == "fp32: ratio vs transformers 2.00x | ratio vs megatron-core 0.80x"
    assert RATIO_LINE.match(line)


def test_a_missing_peer_is_named_with_its_reason_never_a_number():
    results = {"ours": measured("ours", 500.0), "transformers": measured("transformers", 1000.0),
               "megatron-core": measured("megatron-core", None, missing="ImportError: no module named x")}
    line = cp.ratio_line("bf16", results)
    assert line == "bf16: ratio vs transformers 2.00x | ratio vs megatron-core missing (ImportError: no module named x)"
    assert RATIO_LINE.match(line)
    results["ours"] = measured("ours", None, missing="RuntimeError: boom")
    line = cp.ratio_line("bf16", results)
    assert "ratio vs transformers missing (ours: RuntimeError: boom)" in line
    assert RATIO_LINE.match(line)


def test_missing_reason_is_one_short_line():
    assert cp.missing_reason(ImportError("No module named 'megatron.core.models'\nmore")) == \
        "ImportError: No module named 'megatron.core.models'"
    long = cp.missing_reason(RuntimeError("x" * 500), limit=40)
    assert len(long) == 40 and long.endswith("...")
    assert cp.missing_reason(KeyError()) == "KeyError"


def test_table_shows_mfu_and_missing_rows():
    peaks = {"fp32": 100.0, "bf16": 200.0}
    results = {("fp32", "ours"): measured("ours", 1000.0),
               ("fp32", "megatron-core"): measured("megatron-core", None, missing="ImportError: gone")}
    rows = cp.table_rows(results, peaks)
    gflops = cp.flops_per_step() / 1e9  # per second at 1 s/step
    assert f"{gflops:.1f}" in rows[1] and f"{gflops / 100 * 100:.1f}%" in rows[1]
    assert rows[2].split()[:3] == ["fp32", "megatron-core", "missing"] and "(ImportError: gone)" in rows[2]


def test_worker_output_parsing_and_crashes_become_missing():
    out = "noise\n" + cp.RESULT_TAG + '{"step_ms": [1.0], "cpu_share": [0.99], "loss": 9.0, "notes": {}}\n'
    assert cp.parse_worker_output(out, "", 0)["step_ms"] == [1.0]
    crashed = cp.parse_worker_output("noise", "Traceback\nSegfault-ish: died", -11)
    assert crashed == {"missing": "worker exited -11: Segfault-ish: died"}


def test_steps_that_shared_their_cores_are_dropped():
    assert cp.clean_steps([500.0, 900.0, 510.0], [0.99, 0.5, 0.95], min_share=0.9) == [500.0, 510.0]
    assert cp.clean_steps([500.0, 900.0], None, min_share=0.9) == [500.0, 900.0]  # accelerator: no shares
    assert peak.uncontended([(1.0, 0.99), (3.0, 0.4)], 0.9) == [1.0]
    assert peak.uncontended([(1.0, 0.5), (3.0, 0.4)], 0.9) == []


def test_megatron_core_absent_is_reported_without_starting_a_process(tmp_path):
    args = cp.parse_args(["--mcore-path", str(tmp_path / "nowhere")])
    out = cp.spawn("megatron-core", "fp32", args)
    assert out["missing"].startswith("megatron-core not found at")


def test_this_projects_megatron_is_never_taken_for_megatron_core(monkeypatch):
    import megatron.core  # noqa: F401  (this project's, as in every test process)

    monkeypatch.setattr(sys, "path", list(sys.path))  # _import_mcore edits sys.path
    with pytest.raises(ImportError, match="megatron-core is not installed"):
        cp._import_mcore()


def test_peak_helpers():
    assert peak.matmul_flops(3) == 54
    assert peak.available_cores() >= 1
    table = peak.format_peaks({"fp32": 90.0, "bf16": 300.0, "device": "cpu", "threads": 2,
                               "by_size": {"fp32": {256: 50.0, 512: 90.0}, "bf16": {256: 300.0, 512: 250.0}}})
    assert table.splitlines()[-1].split() == ["peak", "90.0", "300.0"]
    marked = peak.format_peaks({"fp32": 90.0, "device": "cpu", "threads": 2, "by_size": {"fp32": {256: 9.0, 512: 90.0}},
                                "contended": {"fp32": [256]}})
    assert "9.0*" in marked and "shared the cores" in marked.splitlines()[-1]


def test_peak_measures_something_positive_for_a_tiny_size():
    peaks = peak.measure_peaks(sizes=[32], repeats=1, precisions=("fp32",), threads=1)
    assert peaks["fp32"] > 0 and peaks["threads"] == 1 and set(peaks["by_size"]) == {"fp32"}


def test_best_peaks_prefers_uncontended_measurements():
    def measurement(value: float, contended: list[int]) -> dict:
        return {"fp32": value, "by_size": {"fp32": {256: value, 512: value}}, "contended": {"fp32": contended},
                "device": "cpu", "threads": 2}

    best = cp.best_peaks([measurement(150.0, []), measurement(400.0, [256, 512])], ["fp32"])
    assert best["fp32"] == 150.0 and best["clean"]["fp32"] and best["threads"] == 2
    best = cp.best_peaks([measurement(150.0, [256, 512]), measurement(120.0, [256, 512])], ["fp32"])
    assert best["fp32"] == 150.0 and not best["clean"]["fp32"]


# ---------------------------------------------------------------- --model llama

def test_llama_flops_formula_is_megatrons_with_query_groups_and_swiglu():
    s = cp.LLAMA_SHAPE
    hn = s.hidden // s.heads
    per_layer = s.hidden * (s.heads + 2 * s.query_groups) * hn + s.hidden ** 2 + 3 * s.hidden * s.ffn
    assert cp.matmul_params(s) == s.layers * per_layer + s.vocab * s.hidden == 4_866_048
    args = run_args(seq_length=s.seq, num_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
                    kv_channels=hn, ffn_hidden_size=s.ffn, padded_vocab_size=s.vocab, group_query_attention=True,
                    num_query_groups=s.query_groups, swiglu=True)
    causal_half = 6 * s.micro_batch * s.layers * s.seq ** 2 * s.hidden
    assert cp.flops_per_step(s) - causal_half == pytest.approx(num_floating_point_operations(args, s.micro_batch),
                                                               rel=1e-12)
    assert cp.flops_per_step() == cp.flops_per_step(cp.GPT_SHAPE)  # --model gpt stays the default


def test_llama_flags_parse_to_the_benchmarked_model():
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    s = cp.LLAMA_SHAPE
    argv = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
            "--max-position-embeddings", "256", "--micro-batch-size", "8", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "8191", "--train-iters", "1", "--lr", "1e-4",
            *cp.LLAMA.megatron_flags(s)]
    args = validate_args(parse_args(argv=argv))
    config = core_transformer_config_from_args(args)
    assert (config.normalization, config.num_query_groups, config.gated_linear_unit, config.add_bias_linear,
            config.ffn_hidden_size) == ("RMSNorm", 2, True, False, 688)
    assert args.position_embedding_type == "rope" and args.untie_embeddings_and_output_weights


def test_llama_builders_share_weights_and_first_losses_at_a_tiny_size():
    """bench/compare_llama.py's weights load exactly into ours and into LlamaForCausalLM, and the
    first losses agree (the benchmark prints them; megatron-core gets the same state dict)."""
    pytest.importorskip("transformers")
    import torch
    import torch.nn.functional as F

    from megatron.model import TransformerConfig

    s = cp.GPTShape(family="llama", layers=2, hidden=64, heads=8, query_groups=2, ffn=96, vocab=128, seq=16,
                    micro_batch=2)
    config = TransformerConfig(num_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
                               num_query_groups=s.query_groups, ffn_hidden_size=s.ffn, normalization="RMSNorm",
                               gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                               bias_gelu_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
                               layernorm_epsilon=cp.LLAMA.RMS_EPS)
    ours = cp.LLAMA.build_ours(config, s, vocab_size=s.vocab, num_tokens=s.vocab)
    hf, _ = cp.LLAMA.build_hf(s, torch.device("cpu"))
    tokens = torch.randint(0, s.vocab, (s.micro_batch, s.seq + 1), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(s.seq).expand(s.micro_batch, s.seq)
    with torch.no_grad():
        ours_loss = ours(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        hf_loss = F.cross_entropy(hf(input_ids=tokens[:, :-1]).logits.view(-1, s.vocab), tokens[:, 1:].reshape(-1))
    assert ours_loss.item() == pytest.approx(hf_loss.item(), abs=1e-5)
    with pytest.raises(RuntimeError, match="do not map"):
        cp.LLAMA.load_exactly(ours, {"output_layer.weight": torch.zeros(s.vocab, s.hidden)})


def test_first_loss_line_and_llama_config_line():
    results = {"ours": measured("ours", 500.0), "transformers": measured("transformers", 1000.0),
               "megatron-core": measured("megatron-core", None, missing="ImportError: gone")}
    results["ours"].first_losses, results["transformers"].first_losses = [9.06903], [9.06904]
    assert cp.first_loss_text(results) == ("ours 9.06903 | transformers 9.06904 (ours - it -1.0e-05) | "
                                           "megatron-core missing")
    assert cp.config_text(cp.LLAMA_SHAPE).startswith("Llama-style 4 layers, hidden 256, 8 heads, 2 query groups, "
                                                     "SwiGLU ffn 688, RMSNorm, RoPE")
    assert cp.config_text(cp.GPT_SHAPE).startswith("GPT 4 layers, hidden 256, 8 heads, vocab 8192")
    assert cp.parse_args([]).model == "gpt" and cp.parse_args(["--model", "llama"]).model == "llama"


# ---------------------------------------------------------------- a CPU without a fast bf16 path

@pytest.fixture
def slow_bf16_cpu(monkeypatch):
    """An AVX2-only EPYC as the probe sees it: bf16 1.2 GFLOP/s, fp32 168 (megatron/core/cpu_bf16.py)."""
    from megatron.core import cpu_bf16, device

    monkeypatch.setattr(device, "accelerator_available", lambda: False)
    monkeypatch.setattr(cpu_bf16, "bf16_speed", lambda: cpu_bf16.Bf16Speed(fp32_gflops=168.0, bf16_gflops=1.2))


def test_bf16_is_dropped_with_its_reason_only_where_bf16_is_slow(slow_bf16_cpu, monkeypatch):
    from megatron.core import cpu_bf16

    kept, reason = peak.drop_slow_bf16(["fp32", "bf16"])
    assert kept == ["fp32"]
    assert reason.startswith("bf16 skipped: this CPU has no fast bf16 path (a 128x128 bf16 matmul measured 140x "
                             "slower than fp32, over 4x)") and reason.endswith("--allow-slow-bf16 runs them anyway")
    assert peak.drop_slow_bf16(["fp32", "bf16"], allow_slow=True) == (["fp32", "bf16"], None)
    monkeypatch.setattr(cpu_bf16, "bf16_speed", lambda: cpu_bf16.Bf16Speed(fp32_gflops=100.0, bf16_gflops=180.0))
    assert peak.drop_slow_bf16(["fp32", "bf16"]) == (["fp32", "bf16"], None)


def test_compare_peers_skips_bf16_on_such_a_cpu_before_measuring_anything(slow_bf16_cpu, monkeypatch, capsys):
    monkeypatch.setattr(cp, "spawn", lambda *a: pytest.fail("a bf16 run was started"))
    monkeypatch.setattr(peak, "measure_peaks", lambda *a, **k: pytest.fail("the bf16 ceiling was measured"))
    monkeypatch.setattr(cp, "_load_peak_module", lambda: peak)
    cp.main(["--precisions", "bf16"])
    assert capsys.readouterr().out.splitlines()[0].startswith("bf16 skipped: this CPU has no fast bf16 path")


def test_peak_and_generation_benches_skip_bf16_too(slow_bf16_cpu, monkeypatch, capsys):
    from bench import generation

    peak.main(["--sizes", "32", "--repeats", "1", "--threads", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("bf16 skipped:")
    assert [line.split() for line in out if line.split()[:1] == ["n"]] == [["n", "fp32"]]  # the fp32 column only
    monkeypatch.setattr(generation, "build_models", lambda *a: pytest.fail("models built for a skipped dtype"))
    generation.main(["--dtypes", "bf16"])
    assert capsys.readouterr().out.startswith("bf16 skipped:")
