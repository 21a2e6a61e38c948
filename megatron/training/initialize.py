"""initialize_megatron(): arguments, globals, torch.distributed, parallel state and seeds.

    parse_args -> (--use-checkpoint-args: shape args from the checkpoint) -> validate_args
    -> global variables (tokenizer, timers, writers, micro-batch calculator)
    -> torch.distributed (under torchrun: env RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)
    -> parallel state -> the node topology check (rank 0 prints how the groups fall on nodes)
    -> on CPU: threads and allocator; with --bf16, a warning when this CPU has no fast bf16 path
    -> random seeds -> deterministic mode
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import logging
import os
import random
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.training import global_vars
from megatron.core import cpu_bf16, cpu_runtime, device, node_topology, parallel_state, watchdog
from megatron.core.pipeline_parallel import p2p_communication
from megatron.core.utils import get_rank_safe
from megatron.training.utils import print_line, print_rank_0


def initialize_megatron(extra_args_provider: Optional[Callable] = None, args_defaults: Optional[Dict] = None,
                        argv: Optional[List[str]] = None, ignore_unknown_args: bool = False) -> argparse.Namespace:
    """Set up a training process; argv None reads sys.argv. Returns the validated args."""
    from megatron.training.arguments import parse_args, validate_args

    reset_megatron()
    args = parse_args(extra_args_provider, ignore_unknown_args, argv=argv)
    if args.use_checkpoint_args or (args_defaults or {}).get("use_checkpoint_args", False):
        from megatron.training.checkpointing import load_args_from_checkpoint

        load_args_from_checkpoint(args)
    if args.load_hf is not None:
        from megatron.training.load_hf import apply_hf_args

        apply_hf_args(args, argv, extra_args_provider)
    validate_args(args, args_defaults or {})
    if args.logging_level is not None:
        logging.getLogger().setLevel(args.logging_level)
    device.set_backend_override(args.distributed_backend)
    global_vars.set_global_variables(args)
    _initialize_distributed(args)
    if device.get_device().type == "cpu":
        print_rank_0("> " + cpu_runtime.configure(args.cpu_threads, args.cpu_malloc_tuning).describe())
        if args.bf16:
            _warn_if_slow_bf16()
    _set_random_seed(args.seed)
    if args.deterministic_mode:
        _set_deterministic_mode()
    return args


def _warn_if_slow_bf16() -> None:
    """--bf16 on a CPU without native bf16 instructions runs ~100x slower than fp32: say so, once
    (only rank 0 probes: the ranks of a job share one kind of processor)."""
    if get_rank_safe() == 0:
        warning = cpu_bf16.slow_bf16_warning("this --bf16 run",
                                             "fp32 (without --bf16) is the fast path on this machine")
        if warning:
            print_line(warning)


def reset_megatron() -> None:
    """Forget the globals and parallel state of a previous run in this process."""
    global_vars.unset_global_variables()
    parallel_state.destroy_model_parallel()


def _initialize_distributed(args: argparse.Namespace) -> None:
    """Join the torchrun process group (when launched by torchrun) and record the parallel layout."""
    device.set_device()
    launched = "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    if launched and not dist.is_initialized():
        if args.rank == 0:  # the process group does not exist yet: print_rank_0 cannot tell the ranks apart
            print_line("> initializing torch distributed ...")
        dist.init_process_group(backend=device.get_backend(), world_size=args.world_size, rank=args.rank,
                                timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
        # Tear the groups down before the interpreter does: a gloo group still alive at exit
        # aborts the process ("terminate called without an active exception").
        atexit.register(_destroy_distributed)
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size, expert_model_parallel_size=args.expert_model_parallel_size,
        pipeline_model_parallel_split_rank=getattr(args, "pipeline_model_parallel_split_rank", None),
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None))
    _report_node_topology(args)
    # A stage waiting on its neighbour longer than this fails with an error naming both (no silent hang).
    p2p_communication.set_p2p_timeout(args.distributed_timeout_minutes * 60.0)
    # A rank stuck in a collective or exchange prints what it waits on and exits (megatron/core/watchdog.py).
    watchdog.start(args.watchdog_seconds or args.distributed_timeout_minutes * 60.0,
                   lambda: getattr(args, "iteration", 0))
    if args.log_communication_stats:
        from megatron.core import communication

        communication.set_counting(True)


def _report_node_topology(args: argparse.Namespace) -> None:
    """Rank 0 prints which nodes the TP / CP / EP / DP / PP groups span; warns for a TP group across nodes."""
    world = dist.get_world_size() if dist.is_initialized() else 1  # not args.world_size: a test pool sets no env
    if world == 1:
        return
    tp, pp, cp, ep = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                      args.context_parallel_size, args.expert_model_parallel_size)
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    # the same rank arithmetic initialize_model_parallel just used (one source of the layout)
    plan = parallel_state._plan_rank_groups(world, tp, pp, cp, ep, etp, "tp-cp-ep-dp-pp",
                                            getattr(args, "pipeline_model_parallel_split_rank", None))
    sizes = {"tp": tp, "cp": cp, "ep": ep, "etp": etp if ep > 1 or etp != tp else 1, "pp": pp,
             "dp": world // (tp * pp * cp)}
    node_topology.report(plan, [kind for kind, size in sizes.items() if size > 1], device.get_device(),
                         print_fn=print_line)


def _destroy_distributed() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _set_random_seed(seed: int) -> None:
    """Seed python, numpy, torch and the accelerator; pipeline stages get distinct seeds.

    Every tensor-parallel rank of a stage gets the same seed (weights are drawn whole and then
    split, and replicated dropout masks must agree); the "model-parallel-rng" stream used for
    dropout on split tensors is seeded per TP rank by model_parallel_cuda_manual_seed.
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if seed is None or seed <= 0:
        raise ValueError(f"--seed must be a positive integer, got {seed}")
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _set_deterministic_mode() -> None:
    """Bit-reproducible runs: deterministic kernels only (and cuBLAS workspace pinned on GPU)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
