"""Context parallelism on a long sequence: a tiny GPT (RoPE) at CP 1, 2, 4 over gloo, per comm type.

For each (CP size N, --cp-comm-type) N processes run one micro-batch of --seq tokens, each rank its
load-balanced s/N (get_batch_on_this_cp_rank), forward and backward, once untimed and then
--repeats times. Printed per configuration (the largest rank, and the ranks' spread):

    act MiB     bytes autograd saves for backward in the model's forward (saved_tensor_bytes),
                parameters left out: the activations the rank holds at the peak
    rss MiB     the process's peak resident memory (ru_maxrss: the model, gloo buffers, the
                interpreter and the allocator's reuse included)
    tok/s       the sequence's s tokens / the median step time (forward + backward, all ranks)
    sent MiB    what the rank's CP exchanges moved in one step, counted by communication.py
                (cp_ring: what a rank sends; all_to_all: what leaves the rank; all_gather and
                reduce_scatter: the whole gathered tensor, the library's convention)
    formula     the same from the shapes (megatron/core/context_parallel.py's cp_exchange_bytes, which
                the planner uses too; L layers, s, b, ng K/V groups, np heads, hn, 4 bytes):
                p2p        2 L (N-1) 2 (s/N) b ng hn x 4      K/V forward, their gradients back
                allgather  2 L 2 s b ng hn x 4                 gather forward, reduce-scatter back
                a2a        2 L (N-1)/N (s/N) b hn (2 np + 2 ng') x 4   q, k, v, context each way
                           (ng' = ng, or np when N does not divide ng: K/V repeated first)

    python bench/context_parallel.py [--seq 8192] [--layers 2] [--hidden 64] [--heads 4] [--groups 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import communication, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.context_parallel import cp_exchange_bytes  # noqa: E402
from megatron.model import GPTModel, TransformerConfig  # noqa: E402
from megatron.model.activation_memory import saved_tensor_bytes  # noqa: E402
from megatron.model.layer_specs import get_llama_layer_spec  # noqa: E402
from megatron.training.utils import get_batch_on_this_cp_rank  # noqa: E402

VOCAB, MBS = 256, 1
CP_OPS = ("cp_ring", "all_to_all", "all_gather", "reduce_scatter")


def _model(args, cp: int, comm: str) -> GPTModel:
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               num_query_groups=args.groups, ffn_hidden_size=2 * args.hidden,
                               normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
                               activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0,
                               context_parallel_size=cp, cp_comm_type=comm if cp > 1 else None)
    torch.manual_seed(1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=args.seq, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False, transformer_layer_spec=get_llama_layer_spec())


def _worker(rank: int, n: int, port: int, args, comm: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(minutes=10))
    parallel_state.initialize_model_parallel(context_parallel_size=n)
    model = _model(args, n, comm)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MBS, args.seq), generator=generator)
    batch = get_batch_on_this_cp_rank({"tokens": tokens, "labels": torch.roll(tokens, -1, 1),
                                       "position_ids": torch.arange(args.seq).unsqueeze(0)})

    def step():
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum()
        loss.backward()

    step()  # gloo connects its pairs on first use
    activations = saved_tensor_bytes(lambda: model(batch["tokens"], batch["position_ids"], None,
                                                   labels=batch["labels"]), exclude=list(model.parameters()))
    times = []
    for _ in range(args.repeats):
        communication.barrier()
        with communication.count_communication() as counter:
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    sent = sum(nbytes for (op, group), (_, nbytes) in counter.summary().items() if op in CP_OPS and group == "cp")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results.put((rank, activations, rss, statistics.median(times), sent))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(args, n: int, comm: str) -> list:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_worker, args=(r, n, port, args, comm, results)) for r in range(n)]
    for proc in procs:
        proc.start()
    rows = sorted(results.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--types", nargs="+", default=["p2p", "allgather", "a2a"])
    args = parser.parse_args(argv)
    hn = args.hidden // args.heads
    mib = 1024.0 ** 2
    print(f"seq {args.seq}, micro-batch {MBS}, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"{args.groups} K/V groups (hn {hn}), fp32, gloo, {os.cpu_count()} cores; median of {args.repeats} steps")
    print(f"{'CP':>3} {'type':>9} {'act MiB':>9} {'rss MiB':>8} {'tok/s':>8} {'sent MiB':>9} {'formula':>9}")
    for n in args.sizes:
        for comm in (args.types if n > 1 else ["-"]):
            rows = measure(args, n, comm)
            activations = max(r[1] for r in rows)
            rss = max(r[2] for r in rows)
            seconds = max(r[3] for r in rows)
            sent = max(r[4] for r in rows)
            expected = cp_exchange_bytes(comm, n, args.layers, args.seq, MBS, args.heads, args.groups, hn)
            print(f"{n:>3} {comm:>9} {activations / mib:>9.1f} {rss / mib:>8.0f} {args.seq / seconds:>8.0f} "
                  f"{sent / mib:>9.3f} {expected / mib:>9.3f}", flush=True)


if __name__ == "__main__":
    main()
