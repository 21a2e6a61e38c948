"""Checkpoint I/O: the converter's peak memory against the model size, and save / load times.

    python bench/checkpoint_io.py                       # a ~1.2 GB fp32 model, both parts
    python bench/checkpoint_io.py --part convert --hidden-size 1024 --num-layers 4   # smaller
    python bench/checkpoint_io.py --json

convert: a checkpoint of a GPT-style model (GPT-2's vocabulary, learned positions, fp32; about
1.2 GB with the defaults) is written at TP = 2 PP = 1 (the two files hold the whole model), then
`tools/checkpoint/convert.py` rewrites it at TP = 1 PP = 1 in a child process, with and without the
verification. Printed per run: the wall time, the child's peak resident set (ru_maxrss: every page
it touched and held at once, anonymous or file-backed: VmHWM) and its peak anonymous memory (RssAnon,
sampled every 10 ms from /proc: what the conversion itself allocated), each also as a multiple of
the model's bytes. The largest tensor and one layer's bytes are printed beside them.

io: save and load times of one model + Adam state through
megatron.training.checkpointing, `--ckpt-format torch` vs `torch_dist`, synchronous and `--async-save`
(the time training waits, and the time until the checkpoint is complete).

Figures are of this machine in this run; compare them within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, Iterator, Tuple

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


# ----------------------------------------------------------------------------- the model


def model_args(hidden: int, layers: int, heads: int, vocab: int, seq: int) -> argparse.Namespace:
    import contextlib
    import io

    from megatron.training.arguments import parse_and_validate_args

    with contextlib.redirect_stdout(io.StringIO()):  # not the arguments table
        args = parse_and_validate_args(argv=[
            "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(vocab - 1)])
    from megatron.convert.layout_rules import padded_vocab_size

    args.tensor_model_parallel_size = args.world_size = 2  # the source checkpoint's layout
    args.padded_vocab_size = padded_vocab_size(vocab, 128, 2)
    return args


def shapes(args: argparse.Namespace) -> Dict[str, Tuple[int, ...]]:
    """The TP = 1 state dict's shapes, from a model built without initialization (then freed)."""
    from megatron.training.arguments import core_transformer_config_from_args, gpt_model_kwargs
    from megatron.model import GPTModel

    serial = argparse.Namespace(**{**vars(args), "tensor_model_parallel_size": 1, "perform_initialization": False})
    model = GPTModel(core_transformer_config_from_args(serial), vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, **gpt_model_kwargs(serial))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def random_stream(sizes: Dict[str, Tuple[int, ...]]) -> Iterator[Tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    for name, shape in sizes.items():
        yield name, torch.randn(shape, generator=generator) * 0.02


def write_source(save_dir: str, args: argparse.Namespace, sizes: Dict[str, Tuple[int, ...]]) -> None:
    from megatron.convert.megatron_format import Metadata, write_tensors

    write_tensors(save_dir, Metadata(args, 1, False, None), random_stream(sizes), tp=2, pp=1)


# ----------------------------------------------------------------------------- measuring a child


def _status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_measured(argv) -> Dict[str, float]:
    """Run argv; its wall time, ru_maxrss and peak RssAnon (sampled every 10 ms), in bytes."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(argv, cwd=_ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        peak_anon = 0
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            peak_anon = max(peak_anon, _status_kib(child.pid, "RssAnon"))
            time.sleep(0.01)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        log.seek(0)
        out = log.read()
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{out[-2000:]}")
    return {"seconds": wall, "peak_rss": usage.ru_maxrss * 1024, "peak_anon": peak_anon * 1024, "output": out}


_CHILD = """import runpy, sys
sys.argv = sys.argv[1:]
try:
    if sys.argv[0] != "-":
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        import torch, tools.checkpoint.convert, megatron.convert.verify
finally:
    with open("/proc/self/status") as f:
        print("VmHWM", next(line.split()[1] for line in f if line.startswith("VmHWM:")), flush=True)
"""


def measured_child(argv) -> Dict[str, float]:
    """run_measured of a Python child that prints its own peak RSS (VmHWM) at exit: ru_maxrss of a
    forked child starts from the parent's peak, so it cannot be used here."""
    measured = run_measured([sys.executable, "-c", _CHILD, *argv])
    lines = [line for line in measured["output"].splitlines() if line.startswith("VmHWM ")]
    measured["peak_rss"] = int(lines[-1].split()[1]) * 1024
    return measured


def _baseline() -> Dict[str, float]:
    """What a child that imports torch and the converter and does nothing else holds."""
    return measured_child(["-"])


def bench_convert(hidden: int, layers: int, heads: int, vocab: int, seq: int, workdir: str) -> Dict[str, float]:
    args = model_args(hidden, layers, heads, vocab, seq)
    sizes = shapes(args)
    element = 4
    model_bytes = sum(torch.Size(s).numel() for s in sizes.values()) * element
    largest = max(torch.Size(s).numel() for s in sizes.values()) * element
    layer = sum(torch.Size(s).numel() for n, s in sizes.items() if n.startswith("decoder.layers.0.")) * element
    source = os.path.join(workdir, "tp2")
    write_source(source, args, sizes)
    result = {"model_bytes": model_bytes, "largest_tensor_bytes": largest, "layer_bytes": layer}
    base = _baseline()
    result["baseline_peak_rss"], result["baseline_peak_anon"] = base["peak_rss"], base["peak_anon"]
    script = os.path.join(_ROOT, "tools", "checkpoint", "convert.py")
    for name, extra in (("convert", ["--no-verify"]), ("convert+verify", [])):
        target = os.path.join(workdir, name)
        measured = measured_child([script, "--model-type", "GPT", "--load-dir", source,
                                 "--save-dir", target, "--target-tensor-parallel-size", "1", *extra])
        shutil.rmtree(target)
        for key in ("seconds", "peak_rss", "peak_anon"):
            result[f"{name}_{key}"] = measured[key]
    return result


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def print_convert(r: Dict[str, float]) -> None:
    model = r["model_bytes"]
    print(f"model: {_gb(model)} fp32 ({model / 4 / 1e6:.0f}M parameters); largest tensor "
          f"{_gb(r['largest_tensor_bytes'])}, one layer {_gb(r['layer_bytes'])}")
    print(f"a child importing torch + the converter: peak RSS {_gb(r['baseline_peak_rss'])}, "
          f"anonymous {_gb(r['baseline_peak_anon'])}; 'x model' below is (peak - that) / model bytes")
    print(f"{'TP2 -> TP1':<16} {'seconds':>8} {'peak RSS':>12} {'x model':>8} {'peak anon':>12} {'x model':>8}")
    for name in ("convert", "convert+verify"):
        rss, anon = r[name + "_peak_rss"], r[name + "_peak_anon"]
        print(f"{name:<16} {r[name + '_seconds']:>8.1f} {_gb(rss):>12} {(rss - r['baseline_peak_rss']) / model:>8.2f} "
              f"{_gb(anon):>12} {(anon - r['baseline_peak_anon']) / model:>8.2f}")


# ----------------------------------------------------------------------------- save / load times

IO_CASES = (("torch", False), ("torch_dist", False), ("torch_dist", True))


def bench_io(hidden: int, layers: int, heads: int, vocab: int, seq: int, workdir: str) -> Dict[str, Dict[str, float]]:
    """One real training step of pretrain_gpt.py (one process, Adam), then, where it would save, a
    timed save + load of its model, optimizer and scheduler in each format (IO_CASES)."""
    import megatron.training.checkpointing as checkpointing
    import pretrain_gpt
    from megatron.training.checkpointing import benchmark_save_load

    results: Dict[str, Dict[str, float]] = {}

    def timed(iteration, model, optimizer, scheduler, args, *rest, **kwargs):
        checkpointing.save_checkpoint = original  # what benchmark_save_load calls
        for fmt, asynchronous in IO_CASES:
            name = fmt + (" async" if asynchronous else "")
            results[name] = benchmark_save_load(model, optimizer, scheduler, args, os.path.join(workdir, name.replace(" ", "_")),
                                                fmt, asynchronous, iteration=iteration)

    argv = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(vocab - 1), "--save", os.path.join(workdir, "unused"), "--save-interval", "1",
            "--eval-iters", "0", "--num-workers", "0", "--log-interval", "1"]
    original = checkpointing.save_checkpoint
    checkpointing.save_checkpoint = timed
    try:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            pretrain_gpt.main(argv)
    finally:
        checkpointing.save_checkpoint = original
    if not results:
        raise RuntimeError("pretrain_gpt.py did not save: nothing was timed")
    return results


def print_io(results: Dict[str, Dict[str, float]]) -> None:
    print(f"{'format':<18} {'GiB':>6} {'save (training waits)':>22} {'complete':>9} {'load':>7}  seconds")
    for name, r in results.items():
        print(f"{name:<18} {r['bytes'] / 2**30:>6.2f} {r['save']:>22.2f} {r['finalize']:>9.2f} {r['load']:>7.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("all", "convert", "io"), default="all")
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=5)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--io-hidden-size", type=int, default=1024)
    parser.add_argument("--io-num-layers", type=int, default=8)
    parser.add_argument("--workdir", type=str, default=None, help="Scratch folder (default: a temporary one).")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    workdir = options.workdir or tempfile.mkdtemp(prefix="checkpoint_io.")
    results = {}
    try:
        if options.part in ("all", "convert"):
            results["convert"] = bench_convert(options.hidden_size, options.num_layers, options.num_attention_heads,
                                               options.vocab_size, options.seq_length, os.path.join(workdir, "c"))
            if not options.json:
                print_convert(results["convert"])
        if options.part in ("all", "io"):
            results["io"] = bench_io(options.io_hidden_size, options.io_num_layers, options.num_attention_heads,
                                     options.vocab_size, options.seq_length, os.path.join(workdir, "io"))
            if not options.json:
                print(f"save and load, one process, a GPT of hidden {options.io_hidden_size} x {options.io_num_layers} "
                      "layers with its Adam state:")
                print_io(results["io"])
    finally:
        if options.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if options.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
