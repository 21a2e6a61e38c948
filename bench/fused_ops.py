"""CPU time of each fused op: reference vs native vs compiled vs the plain autograd code it replaces.

For every op of megatron.fused_kernels, at small-model shapes (b=8, np=8, s=256, h=256,
ffn=1024, V=8192; RoPE and SwiGLU at a Llama-style layer's: hn=32, 2 query groups, SwiGLU
ffn=688), times forward + backward (median of --repeats runs, after warm-up runs that
also pay torch.compile) of
    torch       the unfused PyTorch the model runs with the fusion switched off
    reference   the op's plain-PyTorch reference (impl="reference")
    native      ATen's own kernels (impl="native"; the reference itself where it already is one)
    compiled    torch.compile of the reference's math (impl="compiled")
and prints the speed-ups over the reference, which decide each op's CPU fast path. Then the
attention core at the same shapes (hn = 32, causal): the composed matmul + reference softmax +
matmul, torch's scaled_dot_product_attention, and fused_kernels.core_attention. --dtype sets
the inputs of the attention core, rotary_pos_emb and bias_swiglu (the other ops run fp32).
It prints figures and asserts nothing.

    python bench/fused_ops.py [--repeats 20] [--ops layer_norm,...] [--threads N] [--clock wall|cpu]
                              [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron import fused_kernels as fk  # noqa: E402

B, HEADS, S, H, FFN, VOCAB = 8, 8, 256, 256, 1024, 8192
HN, GROUPS, SWIGLU_FFN = H // HEADS, 2, 688  # Llama-style: grouped queries, gated MLP


def _leaf(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def _softmax_case():
    scores = _leaf(B, HEADS, S, S)  # [b, np, sq, sk]
    causal = torch.ones(S, S, dtype=torch.bool).triu_(1)

    def torch_path():
        return torch.softmax(scores.masked_fill(causal, -10000.0) * 1.0, dim=-1)

    return f"[b={B}, np={HEADS}, s={S}, s] causal", scores, torch_path, \
        lambda impl: fk.scale_mask_softmax(scores, None, 1.0, causal=True, impl=impl)


def _layer_norm_case():
    x, weight, bias = _leaf(S, B, H), _leaf(H), _leaf(H)
    return f"[s={S}, b={B}, h={H}]", x, lambda: F.layer_norm(x, (H,), weight, bias, 1e-5), \
        lambda impl: fk.layer_norm(x, weight, bias, 1e-5, impl=impl)


def _rms_norm_case():
    x, weight = _leaf(S, B, H), _leaf(H)
    return f"[s={S}, b={B}, h={H}]", x, lambda: F.rms_norm(x, (H,), weight, 1e-5), \
        lambda impl: fk.rms_norm(x, weight, 1e-5, impl=impl)


def _bias_gelu_case():
    x, bias = _leaf(S, B, FFN), _leaf(FFN)
    return f"[s={S}, b={B}, ffn={FFN}]", x, lambda: F.gelu(x + bias, approximate="tanh"), \
        lambda impl: fk.bias_gelu(x, bias, impl=impl)


def _bias_dropout_add_case():
    x, bias, residual = _leaf(S, B, H), _leaf(H), _leaf(S, B, H)
    return f"[s={S}, b={B}, h={H}] p=0.1", x, lambda: residual + F.dropout(x + bias, 0.1, True), \
        lambda impl: fk.bias_dropout_add(x, bias, residual, 0.1, True, impl=impl)


def _cross_entropy_case():
    logits, labels = _leaf(S * B, VOCAB), torch.randint(0, VOCAB, (S * B,))
    return f"[n={S * B}, V={VOCAB}]", logits, lambda: F.cross_entropy(logits, labels, reduction="none"), \
        lambda impl: fk.cross_entropy(logits, labels, impl=impl)


def _megatron_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's unfused RoPE (_apply_rotary_pos_emb_bshd, non-interleaved, full rotary)."""
    t1, t2 = torch.chunk(t, 2, dim=-1)
    return t * torch.cos(freqs).to(t.dtype) + torch.cat((-t2, t1), dim=-1) * torch.sin(freqs).to(t.dtype)


def _rotary_pos_emb_case(dtype: torch.dtype):
    per_group = HEADS // GROUPS
    mixed = _leaf(S, B, GROUPS, (per_group + 2) * HN, dtype=dtype)  # fused QKV [s, b, ng, (np/ng + 2) hn]
    f = torch.outer(torch.arange(S, dtype=torch.float32), 10000.0 ** (-torch.arange(0, HN, 2) / HN))
    freqs = torch.cat((f, f), dim=-1)[:, None, None, :]  # [s, 1, 1, hn]

    def split():  # as Megatron-Core's attention: q copied by the reshape, k a strided view
        q = mixed[..., :per_group * HN].reshape(S, B, HEADS, HN)  # [s, b, np, hn]
        return q, mixed[..., per_group * HN:(per_group + 1) * HN]  # k [s, b, ng, hn]

    def both(rope: Callable) -> torch.Tensor:
        q, k = split()
        return rope(q).sum() + rope(k).sum()

    return f"q [s={S}, b={B}, np={HEADS}, hn={HN}] + k ng={GROUPS}", mixed, \
        lambda: both(lambda t: _megatron_rope(t, freqs)), \
        lambda impl: both(lambda t: fk.rotary_pos_emb(t, freqs, impl=impl))


def _bias_swiglu_case(dtype: torch.dtype):
    x = _leaf(S, B, 2 * SWIGLU_FFN, dtype=dtype)  # linear_fc1's output; Llama's linears have no bias

    def torch_path():
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * up

    return f"[s={S}, b={B}, 2*ffn={2 * SWIGLU_FFN}] no bias", x, torch_path, \
        lambda impl: fk.bias_swiglu(x, None, impl=impl)


TYPED_CASES: dict[str, Callable] = {  # take --dtype
    "rotary_pos_emb": _rotary_pos_emb_case,
    "bias_swiglu": _bias_swiglu_case,
}
CASES: dict[str, Callable] = {
    "scale_mask_softmax": _softmax_case,
    "layer_norm": _layer_norm_case,
    "rms_norm": _rms_norm_case,
    "bias_gelu": _bias_gelu_case,
    "bias_dropout_add": _bias_dropout_add_case,
    "cross_entropy": _cross_entropy_case,
    **TYPED_CASES,
}


def median_ms(steps: dict[str, Callable[[], torch.Tensor]], leaf: torch.Tensor, repeats: int,
              clock: Callable[[], float] = time.perf_counter, warmup: int = 3,
              sample_s: float = 0.02) -> dict[str, float]:
    """Median time (ms, by `clock`) of one forward + backward (of the output's sum) of each step.

    Each sample times enough back-to-back calls to last about sample_s (short ops are
    otherwise all timer and scheduler noise), and the steps take turns within each repeat,
    so a busy machine slows them alike and the ratios hold.
    """
    def sample(step: Callable[[], torch.Tensor], calls: int) -> float:
        start = clock()
        for _ in range(calls):
            leaf.grad = None
            step().sum().backward()
        return (clock() - start) / calls

    calls = {}
    for name, step in steps.items():
        for _ in range(warmup):  # the first calls also compile
            sample(step, 1)
        calls[name] = max(1, round(sample_s / sample(step, 1)))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(sample(step, calls[name]))
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ops", default=",".join(CASES), help="comma-separated op names")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="of the inputs of the attention core, rotary_pos_emb and bias_swiglu")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this thread's CPU time, which other processes on a shared machine do not "
                             "inflate (needs --threads 1: with more, work runs on other threads)")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if dtype == torch.bfloat16:
        from megatron.core.cpu_bf16 import slow_bf16_warning

        warning = slow_bf16_warning("the attention core in bf16")  # None on a GPU or with native bf16
        if warning:
            print(warning, flush=True)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, triton {fk.triton_version()}, "
          f"{args.clock} clock, median of {args.repeats} samples of forward+backward (ms per call)")
    print(f"{'op':<20s} {'shape':<30s} {'torch':>9s} {'reference':>10s} {'native':>9s} {'compiled':>9s} "
          f"{'ref/native':>11s} {'ref/compiled':>13s}  CPU fast path")
    for name in args.ops.split(","):
        shape, leaf, torch_path, fused = CASES[name](dtype) if name in TYPED_CASES else CASES[name]()
        ms = median_ms({"torch": torch_path, "reference": lambda: fused("reference"), "native": lambda: fused("native"),
                        "compiled": lambda: fused("compiled")}, leaf, args.repeats, clock)
        t_torch, t_ref, t_nat, t_comp = ms["torch"], ms["reference"], ms["native"], ms["compiled"]
        print(f"{name:<20s} {shape:<30s} {t_torch:9.2f} {t_ref:10.2f} {t_nat:9.2f} {t_comp:9.2f} "
              f"{t_ref / t_nat:10.2f}x {t_ref / t_comp:12.2f}x  {fk.OPS[name].cpu_fast_path}", flush=True)
    attention_core(args.repeats, clock, dtype)


def attention_core(repeats: int, clock: Callable[[], float], dtype: torch.dtype) -> None:
    """The model's three ways to the attention core on CPU, causal, forward + backward."""
    hn = H // HEADS
    q, k, v = (torch.randn(B * HEADS, S, hn, dtype=dtype).requires_grad_() for _ in range(3))
    by_head = [x.detach().view(B, HEADS, S, hn).requires_grad_() for x in (q, k, v)]
    scale = hn ** -0.5

    def composed():  # DotProductAttention with --fused-kernels-cpu-impl reference
        scores = torch.matmul(by_head[0], by_head[1].transpose(-1, -2)) * scale
        return torch.matmul(fk.scale_mask_softmax(scores, None, 1.0, causal=True, impl="reference"), by_head[2])

    def sdpa():  # FlashDotProductAttention on CPU (--use-flash-attn)
        return F.scaled_dot_product_attention(*by_head, is_causal=True)

    def core():  # the default CPU path
        return fk.core_attention(q, k, v, scale=scale, heads=HEADS, causal=True)

    times = {}
    for name, step, leaf in (("composed reference", composed, by_head[0]), ("sdpa", sdpa, by_head[0]),
                             ("core_attention", core, q)):
        times[name] = median_ms({name: step}, leaf, repeats, clock)[name]
    print(f"attention core, causal, [b={B}, np={HEADS}, s={S}, hn={hn}] {str(dtype).replace('torch.', '')}: "
          + ", ".join(f"{name} {ms:.2f} ms" for name, ms in times.items()), flush=True)


if __name__ == "__main__":
    main()
