"""Named random streams, so dropout can differ across tensor-parallel ranks where it must.

Dropout on a tensor replicated over the TP ranks must draw the same mask on every rank (the
replicas stay equal); dropout on a TP-split tensor (this rank's heads, or its s/t tokens under
sequence parallelism) must draw a different one per rank, or the ranks' slices would share a
mask pattern the serial model would never produce. The default generator serves the first
case (seeded alike on all TP ranks); `get_cuda_rng_tracker().fork()` swaps in the
"model-parallel-rng" stream, seeded per TP rank, for the second, and swaps the default back after.

The stream swapped is the generator dropout uses on this process's device: the accelerator's
(via megatron.core.device) when there is one, otherwise the CPU default generator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron.core import device, parallel_state

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"

# Offset of the per-TP-rank seeds from the base seed (Megatron's constant), so the
# model-parallel streams never coincide with the default stream.
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _get_device_rng_state() -> torch.Tensor:
    if device.accelerator_available():
        return device.get_rng_state()
    return torch.get_rng_state()


def _set_device_rng_state(state: torch.Tensor) -> None:
    if device.accelerator_available():
        device.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _seed_device_rng(seed: int) -> None:
    if device.accelerator_available():
        device.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states; `fork(name)` runs a block on one of them, then restores the default."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of {name: generator state} (e.g. for a checkpoint)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace all tracked states (e.g. from a checkpoint)."""
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Start a stream `name` seeded with `seed`; the default generator is left as it was."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the RNG tracker")
        self.seeds_.add(seed)
        original = _get_device_rng_state()
        _seed_device_rng(seed)
        self.states_[name] = _get_device_rng_state()
        _set_device_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from stream `name` inside the block; it advances, the default stream does not."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not in the RNG tracker (call model_parallel_cuda_manual_seed)")
        original = _get_device_rng_state()
        _set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_device_rng_state()
            _set_device_rng_state(original)


# Megatron's name for the class.
CudaRNGStatesTracker = RNGStatesTracker

_RNG_STATE_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (Megatron's name; nothing here is CUDA-specific)."""
    return _RNG_STATE_TRACKER


get_rng_tracker = get_cuda_rng_tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the device's default generator with `seed` (the same on all TP ranks) and the
    tracker's "model-parallel-rng" stream with seed + 2718 + tp_rank (different on each)."""
    tensor_parallel_seed = seed + _MODEL_PARALLEL_SEED_OFFSET + parallel_state.get_tensor_model_parallel_rank()
    _seed_device_rng(seed)
    _RNG_STATE_TRACKER.reset()
    _RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_parallel_seed)
