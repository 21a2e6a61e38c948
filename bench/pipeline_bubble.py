"""The pipeline bubble of the real schedules, measured with the schedule tracer, against the theory.

For each configuration (p stages, v model chunks per stage, m micro-batches) p gloo processes run
one global batch through forward_backward_pipelining_without_interleaving (v = 1) or
forward_backward_pipelining_with_interleaving (v > 1), once untimed (gloo connects its pairs on
first use) and then --repeats times with the tracer on.

    measured bubble = mean over ranks r of (makespan - busy_r) / busy_r
        busy_r    the summed wall time of rank r's forward and backward steps
        makespan  first step start to last step end, over all ranks (time.perf_counter is the
                  system-wide monotonic clock, so the ranks' times compare)
    theory          = (p - 1) / m for 1F1B, (p - 1) / (v * m) interleaved
                      (Narayanan et al. 2021, sec. 2.2: bubble time over ideal compute time,
                      with a backward taking twice a forward and free communication)

The table shows the median over the repeats, the smallest and largest per-rank value of that
repeat, and the excess: (makespan - busy x (1 + theory)) / steps per rank, the wall time per step
that the theory does not account for. Whatever is not a step (p2p waits and transfers, the
schedule's own Python) counts as bubble, so the measurement sits above the theory by that
overhead; the interleaved schedule runs v times as many steps (and exchanges) per micro-batch, so
it pays v times as much of it.

Workloads:
    sleep (default)  every chunk is a synthetic stage whose forward sleeps t_f / v and whose backward
                     sleeps 2 t_f / v (an autograd Function): fixed step times, so p processes do
                     not contend for the CPU cores and the schedule alone decides the bubble.
    gpt              the tiny GPT of the tests (8 layers, hidden 32) split over the stages; real
                     compute, so on a machine with fewer cores than p the ranks contend.

    python bench/pipeline_bubble.py [--workload sleep|gpt] [--t-forward-ms 50] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import queue
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.pipeline_parallel import schedules, tracer  # noqa: E402

CONFIGS: List[Tuple[int, int, int]] = [(4, 1, 8), (4, 1, 16), (4, 2, 8), (4, 2, 16), (2, 2, 8)]  # (p, v, m)

SEQ, MBS, HIDDEN = 4, 1, 8                      # the sleep workload's boundary tensor [s, b, h]
GPT_LAYERS, GPT_HIDDEN, GPT_SEQ, GPT_MBS, GPT_VOCAB = 8, 32, 32, 2, 300


# ------------------------------------------------------------------------------ the sleep workload

class _Sleep(torch.autograd.Function):
    """Identity that takes `seconds` forward and 2 x `seconds` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()  # a fresh tensor: the schedule frees a sent output's storage

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad.clone(), None


@dataclass(frozen=True)
class _StageConfig:
    """What the schedules read from a chunk's config: the boundary tensor's shape and dtype."""

    hidden_size: int = HIDDEN
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32


class SleepStage(torch.nn.Module):
    """A model chunk with one scalar weight and fixed forward/backward times."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.config = _StageConfig()
        self.seconds = seconds
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        self.input_tensor = input_tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if self.input_tensor is None else self.input_tensor  # [s, b, h]
        return _Sleep.apply(x * self.weight, self.seconds)


def _sleep_forward_step(data_iterator: Any, model: torch.nn.Module) -> Tuple[torch.Tensor, Callable]:
    output = model(next(data_iterator))

    def loss_func(output_tensor: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _sleep_setup(p: int, v: int, m: int, t_forward: float) -> Tuple[List[torch.nn.Module], List[Any], Callable,
                                                                    Tuple[int, int], Optional[Callable]]:
    chunks = [SleepStage(t_forward / v) for _ in range(v)]  # the rank's compute split over its v chunks
    data = torch.randn(SEQ, MBS, HIDDEN)
    iterators = [itertools.repeat(data) for _ in range(v)]
    return chunks, iterators, _sleep_forward_step, (SEQ, MBS), None


# ------------------------------------------------------------------------------ the GPT workload

def _gpt_setup(p: int, v: int, m: int, t_forward: float) -> Tuple[List[torch.nn.Module], List[Any], Callable,
                                                                  Tuple[int, int], Optional[Callable]]:
    from megatron.core.distributed import finalize_model_grads
    from megatron.model import GPTModel, TransformerConfig

    vpp = v if v > 1 else None
    config = TransformerConfig(num_layers=GPT_LAYERS, hidden_size=GPT_HIDDEN, num_attention_heads=4,
                               pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=vpp,
                               hidden_dropout=0.0, attention_dropout=0.0)
    chunks = []
    for chunk_id in range(v):
        if vpp is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id)
        torch.manual_seed(1234)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        chunks.append(GPTModel(config, vocab_size=384, num_tokens=GPT_VOCAB, max_sequence_length=GPT_SEQ,
                               pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage()))
    if vpp is not None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, GPT_VOCAB, (GPT_MBS, GPT_SEQ), generator=generator)
    labels = torch.randint(0, GPT_VOCAB, (GPT_MBS, GPT_SEQ), generator=generator)
    positions = torch.arange(GPT_SEQ).unsqueeze(0).expand(GPT_MBS, GPT_SEQ)

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> Tuple[torch.Tensor, Callable]:
        next(data_iterator)
        output = model(tokens, positions, None, labels=labels)

        def loss_func(losses: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
            loss = losses.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    iterators = [itertools.repeat(None) for _ in range(v)]
    return chunks, iterators, forward_step, (GPT_SEQ, GPT_MBS), finalize_model_grads


WORKLOADS = {"sleep": _sleep_setup, "gpt": _gpt_setup}


# ------------------------------------------------------------------------------ the worker

def _worker(rank: int, world_size: int, store_port: int, configs: List[Tuple[int, int, int]], workload: str,
            t_forward: float, repeats: int, results: Any) -> None:
    """Run every configuration on this rank; rank 0 sends [(config, [per-repeat per-rank traces])]."""
    os.environ["MEGATRON_FORCE_CPU"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for p, v, m in configs:
            parallel_state.initialize_model_parallel(pipeline_model_parallel_size=p,
                                                     virtual_pipeline_model_parallel_size=v if v > 1 else None)
            chunks, iterators, forward_step, (seq, mbs), finalize = WORKLOADS[workload](p, v, m, t_forward)
            func = schedules.get_forward_backward_func()
            traces = []
            for repeat in range(repeats + 1):  # the first run is untimed: gloo connects on first use
                dist.barrier()
                with tracer.tracing() as trace:
                    func(forward_step_func=forward_step, data_iterator=iterators if v > 1 else iterators[0],
                         model=chunks, num_microbatches=m, seq_length=seq, micro_batch_size=mbs,
                         finalize_model_grads_func=finalize)
                for chunk in chunks:
                    chunk.zero_grad(set_to_none=True)
                if repeat:
                    gathered = [None] * world_size
                    dist.all_gather_object(gathered, trace.events)
                    traces.append(gathered)
            if rank == 0:
                results.put(((p, v, m), traces))
            parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def _run_configs(p: int, configs: List[Tuple[int, int, int]], workload: str, t_forward: float,
                 repeats: int) -> Dict[Tuple[int, int, int], List[List[List[tracer.Event]]]]:
    """Spawn p ranks that run the configurations of p stages; their traces by configuration."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The parent holds the rendezvous store on a free port (port 0), so no one can take it meanwhile.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    processes = [ctx.Process(target=_worker, args=(rank, p, store.port, configs, workload, t_forward, repeats,
                                                   results)) for rank in range(p)]
    for process in processes:
        process.start()
    collected = {}
    # Read while the ranks run: a rank blocks on exit until its queued results are read.
    while len(collected) < len(configs) and all(process.exitcode in (None, 0) for process in processes):
        try:
            config, traces = results.get(timeout=1.0)
        except queue.Empty:
            continue
        collected[config] = traces
    for process in processes:
        process.join(30 if len(collected) == len(configs) else 5)
        if process.is_alive():
            process.terminate()
            process.join()
    failed = [rank for rank, process in enumerate(processes) if process.exitcode != 0]
    if failed or len(collected) < len(configs):
        raise RuntimeError(f"ranks {failed} of the p = {p} run failed (see their tracebacks above)")
    return collected


# ------------------------------------------------------------------------------ the table

def bubble(events_per_rank: List[List[tracer.Event]]) -> List[float]:
    """Per rank, (makespan - busy) / busy with the makespan over all ranks."""
    traces = [tracer.Trace(events=events) for events in events_per_rank]
    start = min(trace.span()[0] for trace in traces)
    end = max(trace.span()[1] for trace in traces)
    return [trace.bubble_fraction(start, end) for trace in traces]


def theory(p: int, v: int, m: int) -> float:
    return (p - 1) / (v * m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="sleep")
    parser.add_argument("--t-forward-ms", type=float, default=50.0,
                        help="sleep workload: a rank's forward time per micro-batch (backward: twice that)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    print(f"workload: {args.workload}" + (f", t_f = {args.t_forward_ms:g} ms per rank and micro-batch "
                                          f"(t_f / v per chunk), t_b = 2 t_f" if args.workload == "sleep" else
                                          f", GPT {GPT_LAYERS} layers, hidden {GPT_HIDDEN}, seq {GPT_SEQ}, "
                                          f"micro-batch {GPT_MBS}"))
    print(f"measured bubble: per rank (makespan - busy) / busy, makespan over all ranks; mean over ranks; "
          f"median of {args.repeats} runs")
    print("theory: (p-1)/m (1F1B), (p-1)/(v*m) (interleaved)\n")
    header = (f"{'schedule':<12} {'p':>2} {'v':>2} {'m':>3} {'makespan ms':>11} {'busy/rank ms':>12} "
              f"{'measured':>9} {'per-rank min..max':>18} {'theory':>7} {'excess ms/step':>14}")
    print(header)
    print("-" * len(header))
    measured: Dict[Tuple[int, int, int], List[List[List[tracer.Event]]]] = {}
    for p in sorted({p for p, _, _ in CONFIGS}, reverse=True):
        configs = [config for config in CONFIGS if config[0] == p]
        measured.update(_run_configs(p, configs, args.workload, args.t_forward_ms / 1000, args.repeats))
    for p, v, m in CONFIGS:
        runs = measured[(p, v, m)]
        means = [statistics.mean(bubble(run)) for run in runs]
        median = sorted(range(len(runs)), key=lambda i: means[i])[len(runs) // 2]
        per_rank = bubble(runs[median])
        events = [event for rank_events in runs[median] for event in rank_events]
        makespan = max(e.end for e in events) - min(e.start for e in events)
        busy = statistics.mean(tracer.Trace(events=rank_events).busy_seconds() for rank_events in runs[median])
        excess = (makespan - busy * (1 + theory(p, v, m))) / (2 * v * m)
        schedule = "1F1B" if v == 1 else "interleaved"
        print(f"{schedule:<12} {p:>2} {v:>2} {m:>3} {makespan * 1e3:>11.1f} {busy * 1e3:>12.1f} "
              f"{means[median]:>9.3f} {min(per_rank):>8.3f}..{max(per_rank):<8.3f} {theory(p, v, m):>7.3f} "
              f"{excess * 1e3:>14.2f}")


if __name__ == "__main__":
    main()
