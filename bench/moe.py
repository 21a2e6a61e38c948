"""MoE GPT against the dense GPT with the same active parameters, and the dispatcher's share of a step.

Both models: L layers, hidden h, SwiGLU, RMSNorm, RoPE, no biases. The MoE model has E experts of
ffn F in every layer with top-k routing (aux loss on); the dense model's ffn is k F, so a token
runs the same number of MLP multiply-adds in both (the MoE model holds E / k times the MLP
parameters). Measured: training steps (forward, backward, Adam) per second on one process, as
tokens/s, for the dense model and for the MoE model with each dispatcher, plain and with
--moe-grouped-gemm.

The dispatcher's share: for one MoE layer on the layer's real input, forward + backward of
    the layer           (router + dispatch + experts + combine)
    the router alone    (logits, top-k, balancing losses)
    the experts alone   (on the same tokens, already grouped by expert)
and dispatch + combine = layer - router - experts, reported as a fraction of the layer and of the
whole training step (times the number of MoE layers). With --ep N the MoE model also runs on N
spawned gloo processes at EP = N (alltoall and allgather), each rank on its own micro-batch: the
dispatcher then includes the all-to-all / all-gather traffic (tokens/s is the sum over ranks).

    python bench/moe.py [--layers 4] [--hidden 256] [--experts 8] [--topk 2] [--ffn 512] [--seq 256]
                        [--micro-batch 4] [--steps 6] [--ep 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.aux_losses import clear  # noqa: E402
from megatron.model import GPTModel, TransformerConfig  # noqa: E402

VOCAB = 1024


def _config(args, moe: bool, dispatcher: str = "alltoall", grouped: bool = False, ep: int = 1) -> TransformerConfig:
    extra = dict(num_moe_experts=args.experts, moe_ffn_hidden_size=args.ffn, moe_router_topk=args.topk,
                 moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped,
                 expert_model_parallel_size=ep) if moe else {}
    return TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                             ffn_hidden_size=args.topk * args.ffn, add_bias_linear=False, gated_linear_unit=True,
                             activation_func=F.silu, normalization="RMSNorm", hidden_dropout=0.0,
                             attention_dropout=0.0, **extra)


def _model(config: TransformerConfig) -> GPTModel:
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=args_global.seq, position_embedding_type="rope")


def _batch(args, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (args.micro_batch, args.seq), generator=generator)
    return tokens, torch.roll(tokens, -1, dims=1)


def _steps_per_second(model: GPTModel, args, seed: int = 0) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens, labels = _batch(args, seed)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(tokens, None, labels=labels).mean().backward()
        optimizer.step()
        clear()

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    return args.steps / (time.perf_counter() - start)


def _time(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _dispatcher_share(model: GPTModel, args) -> tuple[float, float, float]:
    """(layer s, router s, experts s) of forward + backward of the first MoE layer on its real input."""
    captured = {}
    layer = model.decoder.layers[0]
    handle = layer.mlp.register_forward_pre_hook(lambda module, inputs: captured.setdefault("x", inputs[0].detach()))
    tokens, labels = _batch(args)
    with torch.no_grad():
        model(tokens, None, labels=labels)
    handle.remove()
    x = captured["x"].requires_grad_(True)
    moe = layer.mlp
    with torch.no_grad():
        probs, routing_map = moe.router(x)
    experts_index, token_index = routing_map.t().nonzero(as_tuple=True)
    grouped = x.detach().reshape(-1, x.shape[-1])[token_index].requires_grad_(True)
    counts = routing_map.sum(0).tolist()[:moe.num_local_experts]
    if moe.num_local_experts != len(routing_map.sum(0)):  # EP > 1: this rank's experts get about their share
        total = grouped.shape[0] * moe.num_local_experts // routing_map.shape[1]
        counts = [total // moe.num_local_experts] * moe.num_local_experts
        grouped = grouped[:sum(counts)]

    def whole():
        out, _ = moe(x)
        out.sum().backward()
        clear()

    def router():
        p, _ = moe.router(x)
        p.sum().backward()
        clear()

    def experts():
        moe.experts(grouped, counts).sum().backward()

    return _time(whole, args.repeats), _time(router, args.repeats), _time(experts, args.repeats)


def _moe_row(name: str, model: GPTModel, args, tokens_per_step: int, ranks: int = 1) -> list:
    steps = _steps_per_second(model, args)
    layer, router, experts = _dispatcher_share(model, args)
    dispatch = max(layer - router - experts, 0.0)
    step_seconds = 1.0 / steps
    return [name, tokens_per_step * steps * ranks, router / layer, experts / layer, dispatch / layer,
            dispatch * args.layers / step_seconds]


def _print(rows: list, dense_tps: float) -> None:
    print(f"{'model':<34} {'tokens/s':>10} {'vs dense':>9} {'router':>7} {'experts':>8} {'dispatch':>9} "
          f"{'dispatch/step':>14}")
    for name, tps, router, experts, dispatch, of_step in rows:
        if router is None:
            print(f"{name:<34} {tps:>10.0f} {1.0:>9.2f}")
        else:
            print(f"{name:<34} {tps:>10.0f} {tps / dense_tps:>9.2f} {router:>7.1%} {experts:>8.1%} {dispatch:>9.1%} "
                  f"{of_step:>14.1%}")


def _ep_worker(rank: int, world: int, port: int, args, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    global args_global
    args_global = args
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    rows = []
    for dispatcher in ("alltoall", "allgather"):
        model = _model(_config(args, True, dispatcher, ep=world))
        steps = _steps_per_second(model, args, seed=rank)
        layer, router, experts = _dispatcher_share(model, args)
        rows.append((dispatcher, steps, layer, router, experts))
    parallel_state.destroy_model_parallel()
    dist.barrier()
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    global args_global
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ep", type=int, default=0, help="also run EP = N on N gloo processes")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    args_global = args
    torch.set_num_threads(args.threads)
    tokens = args.micro_batch * args.seq
    print(f"# {args.layers} layers, h {args.hidden}, {args.experts} experts x ffn {args.ffn}, top-{args.topk}; "
          f"dense ffn {args.topk * args.ffn}; {tokens} tokens per step; torch {torch.__version__}, "
          f"{args.threads} threads")
    dense = _model(_config(args, False))
    dense_tps = tokens * _steps_per_second(dense, args)
    rows = [["dense (same active parameters)", dense_tps, None, None, None, None]]
    for dispatcher in ("alltoall", "allgather"):
        for grouped in (False, True):
            name = f"MoE {dispatcher}{' grouped-gemm' if grouped else ''}"
            rows.append(_moe_row(name, _model(_config(args, True, dispatcher, grouped)), args, tokens))
    params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    print(f"# parameters: dense {params(dense):,}, MoE {params(_model(_config(args, True))):,}")
    _print(rows, dense_tps)
    if args.ep > 1:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        context = mp.get_context("spawn")
        queue = context.Queue()
        mp.spawn(_ep_worker, args=(args.ep, port, args, queue), nprocs=args.ep)
        ep_rows = []
        for dispatcher, steps, layer, router, experts in queue.get():
            dispatch = max(layer - router - experts, 0.0)
            ep_rows.append([f"MoE EP={args.ep} {dispatcher} (sum of ranks)", tokens * steps * args.ep, router / layer,
                            experts / layer, dispatch / layer, dispatch * args.layers * steps])
        print(f"# EP = {args.ep} on {args.ep} gloo processes sharing {args.threads} threads "
              f"(each rank its own micro-batch)")
        _print(ep_rows, dense_tps)


args_global = None

if __name__ == "__main__":
    main()
