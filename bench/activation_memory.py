"""Activation memory of one transformer layer, measured, next to Korthikanti et al. 2022's formulas.

For each case the real TransformerLayer (bf16 by default, dropout on) runs one training forward
under saved-tensor hooks, and the bytes of the distinct storages autograd keeps for backward are
added up (megatron/model/activation_memory.py): parameters and the attention mask (one tensor
shared by all layers) left out. The tensor-parallel cases run on t spawned gloo processes, each
measuring its own rank; the table shows rank 0 (the ranks agree). Bytes are per layer and per rank.

    paper (sec. 4, Table 2)     no parallelism     sbh (34 + 5as/h)
                                TP                 sbh (10 + 24/t + 5as/(ht))
                                TP + SP            sbh (34/t + 5as/(ht))
                                TP + selective     sbh (10 + 24/t)
                                TP + SP + selective sbh (34/t)
                                full recompute     2sbh (2sbh/t with SP or distributed saved inputs)

docs/memory.md explains the remaining difference (the layer norms' saved statistics).
--torch-dropout measures with torch.nn.Dropout instead of the model's Dropout: on CPU it keeps
its noise in the activations' dtype (2 bytes in bf16) where the paper (and CUDA) keep 1 byte.
--use-flash-attn measures the fused core attention (torch SDPA on CPU), which the paper's
formulas do not describe; --dropout sets both dropout probabilities (default 0.1).
--llama-query-groups G measures the Llama-style layer instead (RMSNorm, SwiGLU with Megatron's
default width, G key/value groups, RoPE, no biases; unfused rope and SwiGLU) against the exact
llama_activation_bytes (docs/memory.md, "A Llama-style layer") in the formula columns.

    python bench/activation_memory.py [--seq-length 128] [--micro-batch-size 2] [--hidden-size 512]
                                      [--num-attention-heads 8] [--tensor-model-parallel-size 4]
                                      [--dtype bf16] [--torch-dropout] [--use-flash-attn] [--dropout 0.1]
                                      [--llama-query-groups 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import parallel_state  # noqa: E402
from megatron.model import layers  # noqa: E402
from megatron.model.activation_memory import (  # noqa: E402
    llama_activation_bytes,
    measure_layer_activation_bytes,
    paper_activation_bytes,
)

# name: (tensor parallel, sequence parallel, recompute, distributed saved inputs, the paper's formula)
CASES = [
    ("no parallelism", False, False, None, False, "sbh(34 + 5as/h)"),
    ("full recompute", False, False, "full", False, "2sbh"),
    ("TP", True, False, None, False, "sbh(10 + 24/t + 5as/(ht))"),
    ("TP + SP", True, True, None, False, "sbh(34/t + 5as/(ht))"),
    ("TP + selective", True, False, "selective", False, "sbh(10 + 24/t)"),
    ("TP + SP + selective", True, True, "selective", False, "sbh(34/t)"),
    ("TP + full", True, False, "full", False, "2sbh"),
    ("TP + SP + full", True, True, "full", False, "2sbh/t"),
    ("TP + full + distributed", True, False, "full", True, "2sbh/t"),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _use_torch_dropout() -> None:
    layers.Dropout.forward = torch.nn.Dropout.forward


def _measure(cases: list, shape: tuple, dtype: torch.dtype, options: dict) -> dict:
    return {name: measure_layer_activation_bytes(*shape, dtype=dtype, sequence_parallel=sp, recompute=recompute,
                                                 distribute_saved_activations=distribute, **options)
            for name, _, sp, recompute, distribute, _ in cases}


def _worker(rank: int, world_size: int, store_port: int, shape: tuple, dtype: torch.dtype, torch_dropout: bool,
            options: dict, results: Any) -> None:
    os.environ["MEGATRON_FORCE_CPU"] = "1"
    torch.set_num_threads(1)
    if torch_dropout:
        _use_torch_dropout()
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
        measured = _measure([case for case in CASES if case[1]], shape, dtype, options)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, measured)
        if rank == 0:
            results.put(gathered)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _measure_tensor_parallel(t: int, shape: tuple, dtype: torch.dtype, torch_dropout: bool, options: dict) -> dict:
    """Spawn t ranks of one TP group; rank 0's bytes per case (checking that all ranks agree)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    processes = [ctx.Process(target=_worker, args=(rank, t, store.port, shape, dtype, torch_dropout, options,
                                                           results))
                 for rank in range(t)]
    for process in processes:
        process.start()
    gathered = None
    while gathered is None and all(process.exitcode in (None, 0) for process in processes):
        try:
            gathered = results.get(timeout=1.0)
        except queue.Empty:
            continue
    for process in processes:
        process.join(30)
    if gathered is None:
        raise RuntimeError(f"the t = {t} ranks failed (see their tracebacks above)")
    if any(per_rank != gathered[0] for per_rank in gathered):
        raise RuntimeError(f"the tensor-parallel ranks saved different amounts: {gathered}")
    return gathered[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=4)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--torch-dropout", action="store_true",
                        help="measure with torch.nn.Dropout (on CPU: masks in the activations' dtype)")
    parser.add_argument("--use-flash-attn", action="store_true", help="the fused core attention (SDPA on CPU)")
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    parser.add_argument("--llama-query-groups", type=int, default=None,
                        help="measure the Llama-style layer with this many key/value groups")
    args = parser.parse_args()
    options = {"use_flash_attn": args.use_flash_attn, "dropout": args.dropout,
               "llama_query_groups": args.llama_query_groups}
    if args.torch_dropout:
        _use_torch_dropout()
    s, b, h, a, t = (args.seq_length, args.micro_batch_size, args.hidden_size, args.num_attention_heads,
                     args.tensor_model_parallel_size)
    shape, dtype = (s, b, h, a), DTYPES[args.dtype]
    if dtype == torch.bfloat16:
        from megatron.core.cpu_bf16 import slow_bf16_warning

        # the bytes are the same, only the time to get them grows: say why it is slow, then measure
        warning = slow_bf16_warning("each bf16 forward here", "--dtype fp32 measures fp32 activations quickly")
        if warning:
            print(warning, flush=True)

    measured = _measure([case for case in CASES if not case[1]], shape, dtype, options)
    if t > 1:
        measured.update(_measure_tensor_parallel(t, shape, dtype, args.torch_dropout, options))
    sbh = s * b * h
    variant = (", torch.nn.Dropout" if args.torch_dropout else "") + (", --use-flash-attn" if args.use_flash_attn else "")
    layer = "ffn 4h" if args.llama_query_groups is None else f"Llama-style, g={args.llama_query_groups}"
    print(f"one transformer layer, {args.dtype}, s={s} b={b} h={h} a={a} t={t} ({layer}, dropout {args.dropout:g}"
          f"{variant}); bytes per layer per tensor-parallel rank; sbh = {sbh}; 5as/h = {5 * a * s / h:g}")
    print(f"the attention mask [1, 1, s, s] (s^2 = {s * s} bytes) is shared by all layers and not counted")
    print()
    header = f"| {'case':<24} | t | {'paper formula':<26} | {'paper bytes':>12} | {'measured':>12} | " \
             f"{'measured/sbh':>12} | {'diff':>7} |"
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for name, tensor_parallel, sp, recompute, distribute, formula in CASES:
        if tensor_parallel and t == 1:
            continue
        ranks = t if tensor_parallel else 1
        if args.llama_query_groups is None:
            paper = paper_activation_bytes(s, b, h, a, ranks, sequence_parallel=sp, recompute=recompute,
                                           distribute_saved_activations=distribute)
        else:
            formula = "llama_activation_bytes"
            paper = llama_activation_bytes(s, b, h, a, args.llama_query_groups, ranks, sequence_parallel=sp,
                                           recompute=recompute, distribute_saved_activations=distribute)
        got = measured[name]
        print(f"| {name:<24} | {ranks} | {formula:<26} | {paper:>12,.0f} | {got:>12,} | {got / sbh:>12.4f} | "
              f"{(got - paper) / paper:>+6.2%} |")


if __name__ == "__main__":
    main()
