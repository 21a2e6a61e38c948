"""Step time of data-parallel training with and without --overlap-grad-reduce, on gloo CPU ranks.

For each data-parallel size d, d spawned gloo processes train the same small GPT through the
project's API: DistributedDataParallel + get_megatron_optimizer (Adam) +
forward_backward_no_pipelining + finalize_model_grads, with M micro-batches per rank and step.
Both configurations use the same buckets (--bucket-size elements), so only the overlap differs:

    overlap   each bucket's all-reduce starts asynchronously in the last micro-batch's backward,
              as soon as its gradients are in; finalize_model_grads waits for what is left
    sync      every bucket is all-reduced in finalize_model_grads, after the backward
              (Megatron itself uses one bucket when not overlapping)

The configurations alternate, overlap / sync / overlap / sync (--rounds pairs), each on a freshly
built model, optimizer and DDP wrapper: --warmup untimed steps, then --steps timed ones. A step
is timed per rank from a barrier to the end of optimizer.step(); its time is the slowest rank's.
Printed: the median step time of each configuration over all its timed steps, their ratio, the
median time spent inside finalize_model_grads (the exposed gradient reduction: waiting for the
buckets, or running them), the number of buckets, and what one step sends through
megatron.core.communication, counted on rank 0 (full-tensor bytes, see communication.py).

    python bench/dp_overlap.py [--dp 2 4] [--steps 3] [--warmup 1] [--rounds 3] [--bucket-size 1000000]
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import communication, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,  # noqa: E402
                                       finalize_model_grads)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import schedules  # noqa: E402
from megatron.model import GPTModel, TransformerConfig  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ, MBS, VOCAB, SEED = 4, 256, 8, 256, 4, 1024, 1234
CONFIGS = ("overlap", "sync")


# ------------------------------------------------------------------------------ one rank

def _build(overlap: bool, bucket_size: int) -> Tuple[DistributedDataParallel, Any]:
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=overlap,
                                                                        bucket_size=bucket_size), model)
    ddp.broadcast_params()
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0), [ddp])
    return ddp, optimizer


def _forward_step(data_iterator: Any, model: torch.nn.Module) -> Tuple[torch.Tensor, Callable]:
    tokens, labels = next(data_iterator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    output = model(tokens, positions, None, labels=labels)

    def loss_func(losses: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        loss = losses.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _step(ddp: DistributedDataParallel, optimizer: Any, batches: List[Tuple[torch.Tensor, torch.Tensor]],
          finalize_seconds: List[float]) -> float:
    """One optimizer step over this rank's micro-batches; returns its wall time (from a barrier)."""

    def timed_finalize(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        finalize_model_grads(*args, **kwargs)
        finalize_seconds.append(time.perf_counter() - start)

    dist.barrier()
    start = time.perf_counter()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    schedules.forward_backward_no_pipelining(
        forward_step_func=_forward_step, data_iterator=iter(batches), model=[ddp], num_microbatches=len(batches),
        grad_scale_func=optimizer.scale_loss, finalize_model_grads_func=timed_finalize)
    optimizer.step()
    return time.perf_counter() - start


def _slowest(seconds: List[float]) -> List[float]:
    """Per step, the largest time over the ranks."""
    values = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)  # outside every timed region, not counted
    return values.tolist()


def _worker(rank: int, world_size: int, store_port: int, options: Dict[str, int], results: Any) -> None:
    os.environ["MEGATRON_FORCE_CPU"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    try:
        parallel_state.initialize_model_parallel()
        generator = torch.Generator().manual_seed(SEED + rank)  # each replica its own share of the batch
        batches = [(torch.randint(0, VOCAB, (MBS, SEQ), generator=generator),
                    torch.randint(0, VOCAB, (MBS, SEQ), generator=generator)) for _ in range(options["micro"])]
        measured: Dict[str, Dict[str, Any]] = {name: {"steps": [], "finalize": []} for name in CONFIGS}
        for _ in range(options["rounds"]):
            for name in CONFIGS:
                ddp, optimizer = _build(name == "overlap", options["bucket_size"])
                for _ in range(options["warmup"]):
                    _step(ddp, optimizer, batches, [])
                steps, finalize = [], []
                with communication.count_communication() as counter:
                    steps.append(_step(ddp, optimizer, batches, finalize))
                for _ in range(options["steps"] - 1):
                    steps.append(_step(ddp, optimizer, batches, finalize))
                measured[name]["runs"] = measured[name].get("runs", []) + [statistics.median(_slowest(steps))]
                measured[name]["steps"] += _slowest(steps)
                measured[name]["finalize"] += _slowest(finalize)
                measured[name]["buckets"] = sum(len(buffer.buckets) for buffer in ddp.buffers)
                measured[name]["params"] = sum(p.numel() for p in ddp.module.parameters())
                measured[name]["comm"] = counter.summary()
        if rank == 0:
            results.put(measured)
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def run(d: int, options: Dict[str, int]) -> Dict[str, Dict[str, Any]]:
    """Spawn d ranks; rank 0's measurements by configuration."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))  # a free port, held by the parent
    processes = [ctx.Process(target=_worker, args=(rank, d, store.port, options, results)) for rank in range(d)]
    for process in processes:
        process.start()
    measured = None
    while measured is None and all(process.exitcode in (None, 0) for process in processes):
        try:
            measured = results.get(timeout=1.0)
        except queue.Empty:
            continue
    for process in processes:
        process.join(30 if measured is not None else 5)
        if process.is_alive():
            process.terminate()
            process.join()
    failed = [rank for rank, process in enumerate(processes) if process.exitcode != 0]
    if failed or measured is None:
        raise RuntimeError(f"ranks {failed} of the DP = {d} run failed (see their tracebacks above)")
    return measured


# ------------------------------------------------------------------------------ report

def _comm(summary: Dict[Tuple[str, str], Tuple[int, int]]) -> str:
    return " | ".join(f"{op} {group}: {calls} calls, {nbytes:,} bytes" for (op, group), (calls, nbytes)
                      in summary.items()) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="data-parallel sizes to run")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per rank and step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per run (gloo connects on first use)")
    parser.add_argument("--rounds", type=int, default=3, help="overlap/sync pairs, alternated")
    parser.add_argument("--bucket-size", type=int, default=1_000_000, help="elements per bucket, both configs")
    args = parser.parse_args()
    options = {"micro": args.micro_batches, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
               "bucket_size": args.bucket_size}

    print(f"GPT {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, vocab {VOCAB}; micro-batch {MBS}, "
          f"{args.micro_batches} micro-batches per rank and step; fp32, Adam; gloo on CPU, 1 thread per rank; "
          f"{os.cpu_count()} CPU cores visible")
    print(f"runs per config: {args.rounds} (alternated), each {args.warmup} warm-up + {args.steps} timed steps; "
          f"bucket size {args.bucket_size:,} elements\n")
    for d in args.dp:
        measured = run(d, options)
        overlap, sync = measured["overlap"], measured["sync"]
        step = {name: statistics.median(measured[name]["steps"]) for name in CONFIGS}
        finalize = {name: statistics.median(measured[name]["finalize"]) for name in CONFIGS}
        print(f"DP = {d} ({d} processes), {overlap['params']:,} parameters, buckets: {overlap['buckets']} "
              f"(sync run: {sync['buckets']})")
        for name in CONFIGS:
            runs = ", ".join(f"{seconds * 1e3:.0f}" for seconds in measured[name]["runs"])
            print(f"  {name:<8} median step {step[name] * 1e3:9.1f} ms   median in finalize_model_grads "
                  f"{finalize[name] * 1e3:8.1f} ms   ({len(measured[name]['steps'])} steps; "
                  f"per-run medians {runs} ms)")
        print(f"  overlap / sync step time: {step['overlap'] / step['sync']:.3f}")
        print(f"  communicated per step (rank 0, overlap run): {_comm(overlap['comm'])}")
        print(f"  communicated per step (rank 0, sync run):    {_comm(sync['comm'])}\n")


if __name__ == "__main__":
    main()
