"""The bf16 speed probe (megatron/core/cpu_bf16.py) and the start-up warning it drives.

The probe is replaced (monkeypatch of cpu_bf16.bf16_speed) to play an AVX2-only CPU (bf16 1.2
GFLOP/s, fp32 168: the figures of the EPYC that prompted it) and one with native bf16; the real
probe is run once at a tiny size to show it measures both precisions and is cached."""

from __future__ import annotations

import pytest
import torch

from megatron.core import cpu_bf16, device

SLOW = cpu_bf16.Bf16Speed(fp32_gflops=168.0, bf16_gflops=1.2)  # an EPYC with AVX2 only
FAST = cpu_bf16.Bf16Speed(fp32_gflops=100.0, bf16_gflops=180.0)  # native bf16 (AVX512_BF16 / AMX)


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(device, "accelerator_available", lambda: False)


def test_probe_measures_both_precisions_on_one_thread_and_is_cached(monkeypatch):
    threads = torch.get_num_threads()
    speed = cpu_bf16.measure_bf16_speed(n=32)
    assert speed.fp32_gflops > 0 and speed.bf16_gflops > 0
    assert speed.ratio == pytest.approx(speed.fp32_gflops / speed.bf16_gflops)
    assert torch.get_num_threads() == threads  # restored after the one-thread timing
    calls = []
    monkeypatch.setattr(cpu_bf16, "_cached", None)
    monkeypatch.setattr(cpu_bf16, "measure_bf16_speed", lambda: calls.append(1) or SLOW)
    assert cpu_bf16.bf16_speed() is SLOW and cpu_bf16.bf16_speed() is SLOW and len(calls) == 1


def test_warning_quotes_the_measured_ratio_when_bf16_is_slow(monkeypatch, cpu):
    monkeypatch.setattr(cpu_bf16, "bf16_speed", lambda: SLOW)
    monkeypatch.setattr(cpu_bf16, "native_bf16_flags", lambda: [])
    line = cpu_bf16.slow_bf16_warning("this --bf16 run", "use fp32")
    assert line == ("WARNING: this CPU has no fast bf16 path: a 128x128 bf16 matmul measured 140x slower than fp32 "
                    "(1.2 vs 168 GFLOP/s on one thread; no avx512_bf16/amx_bf16 in /proc/cpuinfo); this --bf16 run "
                    "will be at least that much slower than in fp32; use fp32")
    assert SLOW.slow and not FAST.slow
    monkeypatch.setattr(cpu_bf16, "bf16_speed", lambda: FAST)
    assert cpu_bf16.slow_bf16_warning() is None


def test_no_probe_on_a_gpu_machine(monkeypatch):
    monkeypatch.setattr(device, "accelerator_available", lambda: True)
    monkeypatch.setattr(cpu_bf16, "bf16_speed", lambda: pytest.fail("probed on a GPU machine"))
    assert cpu_bf16.slow_bf16_warning() is None


def _start_up_output(capsys, argv):
    from megatron.training.initialize import initialize_megatron, reset_megatron
    from tests.helpers.training import MOCK, TINY

    threads = torch.get_num_threads()
    try:
        initialize_megatron(argv=[*TINY, *MOCK, "--train-iters", "1", *argv])
    finally:
        reset_megatron()
        torch.set_num_threads(threads)
    return capsys.readouterr().out


@pytest.mark.parametrize("cpu_kind", ["slow_bf16", "native_bf16"])
def test_start_up_with_bf16_warns_only_on_a_cpu_without_fast_bf16(cpu_kind, monkeypatch, capsys, cpu):
    monkeypatch.setattr(cpu_bf16, "bf16_speed", lambda: SLOW if cpu_kind == "slow_bf16" else FAST)
    lines = [line for line in _start_up_output(capsys, ["--bf16"]).splitlines() if "no fast bf16 path" in line]
    if cpu_kind == "native_bf16":
        assert lines == []
        return
    assert len(lines) == 1
    assert lines[0].startswith("WARNING: this CPU has no fast bf16 path: a 128x128 bf16 matmul measured 140x slower")
    assert lines[0].endswith("this --bf16 run will be at least that much slower than in fp32; "
                             "fp32 (without --bf16) is the fast path on this machine")


def test_start_up_in_fp32_never_probes(monkeypatch, capsys, cpu):
    monkeypatch.setattr(cpu_bf16, "bf16_speed", lambda: pytest.fail("probed without --bf16"))
    assert "bf16 path" not in _start_up_output(capsys, [])
