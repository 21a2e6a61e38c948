"""The machine's measured matrix-multiply ceiling: fp32 and bf16 GFLOP/s with torch.

    python bench/peak.py                       # both precisions, printed as a table
    python bench/peak.py --sizes 1024,2048 --repeats 9 --json

    from bench.peak import measure_peaks       # or `import peak` from inside bench/
    peaks = measure_peaks()                    # {"fp32": GFLOP/s, "bf16": GFLOP/s, ...}

Square matmuls C = A @ B of a few sizes n; one matmul is 2 n^3 FLOPs. For each size, after
warm-up, `repeats` timings of a batch of matmuls (enough to last about 50 ms, so the timer's
resolution and the call overhead do not count); the figure of a size is the median of its
timings, and the ceiling of a precision is the best size's figure. On a CPU shared with other
jobs, timings during which this process did not get its threads' time (process CPU time /
(wall x threads) under 0.9) are left out of the median. MFU elsewhere is measured
against this ceiling, not against a datasheet peak: it is what torch's GEMM reaches on this
machine, with the threads it may use.

On CPU the threads are the cores this process may run on (os.sched_getaffinity). On a CUDA
machine the same script measures the GPU (bigger sizes), going through megatron.core.device
for the device and the synchronisation, as the rest of the project does.

On a CPU without a fast bf16 path (megatron/core/cpu_bf16.py's probe: bf16 over 4x slower than
fp32, e.g. AVX2 only) bf16 is skipped with the reason printed: its ceiling alone would take many
minutes. --allow-slow-bf16 measures it anyway; compare_peers.py and generation.py do the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_SIZES = (256, 512, 1024, 2048)
GPU_SIZES = (2048, 4096, 8192)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIN_BATCH_SECONDS = 0.05
MIN_CPU_SHARE = 0.9
MAX_TRIES_PER_REPEAT = 4


def _device_module():
    """megatron.core.device (the project's one door to the accelerator), importable from bench/."""
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    from megatron.core import device

    return device


def slow_bf16_reason() -> str | None:
    """Why this machine's bf16 measurements are skipped, or None when bf16 is worth measuring.

    A CPU without a native bf16 path (AVX2 only) runs bf16 GEMMs ~100x slower than fp32: the
    bf16 ceiling alone would take many minutes at CPU_SIZES (n = 2048 is 17 GFLOP a matmul), and a
    bf16 training run as long. megatron.core.cpu_bf16's few-millisecond probe decides; never on a GPU."""
    device_mod = _device_module()
    if device_mod.accelerator_available():
        return None
    from megatron.core import cpu_bf16

    speed = cpu_bf16.bf16_speed()
    if not speed.slow:
        return None
    return (f"bf16 skipped: this CPU has no fast bf16 path (a {cpu_bf16.PROBE_SIZE}x{cpu_bf16.PROBE_SIZE} bf16 "
            f"matmul measured {speed.ratio:.0f}x slower than fp32, over {cpu_bf16.SLOW_RATIO:g}x), so its "
            f"measurements would not finish in reasonable time; --allow-slow-bf16 runs them anyway")


def drop_slow_bf16(precisions: Sequence[str], allow_slow: bool = False) -> tuple[list[str], str | None]:
    """(precisions without bf16 when slow_bf16_reason() gives a reason, that reason or None)."""
    if "bf16" not in precisions or allow_slow:
        return list(precisions), None
    reason = slow_bf16_reason()
    return ([p for p in precisions if p != "bf16"] if reason else list(precisions)), reason


def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def matmul_flops(n: int) -> int:
    """FLOPs of one n x n by n x n matmul: n^2 outputs, each n multiply-adds."""
    return 2 * n ** 3


def _time_batch(a: torch.Tensor, b: torch.Tensor, count: int, sync) -> tuple[float, float]:
    """(wall seconds of `count` matmuls, CPU share = process CPU time / (wall x torch threads))."""
    sync()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(count):
        torch.matmul(a, b)
    sync()
    wall = time.perf_counter() - start
    return wall, (time.process_time() - cpu_start) / wall / torch.get_num_threads()


def uncontended(timings: list[tuple[float, float]], min_share: float) -> list[float]:
    """The seconds of the timings that had the cores (CPU share >= min_share)."""
    return [seconds for seconds, share in timings if share >= min_share]


def measure_size(n: int, dtype: torch.dtype, repeats: int, device: torch.device, sync,
                 min_share: float | None = MIN_CPU_SHARE) -> tuple[float, bool]:
    """(median GFLOP/s of n x n matmuls in `dtype` on `device`, whether any timing had the cores).

    On a CPU shared with other jobs, timings during which this process got less than min_share
    of its threads' time are left out and timed again, up to MAX_TRIES_PER_REPEAT x repeats timings
    in all; if none had the cores, the median of all is returned with False."""
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    first = _time_batch(a, b, 2, sync)[0] / 2  # warm-up; also sizes the batch
    count = max(1, int(MIN_BATCH_SECONDS / max(first, 1e-6)))
    _time_batch(a, b, count, sync)
    min_share = min_share if min_share is not None else 0.0
    timings: list[tuple[float, float]] = []
    while len(timings) < MAX_TRIES_PER_REPEAT * repeats:  # until `repeats` uncontended timings
        timings.append(_time_batch(a, b, count, sync))
        if sum(share >= min_share for _, share in timings) >= repeats:
            break
    clean = uncontended(timings, min_share)
    seconds = statistics.median(clean or [seconds for seconds, _ in timings])
    return matmul_flops(n) * count / seconds / 1e9, bool(clean)


def measure_peaks(sizes: Sequence[int] | None = None, repeats: int = 7,
                  precisions: Sequence[str] = ("fp32", "bf16"), threads: int | None = None) -> dict:
    """Measured matmul ceiling per precision, in GFLOP/s.

    Returns {"fp32": float, "bf16": float, "by_size": {precision: {n: GFLOP/s}}, "contended":
    {precision: [n whose every timing shared the cores]}, "device": str, "threads": int}. The
    ceiling is the best uncontended size (the best size if all were contended). On CPU torch uses
    `threads` (default: available_cores()); the previous thread count is restored afterwards.
    """
    device_mod = _device_module()
    on_gpu = device_mod.accelerator_available()
    dev = device_mod.get_device()
    sizes = tuple(sizes) if sizes else (GPU_SIZES if on_gpu else CPU_SIZES)
    previous = torch.get_num_threads()
    threads = threads or available_cores()
    torch.set_num_threads(threads)
    try:
        min_share = None if on_gpu else MIN_CPU_SHARE  # on a GPU the host only waits
        measured = {p: {n: measure_size(n, DTYPES[p], repeats, dev, device_mod.synchronize, min_share)
                         for n in sizes} for p in precisions}
    finally:
        torch.set_num_threads(previous)
    by_size = {p: {n: gflops for n, (gflops, _) in table.items()} for p, table in measured.items()}
    contended = {p: [n for n, (_, clean) in table.items() if not clean] for p, table in measured.items()}
    result = {p: max([g for n, g in by_size[p].items() if n not in contended[p]] or by_size[p].values())
              for p in precisions}
    result.update(by_size=by_size, contended=contended, device=device_mod.device_name(), threads=threads)
    return result


def format_peaks(peaks: dict) -> str:
    """The table bench/peak.py prints (and compare_peers.py / docs/PERFORMANCE.md quote)."""
    sizes = sorted({n for table in peaks["by_size"].values() for n in table})
    lines = [f"matmul ceiling on {peaks['device']} ({peaks['threads']} threads), GFLOP/s, median of repeats:",
             "  n      " + "".join(f"{p:>10}" for p in peaks["by_size"])]
    contended = peaks.get("contended", {})
    for n in sizes:
        lines.append(f"  {n:<7}" + "".join(
            f"{peaks['by_size'][p][n]:>9.1f}" + ("*" if n in contended.get(p, ()) else " ") for p in peaks["by_size"]))
    lines.append("  peak   " + "".join(f"{peaks[p]:>9.1f} " for p in peaks["by_size"]))
    if any(contended.values()):
        lines.append("  * every timing shared the cores with other jobs; not used for the peak unless all were")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help=f"comma-separated n (default CPU {CPU_SIZES}, GPU {GPU_SIZES})")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: available cores)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--allow-slow-bf16", action="store_true",
                        help="measure bf16 even on a CPU without a fast bf16 path (can take many minutes)")
    args = parser.parse_args(argv)
    precisions, skipped = drop_slow_bf16(tuple(DTYPES), args.allow_slow_bf16)
    if skipped:
        print(skipped, file=sys.stderr if args.json else sys.stdout, flush=True)
    peaks = measure_peaks(args.sizes, args.repeats, precisions=precisions, threads=args.threads)
    print(json.dumps(peaks) if args.json else format_peaks(peaks))


if __name__ == "__main__":
    main()
