"""Which implementation of a fused op runs: the one seam for Triton and torch.compile.

Every op in this package has four implementations with the same semantics:

    "triton"     a Triton kernel (forward and backward); runs on CUDA, or on CPU under the
                 Triton interpreter (TRITON_INTERPRET=1, slow: for tests only)
    "compiled"   torch.compile of the op's forward and backward math written in PyTorch ops
    "native"     ATen's own fused kernels where one computes the op (F.gelu's tanh GeLU,
                 torch.softmax and its backward), in the input dtype with fp32 arithmetic
                 inside; the reference itself where the reference already is one ATen kernel.
                 One exception, measured: bias_gelu on CPU tensors of 1M elements or more
                 compiles its sigmoid form (fused_bias_gelu.py)
    "reference"  plain PyTorch, always available (the semantics, written out formula by formula)

Automatic choice, per call, from the input's device:

    cuda + Triton importable -> "triton"
    cpu                      -> the op's CPU fast path ("native", "compiled" or "reference",
                                measured by bench/fused_ops.py; each op module says which and why)
    anything else            -> "reference"

Forcing, strongest first: the `impl=` argument of each op; `force_implementation(name)` (a
context manager); the environment variable MEGATRON_FUSED_IMPL (e.g. "reference" for a quick
CPU test run that should not pay torch.compile's start-up). Forcing "triton" on CPU without
TRITON_INTERPRET=1, or without Triton, raises instead of silently running something else.

Triton is imported here and nowhere else; without it the package still imports (the kernels'
bodies never run). TRITON_INTERPRET=1 must be in the environment before this module is first
imported: Triton jits its own library (tl.max, tl.randint, ...) when it is imported, so a
process that imported it uncompiled cannot interpret later (tests run it in a subprocess).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

IMPLEMENTATIONS = ("triton", "compiled", "native", "reference")
_ENV_VAR = "MEGATRON_FUSED_IMPL"
_forced: str | None = None

try:  # the one optional import of the package
    import triton
    import triton.language as tl
except (ImportError, OSError, RuntimeError):  # absent or broken: the kernels' bodies never run then
    triton = None
    tl = None


def triton_available() -> bool:
    """True when Triton imported (its kernels can run on CUDA, or on CPU when interpreted)."""
    return triton is not None


def triton_interpreted() -> bool:
    """True when TRITON_INTERPRET=1: Triton kernels then run on CPU tensors (for tests only)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)  # Triton's own reading of the variable (Triton >= 3.4)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_version() -> str | None:
    return None if triton is None else triton.__version__


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kernel(fn: Callable) -> Any:
    """`triton.jit` when Triton is importable; otherwise a stand-in that raises when launched."""
    if triton is not None:
        return triton.jit(fn)

    def launch(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"Triton kernel {fn.__name__} needs Triton: pip install triton")

    return _Unlaunchable(launch)


class _Unlaunchable:
    def __init__(self, launch: Callable) -> None:
        self.launch = launch

    def __getitem__(self, grid: Any) -> Callable:
        return self.launch


@contextlib.contextmanager
def force_implementation(name: str | None) -> Iterator[None]:
    """Run every fused op in the block with implementation `name` (None: automatic choice)."""
    global _forced
    _check_name(name)
    previous, _forced = _forced, name
    try:
        yield
    finally:
        _forced = previous


def _check_name(name: str | None) -> None:
    if name is not None and name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown fused-kernel implementation {name!r} (from impl=, force_implementation or "
                         f"{_ENV_VAR}); expected one of {IMPLEMENTATIONS}")


class Kernels(NamedTuple):
    """One implementation of an op: its forward and backward functions (signatures per op)."""

    forward: Callable
    backward: Callable


@dataclass(frozen=True)
class FusedOp:
    """The implementations of one op, and the rule that picks one of them."""

    name: str
    cpu_fast_path: str  # "native", "compiled" or "reference", measured by bench/fused_ops.py
    implementations: dict[str, Kernels]

    def __post_init__(self) -> None:
        missing = set(IMPLEMENTATIONS) - set(self.implementations)
        if missing:
            raise ValueError(f"fused op {self.name} lacks implementations {sorted(missing)}")

    def select(self, device: torch.device, impl: str | None = None) -> str:
        """The implementation a call on `device` runs (see the module docstring for the order)."""
        name = impl or _forced or os.environ.get(_ENV_VAR) or None
        _check_name(name)
        if name is None:
            if device.type == "cuda" and triton_available():
                return "triton"
            return self.cpu_fast_path if device.type == "cpu" else "reference"
        if name == "triton":
            if not triton_available():
                raise RuntimeError(f"{self.name}: implementation 'triton' forced, but Triton is not importable "
                                   "(pip install triton)")
            if device.type != "cuda" and not triton_interpreted():
                raise RuntimeError(f"{self.name}: Triton on {device.type} tensors needs TRITON_INTERPRET=1 "
                                   "(set before Triton is imported)")
        return name

    def kernels(self, device: torch.device, impl: str | None = None) -> Kernels:
        return self.implementations[self.select(device, impl)]


def compile_pays(x: torch.Tensor, min_numel: int) -> bool:
    """A native CPU path runs its compiled formulas for x: a CPU tensor of at least min_numel
    elements (below, compiling does not pay back), and not already inside torch.compile."""
    return x.device.type == "cpu" and x.numel() >= min_numel and not torch.compiler.is_compiling()


class BiasActivation(torch.autograd.Function):
    """y = kernels.forward(x, bias) saving only x and bias, for the elementwise bias + activation ops
    (bias_gelu, bias_swiglu); backward: kernels.backward(dy, x, bias) -> (dx, dbias or None), dbias
    returned in bias's dtype. apply(x, bias, kernels)."""

    @staticmethod
    def forward(ctx, x, bias, kernels):
        ctx.save_for_backward(x, bias)
        ctx.kernels = kernels
        return kernels.forward(x, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, bias = ctx.saved_tensors
        dx, dbias = ctx.kernels.backward(grad_y, x, bias)
        return dx, (None if dbias is None else dbias.to(bias.dtype)), None


def compiled(fn: Callable, fallback: Callable | None = None) -> Callable:
    """torch.compile(fn), built at the first call. If the compiled call fails where `fn` itself
    succeeds (no C++ compiler, an unsupported platform), warn once and run `fallback` (default:
    `fn` uncompiled) from then on; an error of the inputs raises from `fn` as usual."""
    state: dict[str, Any] = {}
    instead = fallback or fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "fn" not in state:
            state["fn"] = torch.compile(fn)
        if state["fn"] is instead:
            return instead(*args, **kwargs)
        try:
            return state["fn"](*args, **kwargs)
        except Exception as error:  # noqa: BLE001 -- decided by whether fn fails too
            result = fn(*args, **kwargs)
            warnings.warn(f"torch.compile of {fn.__qualname__} failed ({type(error).__name__}: {error}); "
                          f"running {instead.__qualname__} uncompiled from now on", RuntimeWarning, stacklevel=2)
            state["fn"] = instead
            return result if instead is fn else instead(*args, **kwargs)

    return wrapper
