"""The fast CPU training path (issue 8) gives the plain path's numbers.

The fast path is the default: fused ops in ATen's own kernels and the one-node attention core
(--fused-kernels-cpu-impl native), oneDNN's fp32 GEMMs in the linear layers' forward and
input gradient, the one-rank cross entropy, gradient-accumulation fusion with
bf16 weight-gradient GEMMs, torch's fused AdamW, one for-each copy of the main params into the
model, the CPU runtime (threads from the cores, glibc malloc keeping freed memory). The plain
path is --fused-kernels-cpu-impl reference --no-gradient-accumulation-fusion
--no-cpu-malloc-tuning. Each piece is compared here; end to end, pretrain_gpt gives the same
losses for 5 iterations either way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron.core import cpu_runtime
from megatron.core.tensor_parallel import cross_entropy as ce

PLAIN_FLAGS = ["--fused-kernels-cpu-impl", "reference", "--no-gradient-accumulation-fusion", "--no-cpu-malloc-tuning"]


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- cross entropy on one rank


def _ce_pair(dtype, padded: int | None, chunk_bytes: int, monkeypatch):
    monkeypatch.setattr(ce, "_ROWS_PER_CHUNK_BYTES", chunk_bytes)
    generator = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(6, 3, 100, generator=generator)).to(dtype)
    target = torch.randint(0, padded or 100, (6, 3), generator=generator)
    logits[0, 0, target[0, 0]] = -200.0  # a confidently wrong token: probability below 1e-30
    logits[1, 2, 5] = 1e4  # and an extreme logit
    grad_output = torch.rand(6, 3, generator=generator)
    results = []
    for fast in (True, False):
        x = logits.clone().requires_grad_()
        loss = ce.vocab_parallel_cross_entropy(x, target, unpadded_vocab_size=padded, compute_dtype=torch.float32,
                                               one_rank_fast_path=fast)
        loss.backward(grad_output)
        results.append((loss.detach(), x.grad))
    return results


@pytest.mark.parametrize("padded", [None, 90])
@pytest.mark.parametrize("chunk_bytes", [4 << 20, 4 * 100 * 4])  # one chunk / 4 tokens per chunk
def test_one_rank_cross_entropy_equals_the_general_path_in_fp32(padded, chunk_bytes, monkeypatch):
    (fast_loss, fast_grad), (loss, grad) = _ce_pair(torch.float32, padded, chunk_bytes, monkeypatch)
    assert fast_loss.dtype == torch.float32 and fast_grad.dtype == torch.float32
    assert _relative(fast_loss, loss) < 1e-6 and _relative(fast_grad, grad) < 1e-6
    assert fast_loss[0, 0] > 150  # the underflowing token's loss is exact, not inf
    if padded:
        assert fast_grad[..., padded:].abs().max() == 0


def test_one_rank_cross_entropy_in_bf16_computes_in_fp32_and_returns_a_bf16_gradient(monkeypatch):
    (fast_loss, fast_grad), (loss, grad) = _ce_pair(torch.bfloat16, 90, 4 * 100 * 4, monkeypatch)
    assert fast_grad.dtype == torch.bfloat16 and fast_loss.dtype == torch.float32
    assert _relative(fast_loss, loss) < 1e-6  # the loss is computed in fp32 from the same bf16 logits
    assert _relative(fast_grad, grad) < 2 ** -7  # the gradient rounded to bf16 twice instead of once


def test_half_precision_cross_entropy_keeps_the_general_path():
    """--fp16-lm-cross-entropy (compute in fp16/bf16): -log p would overflow where an fp16 softmax
    underflows, so such losses take the general logsumexp - logit path, finite for a hopeless token."""
    logits = torch.zeros(2, 1, 50, dtype=torch.float16)
    logits[0, 0, 7] = 30.0  # the target (0) gets probability e^-30 < fp16's smallest subnormal
    target = torch.zeros(2, 1, dtype=torch.long)
    loss = ce.vocab_parallel_cross_entropy(logits, target, compute_dtype=torch.float16)
    assert loss.dtype == torch.float16 and torch.isfinite(loss).all() and abs(float(loss[0, 0]) - 30.0) < 0.1


def test_one_rank_cross_entropy_without_grad_and_twice_through_one_graph():
    logits, target = torch.randn(4, 2, 50), torch.randint(0, 50, (4, 2))
    with torch.no_grad():
        loss = ce.vocab_parallel_cross_entropy(logits, target)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), target.reshape(-1), reduction="none")
    assert _relative(loss.reshape(-1), expected) < 1e-6
    x = logits.clone().requires_grad_()
    loss = ce.vocab_parallel_cross_entropy(x, target).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


# ---------------------------------------------------------------- oneDNN fp32 GEMMs in the linear layers


@pytest.mark.parametrize("fusion", [True, False])
def test_onednn_linear_layers_equal_f_linear(fusion, monkeypatch):
    """ColumnParallelLinear (with bias) and RowParallelLinear, fp32 on CPU: the "native" impl runs the
    forward and input-gradient GEMMs through oneDNN, "reference" through F.linear; same outputs and
    gradients to fp32 rounding, with and without gradient-accumulation fusion's main_grad."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, layers
    from megatron.model.transformer_config import TransformerConfig

    if not layers._ONEDNN:
        pytest.skip("torch built without oneDNN")
    calls = []
    original = layers._linear
    monkeypatch.setattr(layers, "_linear", lambda *args: calls.append(args[-1]) or original(*args))
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(12, 3, 48, generator=generator)
    grad = torch.randn(12, 3, 40, generator=generator)
    results = {}
    for impl in ("native", "reference"):
        config = TransformerConfig(num_layers=1, hidden_size=48, num_attention_heads=4, fused_kernels_cpu_impl=impl,
                                   gradient_accumulation_fusion=fusion)
        torch.manual_seed(0)
        column = ColumnParallelLinear(48, 64, config=config, init_method=torch.nn.init.normal_, bias=True)
        row = RowParallelLinear(64, 40, config=config, init_method=torch.nn.init.normal_, bias=True)
        if fusion:
            for param in (column.weight, row.weight):
                param.main_grad = torch.zeros_like(param)
        inputs = x.clone().requires_grad_()
        out, _ = row(column(inputs)[0])
        out.backward(grad)
        weight_grads = [p.main_grad if fusion else p.grad for p in (column.weight, row.weight)]
        results[impl] = [out.detach(), inputs.grad, *weight_grads, column.bias.grad, row.bias.grad]
    assert calls.count(True) == 4  # native: 2 forward + 2 input-gradient GEMMs through oneDNN; reference: none
    for a, b in zip(results["native"], results["reference"]):
        assert _relative(a, b) < 1e-5


# ---------------------------------------------------------------- optimizer


def test_fused_adamw_is_chosen_and_matches_the_for_each_update():
    from megatron.core.optimizer import _build_torch_optimizer, _fused_adam_applies
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(37, 5, generator=generator), torch.randn(11, generator=generator)]
    grads = [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(5)]
    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1)
    results = {}
    for fused in (True, False):
        copies = [torch.nn.Parameter(p.clone()) for p in params]
        groups = [{"params": copies, "wd_mult": 1.0, "lr_mult": 1.0}]
        assert _fused_adam_applies(groups)
        optimizer = _build_torch_optimizer(config, groups)
        assert optimizer.defaults["fused"] is True
        if not fused:
            optimizer = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=True)
        for step_grads in grads:
            for p, g in zip(copies, step_grads):
                p.grad = g.clone()
            optimizer.step()
        results[fused] = copies
    for a, b in zip(results[True], results[False]):
        assert _relative(a.detach(), b.detach()) < 1e-6
    assert not _fused_adam_applies([{"params": [torch.zeros(3, dtype=torch.int64)]}])


# ---------------------------------------------------------------- CPU runtime


def test_thread_count_sources(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(cpu_runtime, "available_cores", lambda: 8)
    assert cpu_runtime.thread_count() == (4, "8 cores available / 2 local processes")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert cpu_runtime.thread_count()[0] == 1  # never 0
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_runtime.thread_count() == (3, "OMP_NUM_THREADS")
    assert cpu_runtime.thread_count(5) == (5, "--cpu-threads")
    for bad in ("0", "two"):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
            cpu_runtime.thread_count()
    with pytest.raises(ValueError, match="--cpu-threads"):
        cpu_runtime.thread_count(0)


_FAULTS_SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    from megatron.core import cpu_runtime
    if sys.argv[1] == "tuned":
        assert cpu_runtime.tune_malloc() is None
    def step():  # a training step's pattern: large activations allocated, written, all freed at the end
        live = [torch.empty(n << 20).fill_(1.0) for n in (16, 8, 12, 2, 16)]  # 54 x 4 MiB
    for _ in range(3):
        step()
    faults = []
    for _ in range(7):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(sorted(faults)[3])  # the median step: the heap may still settle in one or two
""")


def test_malloc_tuning_stops_refaulting_freed_activations():
    """glibc only. Steps that allocate and free 216 MiB of activations: by default every block
    above the mmap threshold is a fresh mmap, faulted in page by page each step (about 55,000
    faults a step here); tuned, the freed memory is reused from the heap after the first steps."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt tuning is glibc's")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    faults = {}
    for mode in ("default", "tuned"):
        run = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], capture_output=True, text=True, cwd=root,
                             env={**os.environ, "PYTHONPATH": root}, timeout=120)
        assert run.returncode == 0, run.stderr
        faults[mode] = int(run.stdout.split()[-1])
    assert faults["default"] >= 108, faults  # at least a fault per 2 MiB (transparent huge pages) per step
    assert faults["tuned"] < 0.05 * faults["default"], faults


def test_configure_reports_what_it_did(monkeypatch):
    threads = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        runtime = cpu_runtime.configure(threads=1, malloc_tuning=False)
        assert torch.get_num_threads() == 1
        assert runtime.describe() == ("CPU runtime: 1 intra-op threads (--cpu-threads); "
                                      "allocator: glibc defaults (--no-cpu-malloc-tuning)")
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- end to end


def _losses(argv: list[str]) -> list[float]:
    import pretrain_gpt

    result = pretrain_gpt.main(argv, record_history=True)
    return [record.losses["lm loss"] for record in result.history]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fast_path_and_plain_path_train_to_the_same_losses(precision, capsys):
    """pretrain_gpt, 5 iterations, dropout 0.1 (so the RNG streams must line up too): the default
    (fast) flags and the plain path log the same losses, fp32 to 1e-5 and bf16 to bf16 rounding."""
    from tests.helpers.training import MOCK, TINY

    argv = [*TINY, *MOCK, "--eval-iters", "0", "--train-iters", "5"] + (["--bf16"] if precision == "bf16" else [])
    threads = torch.get_num_threads()
    try:
        fast = _losses(argv)
        plain = _losses(argv + PLAIN_FLAGS)
    finally:
        from megatron.training.initialize import _destroy_distributed

        _destroy_distributed()
        torch.set_num_threads(threads)
    output = capsys.readouterr().out
    assert "CPU runtime:" in output and "allocator: glibc defaults (--no-cpu-malloc-tuning)" in output
    assert len(fast) == len(plain) == 5
    tolerance = 1e-5 if precision == "fp32" else 2e-2
    for a, b in zip(fast, plain):
        assert abs(a - b) <= tolerance * abs(b), (fast, plain)
    assert fast[-1] < fast[0]  # it trains


@pytest.mark.slow
def test_torch_compile_flag_trains_to_the_same_losses(capsys):
    """--torch-compile (each transformer layer through torch.compile): the eager losses, fp32."""
    from tests.helpers.training import MOCK, TINY

    argv = [*TINY, *MOCK, "--eval-iters", "0", "--train-iters", "3", "--hidden-dropout", "0",
            "--attention-dropout", "0"]
    threads = torch.get_num_threads()
    try:
        eager = _losses(argv)
        compiled = _losses(argv + ["--torch-compile"])
    finally:
        from megatron.training.initialize import _destroy_distributed

        _destroy_distributed()
        torch.set_num_threads(threads)
    assert "> torch.compile: 2 transformer layers" in capsys.readouterr().out
    assert len(eager) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(compiled, eager)), (compiled, eager)
