"""verify-parallel: run a model in a parallel layout and serially on the same data, print the differences.

    python tools/verify_parallel.py --layout tp2pp2dp2 [--iterations 3] [--tolerance 1e-5] \\
        -- --num-layers 4 --hidden-size 64 ... (pretrain_gpt.py's flags: the model, data, batch)

The layout is a string of parallel sizes: tpN (tensor), ppN (pipeline), dpN (data), cpN (context),
vppN (virtual stages per pipeline rank), epN (expert), etpN (expert tensor), and the switches sp
(--sequence-parallel) and distopt (--use-distributed-optimizer), e.g. "tp2sp-pp2-dp2", "ep2dp4",
"pp2vpp2dp2distopt", "cp2tp2sp" (the comm type: --cp-comm-type in the flags). The world is
tp x cp x pp x dp gloo processes on this machine (CPU); the serial run
is one process with the same global batch (the same micro-batches, one after another).

Both runs start from the same weights (pretrain_gpt's initialisation does not depend on the layout)
and read the same samples. After the first global batch's forward and backward every gradient
(DistributedDataParallel's main_grad after finalize_model_grads) is assembled into its full,
global tensor -- the pieces each rank holds are placed where torch_dist checkpoints put them
(megatron/dist_checkpointing/layout.py): TP / expert shards, pipeline stages, experts under their
global numbers -- and compared with the serial run's; then both train --iterations global batches
and their logged losses are compared. Printed: the largest relative difference of the losses, of
the weights before training (0 when the layouts agree), and of each gradient, the worst tensor
named; exit status 1 when a difference is above --tolerance, naming it.

Rows of the vocabulary padding (which differs with TP) are left out of the comparison. A custom
model is checked the same way: pass its --spec MODULE FUNCTION (a layer spec) in the flags.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import socket
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
          "vpp": "--num-virtual-stages-per-pipeline-rank", "ep": "--expert-model-parallel-size",
          "etp": "--expert-tensor-parallel-size", "cp": "--context-parallel-size"}


class LayoutError(ValueError):
    pass


def parse_layout(text: str) -> Dict[str, Any]:
    """'tp2sp-pp2-dp2' -> {'tp': 2, 'pp': 2, 'dp': 2, 'sp': True, ...}; sizes default to 1."""
    layout: Dict[str, Any] = {name: 1 for name in ("tp", "pp", "dp", "ep", "cp")}
    layout.update(vpp=None, etp=None, sp=False, distopt=False)
    rest = text.replace("-", "").replace("_", "").lower()
    if not rest:
        raise LayoutError("--layout is empty; give sizes such as tp2pp2dp2")
    pattern = re.compile(r"(vpp|etp|tp|pp|dp|ep|cp)(\d+)|(sp|distopt)")
    position = 0
    while position < len(rest):
        match = pattern.match(rest, position)
        if match is None:
            raise LayoutError(f"--layout {text!r}: cannot read {rest[position:]!r}; use tpN, ppN, dpN, cpN, vppN, "
                              "epN, etpN, sp, distopt")
        if match.group(3):
            layout[match.group(3)] = True
        else:
            size = int(match.group(2))
            if size < 1:
                raise LayoutError(f"--layout {text!r}: {match.group(1)} must be at least 1")
            layout[match.group(1)] = size
        position = match.end()
    if layout["sp"] and layout["tp"] == 1:
        raise LayoutError(f"--layout {text!r}: sp (sequence parallelism) needs tp > 1")
    return layout


def layout_flags(layout: Dict[str, Any]) -> List[str]:
    flags = []
    for name, flag in _FLAGS.items():
        value = layout.get(name)
        if value is not None and (name in ("vpp", "etp") or value > 1):
            flags += [flag, str(value)]
    if layout["sp"]:
        flags.append("--sequence-parallel")
    if layout["distopt"]:
        flags.append("--use-distributed-optimizer")
    return flags


def world_size(layout: Dict[str, Any]) -> int:
    return layout["tp"] * layout["cp"] * layout["pp"] * layout["dp"]


# ----------------------------------------------------------------------------- one run (each rank)

def _global_pieces(model: List[torch.nn.Module], grads: bool) -> List[Tuple[str, Tuple[int, ...], Tuple[int, ...],
                                                                         torch.Tensor]]:
    """(global name, global shape, offsets, piece) of every tensor this rank holds (its gradient with
    grads), placed as torch_dist places it."""
    from megatron.dist_checkpointing.layout import model_layouts

    pieces = []
    for layout, value in model_layouts(model):
        if not isinstance(value, torch.nn.Parameter):
            continue
        if grads:
            grad = getattr(value, "main_grad", None)
            grad = value.grad if grad is None else grad
            if grad is None:
                continue
            tensor = grad.detach().view(value.shape).float()
        else:
            tensor = value.detach().float()
        for offsets, piece in layout.boxes(tensor):
            pieces.append((layout.name, tuple(layout.global_shape), tuple(offsets), piece.clone()))
    return pieces


def run_one(argv: List[str], iterations: int) -> Dict[str, Any]:
    """On every rank of a run: weights, first-batch gradients and the losses of `iterations` steps."""
    import pretrain_gpt
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.training.global_vars import get_args, get_num_microbatches, get_tokenizer
    from megatron.training.initialize import initialize_megatron, reset_megatron
    from megatron.training.training import (
        _reduce_losses,
        build_train_valid_test_data_iterators,
        setup_model_and_optimizer,
        train_step_report,
    )

    try:
        initialize_megatron(args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, argv=argv + ["--train-iters",
                                                                                             str(iterations)])
        args = get_args()
        model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider, ModelType.encoder_or_decoder)
        train_iter, _, _ = build_train_valid_test_data_iterators(pretrain_gpt.train_valid_test_datasets_provider)
        weights = _global_pieces(model, grads=False)
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=pretrain_gpt.forward_step, data_iterator=train_iter, model=model,
            num_microbatches=get_num_microbatches(), seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            forward_only=False, grad_scale_func=optimizer.scale_loss,
            calculate_per_token_loss=args.calculate_per_token_loss, finalize_model_grads_func=finalize_model_grads)
        grads = _global_pieces(model, grads=True)
        history = {1: _reduce_losses(losses).get("lm loss")}
        optimizer.step()
        scheduler.step(increment=get_num_microbatches() * args.micro_batch_size * args.data_parallel_size)
        for iteration in range(2, iterations + 1):
            reduced, _, _, _ = train_step_report(pretrain_gpt.forward_step, train_iter, model, optimizer, scheduler)
            history[iteration] = reduced.get("lm loss")
        return {"weights": weights, "grads": grads, "losses": history, "true_vocab": get_tokenizer().vocab_size}
    finally:
        reset_megatron()


def _worker(rank: int, world: int, port: int, argv: List[str], iterations: int, results: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), MEGATRON_FORCE_CPU="1")
    torch.set_num_threads(1)
    try:
        buffer = io.BytesIO()  # bytes, not shared-memory tensors: this process may exit before they are read
        torch.save(run_one(argv, iterations), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException as error:  # reported by the parent, with the rank
        import traceback

        results.put((rank, False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        raise SystemExit(1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(argv: List[str], world: int, iterations: int) -> List[Dict[str, Any]]:
    """Every rank's result of the run with argv on `world` spawned gloo processes."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = _free_port()
    processes = [context.Process(target=_worker, args=(rank, world, port, argv, iterations, results))
                 for rank in range(world)]
    for process in processes:
        process.start()
    out: Dict[int, Any] = {}
    errors = []
    for _ in range(world):
        rank, ok, payload = results.get()
        if ok:
            out[rank] = torch.load(io.BytesIO(payload), weights_only=True)
        else:
            errors.append((rank, payload))
    for process in processes:
        process.join()
    if errors:
        rank, message = min(errors)
        raise RuntimeError(f"rank {rank} of the {world}-process run failed: {message}")
    return [out[rank] for rank in range(world)]


# ----------------------------------------------------------------------------- comparison

def assemble(results: List[Dict[str, Any]], key: str) -> Dict[str, torch.Tensor]:
    """The global tensors from every rank's pieces (a piece several ranks hold is written once each)."""
    tensors: Dict[str, torch.Tensor] = {}
    for result in results:
        for name, shape, offsets, piece in result[key]:
            if name not in tensors:
                tensors[name] = torch.full(shape, float("nan"))
            index = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))
            tensors[name][index] = piece
    return tensors


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12)) if b.numel() else 0.0


def compare(parallel: Dict[str, torch.Tensor], serial: Dict[str, torch.Tensor],
            true_vocab: Optional[int]) -> Tuple[Dict[str, float], List[str]]:
    """Relative difference per tensor over the rows both hold (the vocabulary padding left out);
    the names only one side has."""
    differences, problems = {}, []
    for name in sorted(set(parallel) | set(serial)):
        if name not in parallel or name not in serial:
            problems.append(f"{name} is only in the {'parallel' if name in parallel else 'serial'} run")
            continue
        a, b = parallel[name], serial[name]
        if a.shape != b.shape:
            if a.shape[1:] != b.shape[1:]:
                problems.append(f"{name} has shape {tuple(a.shape)} in the parallel run, {tuple(b.shape)} serially")
                continue
            rows = min(a.shape[0], b.shape[0], true_vocab or a.shape[0])
            a, b = a[:rows], b[:rows]
        if torch.isnan(a).any():
            problems.append(f"{name}: the parallel ranks did not hold all of it")
            continue
        differences[name] = _relative(a, b)
    return differences, problems


def verify(layout_text: str, flags: List[str], iterations: int = 3, tolerance: float = 1e-5,
           out=sys.stdout) -> int:
    layout = parse_layout(layout_text)
    world = world_size(layout)
    with tempfile.TemporaryDirectory(prefix="verify-parallel-") as cache:
        common = [*flags, "--data-cache-path", cache] if "--data-cache-path" not in flags else list(flags)
        print(f"verify-parallel: {layout_text} on {world} gloo processes against 1, {iterations} iterations",
              file=out, flush=True)
        serial = run(common, 1, iterations)
        parallel = run([*common, *layout_flags(layout)], world, iterations)
    true_vocab = serial[0]["true_vocab"]
    weight_diffs, weight_problems = compare(assemble(parallel, "weights"), assemble(serial, "weights"), true_vocab)
    grad_diffs, grad_problems = compare(assemble(parallel, "grads"), assemble(serial, "grads"), true_vocab)
    serial_losses, parallel_losses = serial[0]["losses"], parallel[-1]["losses"]
    loss_diffs = {i: abs(parallel_losses[i] - serial_losses[i]) / abs(serial_losses[i]) for i in serial_losses}
    worst_grad = max(grad_diffs, key=grad_diffs.get) if grad_diffs else None
    worst_weight = max(weight_diffs, key=weight_diffs.get) if weight_diffs else None
    worst_loss = max(loss_diffs, key=loss_diffs.get)
    print(f"  losses (serial / parallel): " + ", ".join(
        f"{i}: {serial_losses[i]:.6f} / {parallel_losses[i]:.6f}" for i in sorted(serial_losses)), file=out)
    print(f"  largest loss difference: {loss_diffs[worst_loss]:.3e} (iteration {worst_loss})", file=out)
    if worst_weight is not None:
        print(f"  largest initial weight difference: {weight_diffs[worst_weight]:.3e} ({worst_weight})", file=out)
    if worst_grad is not None:
        print(f"  largest gradient difference: {grad_diffs[worst_grad]:.3e} ({worst_grad}); "
              f"{len(grad_diffs)} tensors compared", file=out)
    failures = [f"{p}" for p in weight_problems + grad_problems]
    if loss_diffs[worst_loss] > tolerance:
        failures.append(f"the loss of iteration {worst_loss} differs by {loss_diffs[worst_loss]:.3e}")
    if worst_weight is not None and weight_diffs[worst_weight] > tolerance:
        failures.append(f"the initial weights of {worst_weight} differ by {weight_diffs[worst_weight]:.3e}")
    bad = sorted((d, n) for n, d in grad_diffs.items() if d > tolerance)
    if bad:
        failures.append(f"{len(bad)} gradient(s) differ by more than {tolerance:g}, the worst "
                        f"{bad[-1][1]} by {bad[-1][0]:.3e}")
    if failures:
        print("FAILED: " + "; ".join(failures), file=out, flush=True)
        return 1
    print(f"OK: every difference is under {tolerance:g}", file=out, flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags: List[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, flags = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", required=True, help="e.g. tp2pp2dp2, tp2sp-dp2, ep2dp4, pp2vpp2dp2distopt")
    parser.add_argument("--iterations", type=int, default=3, help="global batches to train (default 3)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest relative difference allowed")
    args, unknown = parser.parse_known_args(argv)
    flags = unknown + flags
    try:
        parse_layout(args.layout)
    except LayoutError as error:
        parser.error(str(error))
    if args.iterations < 1:
        parser.error("--iterations must be at least 1")
    return verify(args.layout, flags, args.iterations, args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
