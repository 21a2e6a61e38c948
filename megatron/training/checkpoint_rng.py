"""The `rng_state` entry of model_optim_rng.pt: exact for our resume, loadable by Megatron-LM.

    key                       content
    random_rng_state          random.getstate()
    np_rng_state              np.random.get_state()
    torch_rng_state           torch.get_rng_state() (the CPU generator, uint8 [5056])
    cuda_rng_state            the CUDA generator's state, uint8 [16]
    rng_tracker_states        {name: CUDA generator state, uint8 [16]} (dropout streams)
    cpu_rng_tracker_states    CPU runs only: {name: CPU generator state, uint8 [5056]}

Megatron-LM's loader calls torch.cuda.set_rng_state(cuda_rng_state) and sets every tracker
state on the CUDA generator, which takes the Philox layout: 16 bytes, the uint64 seed and then
the uint64 offset, little-endian. On a GPU those entries are the real CUDA states. On a CPU there
is no CUDA generator: the entries hold Philox states whose seed is derived from the matching CPU
state (the first 8 bytes of its sha256) at offset 0, so Megatron loads the file and draws a
stream that depends on the saved state, and our own exact CPU states go under
`cpu_rng_tracker_states`, a key Megatron never reads. (A CPU stream cannot be continued on a GPU
or the other way round: the generators differ.)
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from megatron.training.checkpoint_safety import CheckpointError
from megatron.core import device, tensor_parallel

CPU_TRACKER_KEY = "cpu_rng_tracker_states"
PHILOX_STATE_BYTES = 16  # uint64 seed, uint64 offset (torch's CUDA generator state)


def philox_state_from(state: torch.Tensor) -> torch.Tensor:
    """A CUDA Philox generator state (uint8 [16]: seed, offset 0) seeded from `state`'s bytes."""
    digest = hashlib.sha256(state.detach().cpu().contiguous().numpy().tobytes()).digest()
    raw = digest[:8] + (0).to_bytes(8, "little")  # the seed is any 64-bit value; offset 0
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def get_rng_state() -> List[Dict[str, Any]]:
    """This process's RNG states in Megatron's format (a one-element list)."""
    tracker_states = tensor_parallel.get_cuda_rng_tracker().get_states()
    entry: Dict[str, Any] = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    accelerator_state = device.get_rng_state()
    if accelerator_state is not None:  # the real CUDA states, as Megatron writes them
        entry["cuda_rng_state"] = accelerator_state
        entry["rng_tracker_states"] = tracker_states
    else:
        entry["cuda_rng_state"] = philox_state_from(entry["torch_rng_state"])
        entry["rng_tracker_states"] = {name: philox_state_from(state)
                                       for name, state in tracker_states.items()}
        entry[CPU_TRACKER_KEY] = tracker_states
    return [entry]


def _tracker_states_for_this_device(rng_state: Dict[str, Any], checkpoint_name: str,
                                    log: Callable[[str], None]) -> Optional[Dict[str, Any]]:
    on_accelerator = device.accelerator_available()
    states = rng_state.get("rng_tracker_states")
    if not on_accelerator and rng_state.get(CPU_TRACKER_KEY):
        states = rng_state[CPU_TRACKER_KEY]
    if not states:
        return None
    size = (device.get_rng_state() if on_accelerator else torch.get_rng_state()).numel()
    if any(not torch.is_tensor(state) or state.numel() != size for state in states.values()):
        log(f"WARNING: the RNG tracker states in {checkpoint_name} were saved on another kind of "
            f"device than this run's ({'CUDA' if on_accelerator else 'CPU'}); the dropout streams "
            "keep this run's seed")
        return None
    return states


def set_rng_state(state_dict: Dict[str, Any], checkpoint_name: str,
                  log: Callable[[str], None] = print) -> None:
    """Restore the generators from a checkpoint (rng_state[0], or very old top-level keys)."""
    if "rng_state" in state_dict:
        rng_state = state_dict["rng_state"][0]
    else:
        rng_state = state_dict  # very old checkpoints kept the states at the top level
    needed = ("random_rng_state", "np_rng_state", "torch_rng_state")
    missing = [key for key in needed if key not in rng_state]
    if missing:
        raise CheckpointError(f"checkpoint {checkpoint_name} has no RNG state "
                              f"({', '.join(missing)} missing; saved with --no-save-rng?); "
                              "pass --no-load-rng or --finetune to skip restoring it")
    random.setstate(rng_state["random_rng_state"])
    np.random.set_state(rng_state["np_rng_state"])
    torch.set_rng_state(rng_state["torch_rng_state"])
    device.set_rng_state(rng_state.get("cuda_rng_state"))  # a no-op on CPU
    tracker_states = _tracker_states_for_this_device(rng_state, checkpoint_name, log)
    if tracker_states:
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker_states)
