"""initialize_megatron(): arguments, globals, torch.distributed, parallel state and seeds.

    parse_args -> (--use-checkpoint-args: shape args from the checkpoint) -> validate_args
    -> global variables (tokenizer, timers, writers, micro-batch calculator)
    -> torch.distributed (under torchrun: env RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)
    -> parallel state -> the node topology check (rank 0 prints how the groups fall on nodes)
    -> on CPU: threads and allocator; with --bf16, a warning when this CPU has no fast bf16 path
    -> random seeds -> deterministic mode

Megatron-LM's other start-up steps, which Accelerate's Megatron-LM integration calls one by one:
_initialize_distributed, _set_random_seed, _init_autoresume, _compile_dependencies,
set_jit_fusion_options and write_args_to_tensorboard (each says what it does here).
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
    _initialize_distributed()
    if device.get_device().type == "cpu":
        print_rank_0("> " + cpu_runtime.configure(args.cpu_threads, args.cpu_malloc_tuning).describe())
        if args.bf16:
            _warn_if_slow_bf16()
    _set_random_seed(args.seed, args.data_parallel_random_init)
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


def _initialize_distributed(get_embedding_ranks: Optional[Callable] = None,
                            get_position_embedding_ranks: Optional[Callable] = None,
                            store: Optional[dist.Store] = None) -> None:
    """Megatron's: join torch.distributed, then create the parallel groups of get_args()'s sizes.

    The process group is created under torchrun (env WORLD_SIZE / MASTER_ADDR), or from `store`
    when one is given; one that exists already (Accelerate creates it) is used as it is, and
    args.rank / args.world_size are taken from it. Parallel groups that exist already are kept.
    Megatron's get_embedding_ranks / get_position_embedding_ranks (custom embedding-group ranks)
    are refused: the embedding groups here are always the first and last pipeline stages (and an
    encoder-decoder split's first decoder stage).
    """
    if get_embedding_ranks is not None or get_position_embedding_ranks is not None:
        raise ValueError("_initialize_distributed: custom get_embedding_ranks / get_position_embedding_ranks are "
                         "not supported; the embedding groups are the first and last pipeline stages")
    args = global_vars.get_args()
    device.set_device()
    if dist.is_initialized():
        if args.rank == 0:
            print_line("torch distributed is already initialized, skipping initialization ...")
        args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    elif store is not None or ("WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ):
        if args.rank == 0:  # the process group does not exist yet: print_rank_0 cannot tell the ranks apart
            print_line("> initializing torch distributed ...")
        dist.init_process_group(backend=device.get_backend(), store=store, world_size=args.world_size,
                                rank=args.rank, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
        # Tear the groups down before the interpreter does: a gloo group still alive at exit
        # aborts the process ("terminate called without an active exception").
        atexit.register(_destroy_distributed)
    if parallel_state.model_parallel_is_initialized():
        print_rank_0("model parallel is already initialized")
    else:
        parallel_state.initialize_model_parallel(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            pipeline_model_parallel_split_rank=args.pipeline_model_parallel_split_rank,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes)
        _report_node_topology(args)
    # A stage waiting on its neighbour longer than this fails with an error naming both (no silent hang).
    p2p_communication.set_p2p_timeout(args.distributed_timeout_minutes * 60.0)
    # A rank stuck in a collective or exchange prints what it waits on and exits (megatron/core/watchdog.py).
    watchdog.start(args.watchdog_seconds or args.distributed_timeout_minutes * 60.0,
                   lambda: args.iteration)
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
    etp = args.expert_tensor_parallel_size or tp
    # the same rank arithmetic initialize_model_parallel just used (one source of the layout)
    plan = parallel_state._plan_rank_groups(world, tp, pp, cp, ep, etp, "tp-cp-ep-dp-pp",
                                            args.pipeline_model_parallel_split_rank)
    sizes = {"tp": tp, "cp": cp, "ep": ep, "etp": etp if ep > 1 or etp != tp else 1, "pp": pp,
             "dp": world // (tp * pp * cp)}
    node_topology.report(plan, [kind for kind, size in sizes.items() if size > 1], device.get_device(),
                         print_fn=print_line)


def _destroy_distributed() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _set_random_seed(seed_: int, data_parallel_random_init: bool = False, te_rng_tracker: bool = False,
                     inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False) -> None:
    """Megatron's: seed python, numpy, torch and the accelerator; pipeline stages get distinct seeds
    (+100 per stage), and with data_parallel_random_init data-parallel ranks too (+10 per rank).

    Every tensor-parallel rank of a stage gets the same seed (weights are drawn whole and then
    split, and replicated dropout masks must agree); the "model-parallel-rng" stream used for
    dropout on split tensors is seeded per TP rank by model_parallel_cuda_manual_seed (also on CPU,
    where it swaps the CPU generator). Megatron's other trackers (Transformer Engine's, the
    inference one, CUDA-graph-safe generators) do not exist here: asking for one raises.
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if seed_ is None or seed_ <= 0:
        raise ValueError(f"--seed must be a positive integer, got {seed_}")
    unsupported = [name for name, wanted in (("te_rng_tracker", te_rng_tracker),
                                             ("inference_rng_tracker", inference_rng_tracker),
                                             ("use_cudagraphable_rng", use_cudagraphable_rng)) if wanted]
    if unsupported:
        raise ValueError(f"_set_random_seed: {', '.join(unsupported)} is not supported (no Transformer Engine, "
                         "inference or CUDA-graph RNG tracker here)")
    seed = seed_ + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed += 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _init_autoresume() -> None:
    """Megatron's ADLR autoresume set-up: with --adlr-autoresume it starts NVIDIA's cluster client
    (userlib.auto_resume) between two barriers; without the flag it does nothing. This framework has
    neither the flag nor the client (a run resumes from --load after --exit-signal-handler or
    --exit-duration-in-mins), so there is no client to start, and args asking for one are refused."""
    if getattr(global_vars.get_args(), "adlr_autoresume", False):
        raise ValueError("adlr_autoresume: NVIDIA's ADLR autoresume client is not supported; resume from --load "
                         "(with --exit-signal-handler or --exit-duration-in-mins to stop cleanly)")


def _compile_dependencies() -> None:
    """Megatron's start-up build, as it applies here: Megatron compiles its dataset index helpers
    (C++) and builds its fused CUDA kernels on rank 0 first. Nothing is built ahead here: the index
    helpers are numpy (megatron/data/index_helpers.py), and the fused ops are ATen's kernels or
    compile on their first call (Triton on CUDA, torch.compile for the CPU "compiled" implementation;
    set_jit_fusion_options warms those up). Rank 0 prints which implementation each fused op runs on
    this device."""
    from megatron import fused_kernels

    where = device.get_device()
    impl = global_vars.get_args().fused_kernels_cpu_impl if where.type == "cpu" else None  # the model's impl=
    chosen = ", ".join(f"{op} {fused_kernels.select_implementation(op, where, impl)}" for op in fused_kernels.OPS)
    print_rank_0(f"> fused kernels on {where.type}: {chosen} (no build step: compiled on first use where they "
                 "compile)")


def set_jit_fusion_options() -> None:
    """Megatron's: with PyTorch >= 2.2 it sets no TorchScript fuser flag (that PyTorch is required here
    too), then warms up the fused ops with the run's shapes so that their compilation does not land in
    the first training step (_warmup_jit_function)."""
    _warmup_jit_function()


def _warmup_jit_function() -> None:
    """Run the fused bias-GeLU (or bias-SwiGLU) and bias-dropout-add the model will call, forward and
    backward, on this device with the run's shapes and dtype, with the input gradients on and off
    (Megatron's two cases: forward, and forward under activation recompute). Triton kernels and the
    torch.compile'd implementations compile here; ATen's kernels just run once. The random draws are
    undone (the generators' states are restored), so the run's random streams do not depend on it."""
    from megatron import fused_kernels

    target = device.get_device()
    with torch.random.fork_rng(devices=[target] if target.type == "cuda" else []):
        _run_fused_ops_once(fused_kernels, global_vars.get_args(), target)
    device.empty_cache()


def _run_fused_ops_once(fused_kernels, args: argparse.Namespace, target: torch.device) -> None:
    """_warmup_jit_function's body: the fused ops the MLP and the layer call (megatron/model/mlp.py's
    choice), with the implementation the model passes them (--fused-kernels-cpu-impl on CPU)."""
    from megatron.fused_kernels import backend

    dtype = args.params_dtype
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    seq = args.seq_length // cp
    if args.swiglu:
        activation = fused_kernels.bias_swiglu if args.bias_swiglu_fusion else None
    else:
        activation = fused_kernels.bias_gelu if args.bias_gelu_fusion and not args.squared_relu else None
    width = args.ffn_hidden_size // tp * (2 if args.swiglu else 1)  # fc1's output: [gate; up] with SwiGLU
    rows = seq // tp if args.sequence_parallel else seq  # the layer's [s/cp (/tp under SP), b, h]
    for input_grad in (False, True):
        if activation is not None:
            x = torch.rand((seq, args.micro_batch_size, width), dtype=dtype, device=target, requires_grad=input_grad)
            bias = torch.rand(width, dtype=dtype, device=target, requires_grad=True) if args.add_bias_linear else None
            _forward_backward(activation(x, bias, impl=backend.implementation(args.fused_kernels_cpu_impl, x)))
        if args.bias_dropout_fusion:
            x = torch.rand((rows, args.micro_batch_size, args.hidden_size), dtype=dtype, device=target,
                           requires_grad=input_grad)
            residual = torch.rand_like(x, requires_grad=True)
            bias = torch.rand(args.hidden_size, dtype=dtype, device=target, requires_grad=True)
            impl = backend.implementation(args.fused_kernels_cpu_impl, x)
            _forward_backward(fused_kernels.bias_dropout_add(x, bias, residual, args.hidden_dropout, True, impl=impl))


def _forward_backward(output: torch.Tensor) -> None:
    if output.requires_grad:
        output.float().sum().backward()


def write_args_to_tensorboard() -> None:
    """Megatron's: every argument as a text entry of the TensorBoard log (when there is a writer:
    --tensorboard-dir, on the last rank), at step args.iteration."""
    args = global_vars.get_args()
    writer = global_vars.get_tensorboard_writer()
    if writer:
        for name in vars(args):
            writer.add_text(name, str(getattr(args, name)), global_step=args.iteration)


def _set_deterministic_mode() -> None:
    """Bit-reproducible runs: deterministic kernels only (and cuBLAS workspace pinned on GPU)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
