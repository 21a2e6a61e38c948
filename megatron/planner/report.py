"""The plan as text (tools/plan.py, pretrain_gpt.py --dry-run), and the plan of validated args."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from typing import Callable, Optional

from megatron.planner.model import PlanError, layout_from_args, shape_from_args
from megatron.planner.plan import GIB, Device, Plan, device_from_args, make_plan, search


def _size(n: float) -> str:
    """Bytes with their binary unit named: 6.23 GiB, 421.40 MiB, 12.0 KiB."""
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _seconds(t: float) -> str:
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.3f} ms"


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The plan of validated pretrain_gpt.py args with the device flags; FLOPs per step are the log
    line's (training_log.num_floating_point_operations) for the global batch."""
    from megatron.training.training_log import num_floating_point_operations

    from megatron.training.tokenizer import build_tokenizer

    with contextlib.redirect_stdout(io.StringIO()):
        vocab_size = build_tokenizer(args).vocab_size  # sets args.padded_vocab_size if unset, as pretrain() does
    plan = make_plan(shape_from_args(args, vocab_size), layout_from_args(args), device_from_args(args),
                     overlap_grad_reduce=bool(args.overlap_grad_reduce))
    expected = num_floating_point_operations(args, args.global_batch_size)
    assert plan.flops_per_step == expected, (plan.flops_per_step, expected)
    return plan


def describe_device(dev: Device, world_size: int) -> str:
    return (f"{world_size} x {dev.memory_gb:g} GB devices, {dev.devices_per_node} per node, "
            f"{dev.peak_tflops:g} TFLOP/s peak x {dev.compute_efficiency:g} efficiency, links "
            f"{dev.intra_node_gbps:g} / {dev.inter_node_gbps:g} Gbit/s inside / across nodes, "
            f"{dev.memory_reserve:.0%} kept free")


def format_plan(plan: Plan) -> list:
    """Lines: the layout, then one row per pipeline stage (all its TP and DP ranks hold the same),
    then the step's time, MFU and whether it fits."""
    lay, dev = plan.layout, plan.device
    lines = [f"plan: {lay.name()} on {describe_device(dev, lay.world_size)}",
             f"  {lay.num_microbatches} micro-batches per step; pipeline bubble (p-1)/(v m) = {plan.bubble:.2%}; "
             f"model FLOPs per step {plan.flops_per_step:.4E} (the log line's)"]
    if lay.cp > 1:
        lines.append(f"  context parallel: {lay.cp} ranks ({lay.cp_comm_type}) of {plan.shape.seq_length // lay.cp} "
                     f"tokens each; gradients reduced and the optimizer sharded over DP x CP = {lay.dp * lay.cp}")
    cp = " / CP" if lay.cp > 1 else ""
    lines.append(f"  stage | params/rank | weights | grads | main p+g | optimizer | activations (in flight) | "
                 f"recompute work | peak (with transients) | TP{cp} / PP / DP / EP sent per step | compute")
    for r in plan.ranks:
        mem = r.memory
        lines.append(
            f"  {r.stage:5d} | {r.parameters / 1e6:9.1f} M | {_size(mem['model_params'])} | {_size(mem['grads'])} | "
            f"{_size(mem['main_params'] + mem['main_grads'])} | {_size(mem['optimizer_state'])} | "
            f"{_size(mem['activations'])} ({'+'.join(map(str, r.in_flight))}) | {_size(mem['recompute_working'])} | "
            f"{_size(r.peak_bytes)} | {_size(r.comm['tp'])} / " + (f"{_size(r.comm['cp'])} / " if lay.cp > 1 else "") +
            f"{_size(r.comm['pp'])} / "
            f"{_size(r.comm['dp'] + r.comm['edp'])} / {_size(r.comm['ep'])} | "
            f"{_seconds(r.compute_s)}")
    fits = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"  predicted step time {_seconds(plan.step_s)}, MFU {plan.mfu:.1%} "
                 f"({plan.flops_per_step / plan.step_s / lay.world_size / 1e12:.1f} TFLOP/s/GPU); peak "
                 f"{_size(plan.peak_bytes)} of {_size(dev.usable_bytes)} usable: {fits}")
    return lines


def format_search(plans: list, tried: int, fitting: int, world_size: int, dev: Device) -> list:
    lines = [f"search: {tried} layouts of {world_size} devices tried, {fitting} fit "
             f"({describe_device(dev, world_size)})",
             "  rank | layout | peak memory | bubble | step time | MFU"]
    for i, p in enumerate(plans, 1):
        lines.append(f"  {i:4d} | {p.layout.name()} | {_size(p.peak_bytes)} | {p.bubble:.1%} | {_seconds(p.step_s)} | "
                     f"{p.mfu:.1%}")
    return lines


def search_from_args(args: argparse.Namespace, top: int = 10, micro_batch_sizes: Optional[list] = None,
                     context_parallel_sizes: Optional[list] = None) -> list:
    """format_search of the layouts of args.world_size devices, the model and batch of args
    (context_parallel_sizes: the CP sizes tried, each with every comm type; default CP 1 only)."""
    plan = plan_from_args(args)
    plans, tried, fitting = search(plan.shape, plan.layout, plan.device, args.world_size, top,
                                   overlap_grad_reduce=bool(args.overlap_grad_reduce),
                                   micro_batch_sizes=micro_batch_sizes, context_parallel_sizes=context_parallel_sizes)
    return format_search(plans, tried, fitting, args.world_size, plan.device)


def dry_run(extra_args_provider: Optional[Callable], args_defaults: Optional[dict], argv: Optional[list]) -> None:
    """pretrain(..., --dry-run): parse and validate as initialize_megatron does (no process group,
    no model, no data), print the plan on rank 0 and exit 0. Returns when --dry-run is not given."""
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(extra_args_provider, argv=argv)
    if not args.dry_run:
        return
    if args.use_checkpoint_args or (args_defaults or {}).get("use_checkpoint_args", False):
        from megatron.training.checkpointing import load_args_from_checkpoint

        load_args_from_checkpoint(args)
    if args.load_hf is not None:
        from megatron.training.load_hf import apply_hf_args

        apply_hf_args(args, argv, extra_args_provider)
    with contextlib.redirect_stdout(io.StringIO()):
        validate_args(args, args_defaults or {})
    try:
        lines = format_plan(plan_from_args(args))
    except PlanError as error:
        print(f"--dry-run: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    if args.rank == 0:
        print("\n".join(lines), flush=True)
    sys.exit(0)
