"""Training speed of one GPT in this project and in two peers, fp32 and bf16, with MFU.

    python bench/compare_peers.py                        # defaults: 5 rounds x 4 timed steps
    python bench/compare_peers.py --steps 8 --rounds 7 --precisions bf16
    python bench/compare_peers.py --profile ours --precisions fp32   # torch.profiler, one step
    python bench/compare_peers.py --model llama          # the Llama-style model (below)

The same model and step everywhere: GPT, 4 layers, hidden 256, 8 heads (ffn 1024), vocab 8192,
sequence 256, micro-batch 8 (2,048 tokens a step), learned absolute positions, GeLU (erf in
the peers; ours' default bias-GeLU fusion is Megatron's tanh approximation), LayerNorm, tied
input/output embeddings, dropout 0, loss = mean next-token cross-entropy over all b x s tokens; AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on matrices and
none on biases/norms), gradient clipping at global norm 1.0 (Megatron's default), synthetic
random tokens held in memory.

    ours            megatron.model.GPTModel through pretrain_gpt.py's model_provider and
                    forward_step, megatron.training.training.setup_model_and_optimizer (get_model:
                    Float16Module under --bf16, DistributedDataParallel's fp32 grad buffer;
                    get_megatron_optimizer: fp32 main params) and train_step, default flags.
    transformers    GPT2LMHeadModel (its default attention implementation) and a plain loop:
                    torch AdamW on the fp32 params; bf16 = torch.autocast(bfloat16) forward.
    megatron-core   megatron-core from PyPI: its GPTModel with the local (non-TE) layer spec,
                    its Float16Module under bf16 (bf16 params). Its optimizer wrappers
                    hard-code device='cuda' (optimizer.py, clip_grads.py), so the step is written
                    here with their semantics: torch AdamW on fp32 main params, grads copied from
                    the model, clipped, the result copied back. On CPU a few CUDA-only helpers are
                    patched (listed in the output: MCORE_CPU_PATCHES).

Each (precision, framework) run is its own process (so no framework's imports, threads or
allocator state touch another's; megatron-core also ships a `megatron` package that cannot live
beside this project's in one interpreter). Runs alternate A B C A B C, `--rounds` times; each run
does `--warmup` untimed steps then `--steps` timed ones. ms/step is the median of the timed
steps of that (precision, framework) that had the cores: on a CPU shared with other jobs, a step
whose CPU share (process CPU time / (wall x threads), ~0.99 when the cores are free) is under
--min-cpu-share is dropped, and a run that lost over half its steps is re-run (--retries).
MFU = model FLOP/s / the measured matmul ceiling of the same precision (bench/peak.py, before
and after the runs, the higher uncontended one). A framework that cannot run is reported as
`missing` with the reason, never estimated.

--model llama: the same comparison for a Llama-style model of about the same size -- RMSNorm,
SwiGLU (ffn 688), RoPE, 8 heads in 2 query groups, untied embeddings, no biases -- built from
one set of initial weights in all three (bench/compare_llama.py: ours from Megatron's Llama
flags with get_llama_layer_spec, LlamaForCausalLM, megatron-core's local spec with RMSNorm), so
their first losses, printed, agree.

On a CPU without a fast bf16 path (bf16 GEMMs over 4x slower than fp32, as with AVX2 only:
bench/peak.py's slow_bf16_reason) the bf16 runs and ceiling are skipped, the reason printed first
and last; --allow-slow-bf16 runs them anyway.

megatron-core is looked for at --mcore-path (default .venv/peers/megatron_core), installed with
    .venv/bin/pip install --no-deps --target .venv/peers/megatron_core megatron-core
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MCORE_PATH = os.path.join(ROOT, ".venv", "peers", "megatron_core")
FRAMEWORKS = ("ours", "transformers", "megatron-core")
PEERS = ("transformers", "megatron-core")
PRECISIONS = ("fp32", "bf16")
RESULT_TAG = "COMPARE_PEERS_RESULT "


@dataclass(frozen=True)
class GPTShape:
    """The benchmarked configuration (--model gpt; LLAMA_SHAPE for --model llama)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    vocab: int = 8192
    seq: int = 256
    micro_batch: int = 8
    family: str = "gpt"  # "llama": RMSNorm, SwiGLU, RoPE, grouped-query attention, untied, no biases
    ffn: int = 1024
    query_groups: int = 8
    lr: float = 1e-4
    weight_decay: float = 0.01
    clip_grad: float = 1.0

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq


GPT_SHAPE = GPTShape()
LLAMA_SHAPE = GPTShape(family="llama", ffn=688, query_groups=2)
SHAPES = {"gpt": GPT_SHAPE, "llama": LLAMA_SHAPE}
SHAPE = GPT_SHAPE  # the model of this process: select_model(--model) rebinds it


def select_model(name: str) -> GPTShape:
    """Make SHAPES[name] the shape every helper and worker of this process uses."""
    global SHAPE
    SHAPE = SHAPES[name]
    return SHAPE


OPTIMIZER_TEXT = ("AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, wd 0.01 on matrices, 0 on biases/norms), "
                  "grad clip 1.0")



# ------------------------------------------------------------------------------ pure helpers

def matmul_params(shape: GPTShape | None = None) -> int:
    """N: weights that take part in matmuls: per layer QKV h (np + 2 ng) hn, the projection h^2,
    the MLP (2 or, gated, 3) h ffn -- 12 h^2 for the GPT -- and V h for the output layer.

    Biases, norms, the position table and an untied input embedding (a lookup) are left out, as
    in Megatron's formula."""
    shape = shape or SHAPE
    h, hn = shape.hidden, shape.hidden // shape.heads
    mlp = (3 if shape.family == "llama" else 2) * h * shape.ffn
    layer = h * (shape.heads + 2 * shape.query_groups) * hn + h * h + mlp
    return shape.layers * layer + shape.vocab * h


def flops_per_step(shape: GPTShape | None = None) -> int:
    """Model FLOPs of one training step: 6 N T + 12 L s h T (T tokens, attention over the full s x s).

    The paper's count (forward 2 FLOPs per multiply-add, backward twice forward, no recompute,
    causal masking not discounted): megatron/training/training_log.py's num_floating_point_operations
    (Megatron-LM core_v0.13's, the causal half of the scores) plus 6 L s^2 h per sequence. Kept
    so that the MFU figures recorded in docs/PERFORMANCE.md stay comparable."""
    shape = shape or SHAPE
    tokens = shape.tokens_per_step
    return 6 * matmul_params(shape) * tokens + 12 * shape.layers * shape.seq * shape.hidden * tokens


FLOPS_TEXT = ("model FLOPs/step = 6*N*T + 12*L*s*h*T, N = 12*L*h^2 + V*h (matmul weights), T = b*s tokens "
              "(Megatron's formula: backward = 2x forward, full s x s attention, no recompute)")
LLAMA_FLOPS_TEXT = ("model FLOPs/step = 6*N*T + 12*L*s*h*T, N = L*(h*(np + 2*ng)*hn + h^2 + 3*h*ffn) + V*h "
                    "(matmul weights; the untied input embedding is a lookup), T = b*s tokens (Megatron's "
                    "formula: backward = 2x forward, full s x s attention, no recompute)")


def mfu(step_seconds: float, flops: float, peak_gflops: float) -> float:
    """Model FLOP/s over the measured ceiling, a fraction."""
    return flops / step_seconds / (peak_gflops * 1e9)


def best_peaks(measurements: list[dict], precisions: Sequence[str]) -> dict:
    """Per precision, the highest ceiling among bench/peak.py measurements that had an uncontended
    size (any measurement's if none had); "clean": {precision: bool}, device and threads of the first."""
    def clean(m: dict, p: str) -> bool:
        return len(m.get("contended", {}).get(p, ())) < len(m["by_size"][p])

    result = {"device": measurements[0]["device"], "threads": measurements[0]["threads"], "clean": {}}
    for p in precisions:
        candidates = [m[p] for m in measurements if clean(m, p)]
        result["clean"][p] = bool(candidates)
        result[p] = max(candidates or [m[p] for m in measurements])
    return result


def missing_reason(exc: BaseException, limit: int = 160) -> str:
    """'Type: first line of the message', on one line and at most `limit` characters."""
    text = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return reason if len(reason) <= limit else reason[:limit - 3] + "..."


@dataclass
class Measured:
    """One (precision, framework): the timed step times of every run, or why it could not run."""

    framework: str
    precision: str
    step_ms: list[float] = field(default_factory=list)
    missing: str | None = None
    notes: dict = field(default_factory=dict)
    contended_steps: int = 0
    reruns: int = 0
    first_losses: list[float] = field(default_factory=list)  # each run's first step (before any update)

    @property
    def ok(self) -> bool:
        return self.missing is None and bool(self.step_ms)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def tokens_per_s(self) -> float:
        return SHAPE.tokens_per_step / (self.median_ms / 1000)


def clean_steps(step_ms: list[float], cpu_share: list[float] | None, min_share: float) -> list[float]:
    """The steps that had the cores to themselves (CPU share >= min_share); all of them without shares."""
    if cpu_share is None:
        return list(step_ms)
    return [ms for ms, share in zip(step_ms, cpu_share) if share >= min_share]


def ratio_text(peer_name: str, ours: Measured, peer: Measured) -> str:
    """'ratio vs NAME X.XXx' (ours' tokens/s over the peer's), or 'ratio vs NAME missing (why)'."""
    if not peer.ok:
        return f"ratio vs {peer_name} missing ({peer.missing or 'no timed steps'})"
    if not ours.ok:
        return f"ratio vs {peer_name} missing (ours: {ours.missing or 'no timed steps'})"
    return f"ratio vs {peer_name} {ours.tokens_per_s / peer.tokens_per_s:.2f}x"


def ratio_line(precision: str, results: dict[str, Measured]) -> str:
    """`fp32: ratio vs transformers X.XXx | ratio vs megatron-core Y.YYx`."""
    ours = results["ours"]
    return f"{precision}: " + " | ".join(ratio_text(p, ours, results[p]) for p in PEERS)


def table_rows(results: dict[tuple[str, str], Measured], peaks: dict) -> list[str]:
    """The result table, one line per (precision, framework)."""
    flops = flops_per_step()
    rows = [f"{'precision':<10}{'framework':<15}{'ms/step':>9}{'(min-max, n)':>20}{'tokens/s':>10}"
            f"{'GFLOP/s':>9}{'MFU':>8}"]
    for (precision, framework), m in results.items():
        if not m.ok:
            rows.append(f"{precision:<10}{framework:<15}  missing ({m.missing or 'no timed steps'})")
            continue
        spread = f"({min(m.step_ms):.0f}-{max(m.step_ms):.0f}, {len(m.step_ms)})"
        gflops = flops / (m.median_ms / 1000) / 1e9
        rows.append(f"{precision:<10}{framework:<15}{m.median_ms:>9.1f}{spread:>20}{m.tokens_per_s:>10,.0f}"
                    f"{gflops:>9.1f}{mfu(m.median_ms / 1000, flops, peaks[precision]) * 100:>7.1f}%")
    return rows


# ------------------------------------------------------------------------------ shared by the workers

def _load_bench_module(name: str):
    """bench/<name>.py loaded by path (the peers' processes must not import the `bench` or
    `megatron` packages of this project)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MCORE_CPU_PATCHES = _load_bench_module("mcore_cpu_patches").MCORE_CPU_PATCHES
LLAMA = _load_bench_module("compare_llama")  # the --model llama builders, one set of weights for all three


def _load_device_module():
    """megatron/core/device.py loaded by path as a standalone module.

    The peers' processes must not import this project's `megatron` package (megatron-core's
    has the same name), yet they need the device and synchronisation the project's way."""
    spec = importlib.util.spec_from_file_location("_compat_device", os.path.join(ROOT, "megatron", "core", "device.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batches(count: int = 4) -> list:
    """Synthetic token streams [b, s + 1] (inputs are [:, :-1], labels [:, 1:]), fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, SHAPE.vocab, (SHAPE.micro_batch, SHAPE.seq + 1), generator=gen) for _ in range(count)]


def _adamw_groups(named_params) -> list[dict]:
    """Megatron's split: weight decay on matrices, none on biases and 1-D params (norms)."""
    decay, no_decay = [], []
    for name, param in named_params:
        (no_decay if name.endswith(".bias") or param.ndim == 1 else decay).append(param)
    return [{"params": decay, "weight_decay": SHAPE.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


_PROFILE_ROWS = 0  # set by --profile: one more step runs under torch.profiler, its table printed


def _timed(fn, device) -> tuple:
    """(fn(), wall seconds, CPU share = this process's CPU time / (wall x torch threads))."""
    import torch

    device.synchronize()
    start, cpu_start = time.perf_counter(), time.process_time()
    result = fn()
    device.synchronize()
    wall = time.perf_counter() - start
    return result, wall, (time.process_time() - cpu_start) / wall / torch.get_num_threads()


def _timed_steps(step, warmup: int, steps: int, device) -> dict:
    """Run warmup + steps calls of step() (returns the loss tensor).

    Returns {"step_ms": wall ms of each timed step, "cpu_share": per step, this process's CPU
    time / (wall time x torch threads) -- about 1.0 when the cores are ours, lower when other
    jobs take them (None on an accelerator, where the host waits) -- "loss": the last loss,
    "first_loss": the first step's, before any update (--model llama: the same weights in all three)}."""
    losses = [step() for _ in range(warmup)]
    times, shares = [], []
    for _ in range(steps):
        loss, wall, share = _timed(step, device)
        times.append(wall * 1000)
        shares.append(share)
        losses.append(loss)
    if _PROFILE_ROWS:
        losses.append(_profile_step(step, device))
    return {"step_ms": times, "cpu_share": None if device.accelerator_available() else shares,
            "loss": float(losses[-1]), "first_loss": float(losses[0])}


def _profile_step(step, device, tries: int = 10, min_share: float = 0.9):
    """One step under torch.profiler, retried (up to `tries`) until other jobs leave it the cores;
    prints the ops table by self CPU time; returns the step's loss."""
    from torch.profiler import ProfilerActivity, profile

    for attempt in range(1, tries + 1):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss, wall, share = _timed(step, device)
        if share >= min_share or device.accelerator_available() or attempt == tries:
            break
    print(f"profiled step: {wall * 1000:.0f} ms wall (with the profiler's overhead), CPU share {share:.2f}, "
          f"attempt {attempt}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=_PROFILE_ROWS), flush=True)
    return loss


class _MainParamsAdamW:
    """Float16OptimizerWithFloat16Params' step, for models whose own wrapper needs CUDA.

    fp32 main copies of the bf16 params; each step copies the grads to them, clips the global
    norm, steps torch AdamW on them and copies the result back into the model."""

    def __init__(self, named_params) -> None:
        import torch

        self.pairs = [(p, torch.nn.Parameter(p.detach().float())) for _, p in named_params]
        groups = _adamw_groups((n, main) for (n, _), (_, main) in zip(named_params, self.pairs))
        self.optimizer = torch.optim.AdamW(groups, lr=SHAPE.lr)

    def step(self) -> None:
        import torch

        for model_param, main in self.pairs:
            main.grad = None if model_param.grad is None else model_param.grad.float()
            model_param.grad = None
        torch.nn.utils.clip_grad_norm_([m for _, m in self.pairs], SHAPE.clip_grad)
        self.optimizer.step()
        with torch.no_grad():
            for model_param, main in self.pairs:
                model_param.copy_(main)


# ------------------------------------------------------------------------------ the three frameworks

def run_ours(precision: str, warmup: int, steps: int, extra_flags: list[str]) -> tuple[dict, dict]:
    """This project through pretrain_gpt.py's pieces and megatron.training.training.train_step."""
    sys.path.insert(0, ROOT)
    import torch

    import pretrain_gpt
    from megatron.core import device
    from megatron.core.enums import ModelType
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer, train_step_report

    s = SHAPE
    argv = ["--num-layers", str(s.layers), "--hidden-size", str(s.hidden), "--num-attention-heads", str(s.heads),
            "--seq-length", str(s.seq), "--max-position-embeddings", str(s.seq),
            "--micro-batch-size", str(s.micro_batch), "--global-batch-size", str(s.micro_batch),
            "--lr", str(s.lr), "--lr-decay-style", "constant",  # the peers' AdamW keeps lr 1e-4 too
            "--weight-decay", str(s.weight_decay), "--clip-grad", str(s.clip_grad),
            "--attention-dropout", "0", "--hidden-dropout", "0", "--optimizer", "adam",
            # NullTokenizer counts an end-of-document id: 8191 + 1 = 8192, no padding needed.
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(s.vocab - 1),
            "--train-iters", str(warmup + steps), "--eval-iters", "0", "--log-interval", "1000000"]
    argv += ["--bf16"] if precision == "bf16" else []
    if s.family == "llama":
        argv += LLAMA.megatron_flags(s)
    initialize_megatron(argv=argv + extra_flags)
    provider = _ours_llama_provider if s.family == "llama" else pretrain_gpt.model_provider
    model, optimizer, scheduler = setup_model_and_optimizer(provider, ModelType.encoder_or_decoder)
    position_ids = torch.arange(s.seq).expand(s.micro_batch, s.seq)
    batches = [{"tokens": b[:, :-1], "labels": b[:, 1:], "position_ids": position_ids,
                "loss_mask": torch.ones(s.micro_batch, s.seq)} for b in _batches()]
    data = itertools.cycle(batches)  # endless: --profile retries its step while other jobs hold the cores

    def step():
        losses, _, _, _ = train_step_report(pretrain_gpt.forward_step, data, model, optimizer, scheduler)
        return losses["lm loss"]

    if "--use-flash-attn" in extra_flags:
        attention = "sdpa (--use-flash-attn)"
    elif "reference" in extra_flags or "--no-masked-softmax-fusion" in extra_flags:
        attention = "composed matmul + softmax + matmul"
    else:
        attention = "fused_kernels.core_attention, causal by query blocks (default)"
    notes = {"attention": attention, "flags": " ".join(extra_flags)}
    notes.update(_OURS_NOTES)
    return _timed_steps(step, warmup, steps, device), notes


def _ours_llama_provider(pre_process: bool = True, post_process: bool = True):
    """The Llama-style GPTModel of the flags (LLAMA_FLAGS): their TransformerConfig, as
    pretrain_gpt.model_provider builds it, with get_llama_layer_spec, RoPE, untied, and the
    initial weights of bench/compare_llama.py loaded."""
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.global_vars import get_args, get_tokenizer

    args = get_args()
    config = core_transformer_config_from_args(args)
    _OURS_NOTES["fusions"] = f"apply_rope_fusion {config.apply_rope_fusion}, bias_swiglu_fusion {config.bias_swiglu_fusion}"
    return LLAMA.build_ours(config, SHAPE, vocab_size=args.padded_vocab_size, num_tokens=get_tokenizer().vocab_size)


_OURS_NOTES: dict = {}


def run_transformers(precision: str, warmup: int, steps: int) -> tuple[dict, dict]:
    """HuggingFace GPT2LMHeadModel (--model llama: LlamaForCausalLM) with a plain torch AdamW loop."""
    import contextlib

    import torch
    import torch.nn.functional as F

    device = _load_device_module()
    dev = device.get_device()
    s = SHAPE
    if s.family == "llama":
        model, config = LLAMA.build_hf(s, dev)
    else:
        model, config = _build_gpt2(dev)
    optimizer = torch.optim.AdamW(_adamw_groups(model.named_parameters()), lr=s.lr)
    batches = [b.to(dev) for b in _batches()]
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    counter = iter(range(10 ** 9))

    def step():
        tokens = batches[next(counter) % len(batches)]
        with autocast:
            logits = model(input_ids=tokens[:, :-1]).logits  # [b, s, V]
            loss = F.cross_entropy(logits.float().view(-1, s.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return _timed_steps(step, warmup, steps, device), {"attention": config._attn_implementation or "default"}


def _build_gpt2(dev):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    s = SHAPE
    config = GPT2Config(vocab_size=s.vocab, n_positions=s.seq, n_embd=s.hidden, n_layer=s.layers, n_head=s.heads,
                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                        bos_token_id=None, eos_token_id=None)
    torch.manual_seed(1234)
    return GPT2LMHeadModel(config).to(dev).train(), config


def _import_mcore():
    """megatron-core's package, refusing this project's (same name) if it is what resolves."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != ROOT]
    import megatron.core

    location = os.path.abspath(megatron.core.__file__)
    if location.startswith(os.path.join(ROOT, "megatron") + os.sep):
        raise ImportError("megatron-core is not installed (only this project's `megatron` was found); "
                          "pip install --no-deps --target .venv/peers/megatron_core megatron-core")
    return megatron.core


def _build_mcore_model(precision: str, dev):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    s, bf16 = SHAPE, precision == "bf16"
    if s.family == "llama":
        return LLAMA.build_mcore(s, precision, dev)
    config = TransformerConfig(num_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
                               hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16,
                               params_dtype=torch.bfloat16 if bf16 else torch.float32,
                               use_cpu_initialization=True)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=s.vocab, max_sequence_length=s.seq,
                     share_embeddings_and_output_weights=True).to(dev)
    return (Float16Module(config, model) if bf16 else model).train()


def run_megatron_core(precision: str, warmup: int, steps: int) -> tuple[dict, dict]:
    """megatron-core from PyPI: its GPTModel, the step of its Float16 optimizer written here."""
    mcore = _import_mcore()
    import torch
    import torch.distributed as dist

    device = _load_device_module()
    if not device.accelerator_available():
        _load_bench_module("mcore_cpu_patches").patch_for_cpu()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group(device.get_backend(), rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    dev = device.get_device()
    model = _build_mcore_model(precision, dev)
    named = list(model.named_parameters())
    if precision == "bf16":
        optimizer = _MainParamsAdamW(named)
    else:
        optimizer = torch.optim.AdamW(_adamw_groups(named), lr=SHAPE.lr)
    batches = [b.to(dev) for b in _batches()]
    position_ids = torch.arange(SHAPE.seq, device=dev).expand(SHAPE.micro_batch, SHAPE.seq)
    counter = iter(range(10 ** 9))

    def step():
        tokens = batches[next(counter) % len(batches)]
        losses = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:])  # [b, s] per token
        loss = losses.float().mean()
        loss.backward()
        if precision == "fp32":
            torch.nn.utils.clip_grad_norm_([p for _, p in named], SHAPE.clip_grad)
        optimizer.step()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    timing = _timed_steps(step, warmup, steps, device)
    dist.destroy_process_group()
    version = getattr(__import__("megatron.core.package_info", fromlist=["x"]), "__version__", "?")
    where = os.path.relpath(os.path.dirname(os.path.dirname(mcore.__file__)), ROOT)
    return timing, {"attention": "unfused (local spec)", "version": version, "from": where}


def worker(args: argparse.Namespace) -> None:
    """One run in this process; prints RESULT_TAG + JSON (_timed_steps' dict and notes, or missing)."""
    import torch

    torch.set_num_threads(args.threads)
    try:
        if args.worker == "ours":
            timing, notes = run_ours(args.precision, args.warmup, args.steps, args.ours_flags.split())
        elif args.worker == "transformers":
            timing, notes = run_transformers(args.precision, args.warmup, args.steps)
        else:
            timing, notes = run_megatron_core(args.precision, args.warmup, args.steps)
        result = dict(timing, notes=notes)
    except Exception as exc:  # reported as missing, with the reason, by the parent
        import traceback

        traceback.print_exc()
        result = {"missing": missing_reason(exc)}
    print(RESULT_TAG + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------ the parent process

def spawn(framework: str, precision: str, args: argparse.Namespace) -> dict:
    """Run one worker process; its parsed result (or missing, with the reason)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", framework, "--precision", precision,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--ours-flags=" + args.ours_flags, "--model", args.model]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the peers must not see this project's `megatron`
    if framework == "megatron-core":
        if not os.path.isdir(args.mcore_path):
            return {"missing": f"megatron-core not found at {args.mcore_path} (pip install --no-deps --target "
                               f"{os.path.relpath(DEFAULT_MCORE_PATH, ROOT)} megatron-core)"}
        env["PYTHONPATH"] = args.mcore_path
    env["PYTHONWARNINGS"] = "ignore"
    try:
        proc = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        return {"missing": f"TimeoutExpired: no result within {args.run_timeout} s"}
    return parse_worker_output(proc.stdout, proc.stderr, proc.returncode)


def parse_worker_output(stdout: str, stderr: str, returncode: int) -> dict:
    """The worker's RESULT_TAG line as a dict; a crash without one becomes missing, with stderr's last line."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (stderr.strip().splitlines() or ["no output"])[-1]
    return {"missing": f"worker exited {returncode}: {tail[:160]}"}


def _load_peak_module():
    spec = importlib.util.spec_from_file_location("_bench_peak", os.path.join(ROOT, "bench", "peak.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_once(m: Measured, args: argparse.Namespace) -> str:
    """One run of m's framework, re-run (up to --retries times) while other jobs took over half its
    steps' cores; adds its uncontended steps to m. Returns a progress line."""
    reruns_before = m.reruns
    for attempt in range(args.retries + 1):
        out = spawn(m.framework, m.precision, args)
        if "missing" in out:
            m.missing, m.step_ms = out["missing"], []
            return m.missing
        clean = clean_steps(out["step_ms"], out["cpu_share"], args.min_cpu_share)
        m.contended_steps += len(out["step_ms"]) - len(clean)
        if 2 * len(clean) >= len(out["step_ms"]) or attempt == args.retries:
            break
        m.reruns += 1
    m.step_ms += clean
    m.notes = dict(out["notes"], loss=out["loss"])
    m.first_losses.append(out["first_loss"])
    shares = out["cpu_share"] or [float("nan")]
    return (f"median {statistics.median(out['step_ms']):.0f} ms, {len(clean)}/{len(out['step_ms'])} steps kept "
            f"(CPU share {min(shares):.2f}-{max(shares):.2f}), {m.reruns - reruns_before} re-runs")


def measure(args: argparse.Namespace) -> dict[tuple[str, str], Measured]:
    """Every (precision, framework), runs alternating A B C A B C over the rounds."""
    results = {(p, f): Measured(f, p) for p in args.precisions for f in FRAMEWORKS}
    for round_index in range(args.rounds):
        for precision in args.precisions:
            for framework in FRAMEWORKS:
                m = results[(precision, framework)]
                if m.missing is not None:
                    continue  # it will not start working in the next round
                status = run_once(m, args)
                print(f"  round {round_index + 1}/{args.rounds} {precision} {framework:<14} {status}", flush=True)
    for m in results.values():
        if m.missing is None and not m.step_ms:
            m.missing = f"no uncontended step: other jobs held the cores (CPU share < {args.min_cpu_share})"
    return results


def ours_version() -> str:
    """The commit measured as 'ours', and whether the framework's files differ from it."""
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    dirty = git("status", "--porcelain", "--", "megatron", "pretrain_gpt.py")
    return commit + (" + uncommitted changes under megatron/" if dirty else "")


def report(results: dict[tuple[str, str], Measured], peaks: dict, args: argparse.Namespace) -> None:
    """The table, the notes (attention paths, patches, formula) and the two ratio lines."""
    print()
    print(f"config: {config_text()}")
    print(f"optimizer: {OPTIMIZER_TEXT}")
    print(f"ours: {ours_version()}")
    flops_text = LLAMA_FLOPS_TEXT if SHAPE.family == "llama" else FLOPS_TEXT
    print(f"FLOPs: {flops_text}; N = {matmul_params():,}, {flops_per_step() / 1e9:.2f} GFLOP/step")
    ceilings = ", ".join(f"{p} {peaks[p]:.1f} GFLOP/s" + ("" if peaks["clean"][p] else " (every timing contended)")
                         for p in args.precisions)
    print(f"MFU against bench/peak.py's measured matmul ceiling, the higher of before/after the runs: {ceilings} "
          f"({peaks['device']}, {peaks['threads']} threads)")
    print(f"timing: {args.rounds} rounds x {args.steps} timed steps after {args.warmup} warm-up steps per run, "
          f"runs alternating A B C; ms/step = median over the timed steps that had the cores "
          f"(CPU share >= {args.min_cpu_share}; steps dropped and runs re-run are listed below)")
    print()
    for row in table_rows(results, peaks):
        print(row)
    print()
    for (precision, framework), m in results.items():
        if m.ok:
            notes = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in m.notes.items() if v)
            print(f"  {precision} {framework}: {notes}; {m.contended_steps} contended steps dropped, "
                  f"{m.reruns} runs re-run")
    if any(f == "megatron-core" and m.ok for (_, f), m in results.items()):
        print("megatron-core CPU patches (applied in the benchmark's worker only):")
        for patch in MCORE_CPU_PATCHES:
            print(f"  - {patch}")
    if SHAPE.family == "llama":
        print("first losses (the same initial weights in all three, first batch, before any update):")
        for precision in args.precisions:
            print(f"  {precision}: " + first_loss_text({f: results[(precision, f)] for f in FRAMEWORKS}))
    print()
    for precision in PRECISIONS:
        if precision in args.precisions:
            print(ratio_line(precision, {f: results[(precision, f)] for f in FRAMEWORKS}))
    if getattr(args, "skipped", None):
        print(args.skipped)


def config_text(shape: GPTShape | None = None) -> str:
    """The model line of the report."""
    s = shape or SHAPE
    tokens = f"seq {s.seq}, micro-batch {s.micro_batch} ({s.tokens_per_step} tokens/step), dropout 0"
    if s.family == "llama":
        return (f"Llama-style {s.layers} layers, hidden {s.hidden}, {s.heads} heads, {s.query_groups} query groups, "
                f"SwiGLU ffn {s.ffn}, RMSNorm, RoPE (base {LLAMA.ROPE_BASE:g}), no biases, untied embeddings, "
                f"vocab {s.vocab}, {tokens}")
    return f"GPT {s.layers} layers, hidden {s.hidden}, {s.heads} heads, vocab {s.vocab}, {tokens}, tied embeddings"


def first_loss_text(results: dict[str, Measured]) -> str:
    """'ours 9.0123 | transformers 9.0124 (ours - it +1.0e-04) | ...' from each framework's first run."""
    ours = results["ours"].first_losses[0] if results["ours"].first_losses else None
    parts = []
    for framework, m in results.items():
        if not m.first_losses:
            parts.append(f"{framework} missing")
            continue
        text = f"{framework} {m.first_losses[0]:.5f}"
        if framework != "ours" and ours is not None:
            text += f" (ours - it {ours - m.first_losses[0]:+.1e})"
        parts.append(text)
    return " | ".join(parts)


def profile(args: argparse.Namespace) -> None:
    """One framework in this process: warm-up, --steps timed steps, then one step under torch.profiler."""
    global _PROFILE_ROWS
    _PROFILE_ROWS = args.profile_rows
    if args.profile == "megatron-core":
        sys.path.insert(0, args.mcore_path)
    args.worker, args.precision = args.profile, args.precisions[0]
    worker(args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="gpt",
                        help="gpt (default): the GPT-2-style model; llama: RMSNorm, SwiGLU, RoPE, GQA, untied")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (default 4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first in every run (default 2)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="A B C repetitions (default 5: a neighbour slowing one run shifts the median less)")
    parser.add_argument("--precisions", type=lambda s: s.split(","), default=list(PRECISIONS),
                        help="comma-separated, of fp32,bf16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: available cores)")
    parser.add_argument("--mcore-path", default=DEFAULT_MCORE_PATH, help="where megatron-core is installed")
    parser.add_argument("--ours-flags", default="", help="extra pretrain_gpt.py flags for ours, e.g. --use-flash-attn")
    parser.add_argument("--run-timeout", type=int, default=600, help="seconds before a run counts as missing")
    parser.add_argument("--min-cpu-share", type=float, default=0.9,
                        help="a step whose CPU time / (wall x threads) is below this shared its cores with "
                             "other jobs and is not counted (default 0.9)")
    parser.add_argument("--retries", type=int, default=2, help="re-runs of a run that lost over half its steps")
    parser.add_argument("--peak-repeats", type=int, default=7)
    parser.add_argument("--allow-slow-bf16", action="store_true",
                        help="measure bf16 even on a CPU without a fast bf16 path (bench/peak.py: skipped "
                             "there by default, its runs would take hours)")
    parser.add_argument("--profile", choices=FRAMEWORKS, default=None,
                        help="profile one step of this framework (first of --precisions) instead")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--worker", choices=FRAMEWORKS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    bad = [p for p in args.precisions if p not in PRECISIONS]
    if bad:
        parser.error(f"unknown precision(s) {bad}; choose from {PRECISIONS}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    select_model(args.model)
    peak = _load_peak_module()
    args.threads = args.threads or peak.available_cores()
    if args.worker:
        return worker(args)
    args.precisions, args.skipped = peak.drop_slow_bf16(args.precisions, args.allow_slow_bf16)
    if args.skipped:
        print(args.skipped, flush=True)
    if not args.precisions:
        return None
    if args.profile:
        return profile(args)
    before = peak.measure_peaks(repeats=args.peak_repeats, precisions=args.precisions, threads=args.threads)
    print("before the runs: " + peak.format_peaks(before), flush=True)
    results = measure(args)
    after = peak.measure_peaks(repeats=args.peak_repeats, precisions=args.precisions, threads=args.threads)
    print("after the runs: " + peak.format_peaks(after), flush=True)
    report(results, best_peaks([before, after], args.precisions), args)


if __name__ == "__main__":
    main()
