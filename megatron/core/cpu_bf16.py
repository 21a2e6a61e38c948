"""Is bf16 compute fast on this CPU? A few-millisecond probe, measured once per process.

A CPU without native bf16 instructions (AVX2 only: no AVX512_BF16, no AMX) runs torch's bf16
GEMMs through a slow emulation: on an AMD EPYC with AVX2 only, 1.2 GFLOP/s against 168 in fp32.
--bf16 training (or generation) there is about 100x slower than fp32 and nothing says why, so
initialize_megatron prints slow_bf16_warning()'s line and the benches skip their bf16 runs.

    speed = bf16_speed()          # Bf16Speed(fp32_gflops, bf16_gflops), cached
    speed.ratio                   # how many times slower bf16 is than fp32 (< 1: faster)
    slow_bf16_warning()           # the warning line, or None when bf16 is fast (or on a GPU)

The probe times PROBE_SIZE x PROBE_SIZE matmuls on one thread (threads waiting on each other
on a shared machine would blur the comparison; the instruction set is what is measured), the best
of a few timings per precision. Its ratio understates the slowdown of large GEMMs (the emulated
path falls further behind as the size grows), so the warning quotes it as a lower bound. Tests
replace bf16_speed (monkeypatch) to play either CPU. The processor's flags are named for the
reader; the decision is the measured ratio's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

PROBE_SIZE = 128
# bf16 more than this many times slower than fp32 counts as slow. A CPU with native bf16 measures
# 0.3-3x at the probe's size (bf16 is usually faster; at tiny sizes the call overhead dominates),
# the emulated path 25-150x: the threshold sits far from both.
SLOW_RATIO = 4.0
_FP32_REPEATS = 5
_BF16_REPEATS = 3
NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")

_cached: Optional["Bf16Speed"] = None


@dataclass(frozen=True)
class Bf16Speed:
    fp32_gflops: float
    bf16_gflops: float

    @property
    def ratio(self) -> float:
        """How many times slower a bf16 matmul is than an fp32 one."""
        return self.fp32_gflops / self.bf16_gflops

    @property
    def slow(self) -> bool:
        return self.ratio > SLOW_RATIO


def _best_seconds(dtype: torch.dtype, n: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    torch.matmul(a, b)  # warm-up: the kernel's first call picks and prepares its code path
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure_bf16_speed(n: int = PROBE_SIZE) -> Bf16Speed:
    """Time n x n matmuls in fp32 and bf16 on one thread (uncached; bf16_speed() caches it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops = 2 * n ** 3
        fp32 = flops / _best_seconds(torch.float32, n, _FP32_REPEATS) / 1e9
        bf16 = flops / _best_seconds(torch.bfloat16, n, _BF16_REPEATS) / 1e9
    finally:
        torch.set_num_threads(threads)
    return Bf16Speed(fp32, bf16)


def bf16_speed() -> Bf16Speed:
    """The probe's result for this process (measured on the first call)."""
    global _cached
    if _cached is None:
        _cached = measure_bf16_speed()
    return _cached


def native_bf16_flags() -> Optional[list]:
    """The processor's bf16 flags in /proc/cpuinfo ([] when none), None where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [flag for flag in NATIVE_FLAGS if flag in flags]
    except OSError:
        pass
    return None


def slow_bf16_warning(what: str = "bf16 compute", advice: str = "") -> Optional[str]:
    """One line when bf16 matmuls on this CPU are over SLOW_RATIO times slower than fp32, else None.

    what: what will be slow (e.g. '--bf16 training'); advice: appended after '; '. Never probes on
    a GPU machine."""
    from megatron.core import device

    if device.accelerator_available():
        return None
    speed = bf16_speed()
    if not speed.slow:
        return None
    flags = native_bf16_flags()
    named = ("" if flags is None else f"; no {'/'.join(NATIVE_FLAGS)} in /proc/cpuinfo" if not flags
             else f"; /proc/cpuinfo lists {', '.join(flags)}")
    return (f"WARNING: this CPU has no fast bf16 path: a {PROBE_SIZE}x{PROBE_SIZE} bf16 matmul measured "
            f"{speed.ratio:.0f}x slower than fp32 ({speed.bf16_gflops:.2g} vs {speed.fp32_gflops:.3g} GFLOP/s on "
            f"one thread{named}); {what} will be at least that much slower than in fp32"
            + (f"; {advice}" if advice else ""))
