"""The one place that picks the device and the distributed backend.

Nothing else in the project calls `.cuda()` or `torch.cuda.*`: code asks this module for the
device (`get_device()`), the backend (`get_backend()`), and for the accelerator's RNG state,
synchronisation and memory figures, which are no-ops (or None) on CPU.

    CUDA available  -> device cuda:<LOCAL_RANK>, backend nccl
    otherwise       -> device cpu,               backend gloo
    --distributed-backend overrides the backend (set_backend_override).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

_BACKEND_OVERRIDE: Optional[str] = None
_FORCE_CPU = os.environ.get("MEGATRON_FORCE_CPU", "0") == "1"


def accelerator_available() -> bool:
    """True when a CUDA device is present and not disabled by MEGATRON_FORCE_CPU=1."""
    return (not _FORCE_CPU) and torch.cuda.is_available()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_device() -> torch.device:
    """cuda:<LOCAL_RANK> on a GPU machine, else cpu."""
    if accelerator_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def set_device() -> torch.device:
    """Bind this process to its device (the CUDA device of its local rank); returns it."""
    device = get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def set_backend_override(backend: Optional[str]) -> None:
    """Force a backend ('nccl' or 'gloo'); None restores the automatic choice."""
    global _BACKEND_OVERRIDE
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ValueError(f"unknown distributed backend {backend!r}; expected 'nccl' or 'gloo'")
    _BACKEND_OVERRIDE = backend


def get_backend() -> str:
    if _BACKEND_OVERRIDE is not None:
        return _BACKEND_OVERRIDE
    return "nccl" if accelerator_available() else "gloo"


def manual_seed(seed: int) -> None:
    """Seed the accelerator's generators (the CPU generator is seeded by torch.manual_seed)."""
    if accelerator_available():
        torch.cuda.manual_seed(seed)


def get_rng_state() -> Optional[torch.Tensor]:
    """The accelerator's RNG state, or None on CPU."""
    if accelerator_available():
        return torch.cuda.get_rng_state()
    return None


def set_rng_state(state: Optional[torch.Tensor]) -> None:
    if state is not None and accelerator_available():
        torch.cuda.set_rng_state(state)


def synchronize() -> None:
    """Wait for queued accelerator work (for honest timings); nothing to do on CPU."""
    if accelerator_available():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if accelerator_available():
        torch.cuda.empty_cache()


def memory_stats() -> Dict[str, Any]:
    """Allocated / reserved / peak bytes on the accelerator; empty on CPU."""
    if not accelerator_available():
        return {}
    return {
        "allocated_bytes": torch.cuda.memory_allocated(),
        "max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "reserved_bytes": torch.cuda.memory_reserved(),
        "max_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


def device_name() -> str:
    if accelerator_available():
        return torch.cuda.get_device_name(get_device())
    return "cpu"
