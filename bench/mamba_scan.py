"""Speed of the Mamba-2 scan per token: our chunked SSD scan (megatron/fused_kernels/fused_ssd.py) against the
sequential recurrence it equals (ssd_recurrence, one position at a time) and against HF transformers'
torch path (transformers.models.mamba2.modeling_mamba2.mamba2_chunk_scan, the chunked form Mamba2Mixer's
torch_forward runs when mamba_ssm is not installed).

The three get the same fp32 inputs (x [b, s, nh, hd], dt, A, B and C [b, s, ng, n], D); each case runs
the forward (and with --backward the forward and the backward of sum(y)) `--repeat` times after one
warm-up, and the median is printed as microseconds per token (b x s tokens), with the largest |difference|
of the outputs against ours; "/ ours" is the time of the column before divided by ours (above 1:
ours is faster). The three take turns run by run (a loaded machine slows them alike). The recurrence
is skipped above --max-recurrence-length tokens (it is linear in s with a large constant: one Python
step per position).

    python bench/mamba_scan.py [--heads 8] [--head-dim 64] [--groups 1] [--state 64] [--batch 2]
                               [--lengths 128 512 2048] [--chunk-size 128] [--threads 1] [--backward]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.fused_kernels.fused_ssd import ssd_recurrence, ssd_scan  # noqa: E402


def _inputs(b, s, nh, hd, ng, n, grad):
    g = torch.Generator().manual_seed(0)
    tensors = dict(x=torch.randn(b, s, nh, hd, generator=g), dt=torch.rand(b, s, nh, generator=g) * 0.1 + 1e-3,
                   A=-torch.rand(nh, generator=g) * 4 - 0.5, B=torch.randn(b, s, ng, n, generator=g),
                   C=torch.randn(b, s, ng, n, generator=g), D=torch.randn(nh, generator=g))
    for name in ("x", "B", "C"):
        tensors[name].requires_grad_(grad)
    return tensors


def _timed(fns, repeat, backward):
    """{name: (median seconds, output)}; the functions take turns, run by run, so that a machine's
    changing load falls on all of them alike (the first round warms up)."""
    times = {name: [] for name in fns}
    outputs = {}
    for i in range(repeat + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            out = fn()
            if backward:
                out.sum().backward()
            if i:
                times[name].append(time.perf_counter() - start)
            outputs[name] = out.detach()
    return {name: (statistics.median(times[name]), outputs[name]) for name in fns}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--state", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--max-recurrence-length", type=int, default=512)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
    except ImportError:
        mamba2_chunk_scan = None
    print(f"fp32, {args.threads} thread(s), b {args.batch}, nh {args.heads}, hd {args.head_dim}, ng {args.groups}, "
          f"n {args.state}, chunk {args.chunk_size}, {'forward + backward' if args.backward else 'forward'}; "
          f"median of {args.repeat} runs, microseconds per token")
    print(f"{'s':>6} | {'ours (chunked)':>14} | {'recurrence':>10} | {'/ ours':>6} | {'HF torch':>8} | {'/ ours':>6} "
          f"| max |diff| vs ours")
    for s in args.lengths:
        t = _inputs(args.batch, s, args.heads, args.head_dim, args.groups, args.state, args.backward)
        tokens = args.batch * s
        context = torch.enable_grad() if args.backward else torch.no_grad()
        fns = {"ours": lambda: ssd_scan(**t, chunk_size=args.chunk_size)}
        if s <= args.max_recurrence_length:
            fns["recurrence"] = lambda: ssd_recurrence(**t)[0]
        if mamba2_chunk_scan is not None:
            fns["hf"] = lambda: mamba2_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=args.chunk_size,
                                                  D=t["D"])
        with context:
            result = _timed(fns, args.repeat, args.backward)
        ours, y = result["ours"]
        row, diffs = f"{s:>6} | {1e6 * ours / tokens:>14.2f} | ", []
        for name, width in (("recurrence", 10), ("hf", 8)):
            if name not in result:
                row += f"{'-':>{width}} | {'-':>6} | "
                continue
            seconds, out = result[name]
            row += f"{1e6 * seconds / tokens:>{width}.2f} | {seconds / ours:>6.2f} | "
            diffs.append(f"{name} {(out - y).abs().max().item():.1e}")
        print(row + ", ".join(diffs), flush=True)


if __name__ == "__main__":
    main()
