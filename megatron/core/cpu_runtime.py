"""Process settings for training on CPU cores: the intra-op thread count and glibc's allocator.

Threads. torch's default is every core of the machine in every process, which oversubscribes
the cores when several ranks share a host (torchrun --nproc-per-node N on one CPU box) and
ignores a CPU affinity mask (taskset, a container's cpuset). Here each process takes

    OMP_NUM_THREADS                                    when set (torchrun sets 1 for N > 1
                                                       unless the user set it)
    --cpu-threads N                                    when given (overrides the above)
    cores available to the process / local processes   otherwise (at least 1)

where "cores available" is the affinity mask (os.sched_getaffinity), and local processes is
LOCAL_WORLD_SIZE (torchrun) or 1.

Allocator. Every training step frees and re-allocates the same large activations. glibc
serves blocks above its mmap threshold (128 KiB, rising dynamically to 32 MiB) with mmap and
returns them with munmap, and trims the top of the heap when more than 128 KiB is free; the
next step then faults the same memory back in page by page (about 100,000 minor faults a
step on the benchmark GPT of bench/compare_peers.py; docs/PERFORMANCE.md). tune_malloc()
makes glibc keep freed memory for reuse, as a caching allocator does on a GPU: large blocks
come from the heap (M_MMAP_THRESHOLD 1 GiB), the heap is not trimmed below 2 GiB of free top
(M_TRIM_THRESHOLD) and grows in 256 MiB steps (M_TOP_PAD). The process keeps its peak memory instead of
handing it back between steps. Other C libraries (musl) have no mallopt: nothing is changed
and the report says so. --no-cpu-malloc-tuning turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass

import torch

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MALLOC_SETTINGS = {  # parameter -> (name, value)
    M_MMAP_THRESHOLD: ("M_MMAP_THRESHOLD", 1 << 30),
    M_TRIM_THRESHOLD: ("M_TRIM_THRESHOLD", 2 ** 31 - 1),  # mallopt takes an int
    M_TOP_PAD: ("M_TOP_PAD", 256 << 20),
}


def available_cores() -> int:
    """Cores this process may run on (its affinity mask), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def local_processes() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def thread_count(requested: int | None = None) -> tuple[int, str]:
    """(intra-op threads for this process, where the number came from); see the module docstring."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--cpu-threads must be >= 1, got {requested}")
        return requested, "--cpu-threads"
    env = os.environ.get("OMP_NUM_THREADS")
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {env!r}") from None
        if value < 1:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {env!r}")
        return value, "OMP_NUM_THREADS"
    cores, procs = available_cores(), local_processes()
    return max(1, cores // procs), f"{cores} cores available / {procs} local process{'es' if procs > 1 else ''}"


def tune_malloc() -> str | None:
    """Make glibc keep freed memory (see the module docstring). Returns None when done, else why not."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return f"no mallopt in the C library ({name or 'not found'})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    refused = [label for param, (label, value) in MALLOC_SETTINGS.items()
               if mallopt(param, value) != 1]
    return f"mallopt refused {', '.join(refused)}" if refused else None


@dataclass(frozen=True)
class CPURuntime:
    threads: int
    threads_source: str
    malloc: str  # what was done to the allocator, in words

    def describe(self) -> str:
        return f"CPU runtime: {self.threads} intra-op threads ({self.threads_source}); allocator: {self.malloc}"


def configure(threads: int | None = None, malloc_tuning: bool = True) -> CPURuntime:
    """Set torch's intra-op threads and (optionally) tune glibc malloc for this process."""
    count, source = thread_count(threads)
    torch.set_num_threads(count)
    if not malloc_tuning:
        malloc = "glibc defaults (--no-cpu-malloc-tuning)"
    else:
        failure = tune_malloc()
        malloc = ("freed memory kept for reuse (M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD 2 GiB, M_TOP_PAD 256 MiB)"
                  if failure is None else f"unchanged: {failure}")
    return CPURuntime(count, source, malloc)
