"""Named random streams, so dropout can differ across tensor-parallel ranks where it must.

Dropout on a tensor replicated over the TP ranks must draw the same mask on every rank (the
replicas stay equal); dropout on a TP-split tensor (this rank's heads, or its s/t tokens under
sequence parallelism) must draw a different one per rank, or the ranks' slices would share a
mask pattern the serial model would never produce. The default generator serves the first
case (seeded alike on all TP ranks); `get_cuda_rng_tracker().fork()` swaps in the
"model-parallel-rng" stream, seeded per TP rank, for the second, and swaps the default back after.

The stream swapped is the generator dropout uses on this process's device: the accelerator's
(via megatron.core.device) when there is one, otherwise the CPU default generator.

`checkpoint(function, distribute_saved_activations, *args)` is Megatron's activation recompute:
it keeps only the inputs of `function`, reruns it in backward with every generator (CPU, device,
and the tracker's streams) set back to its forward state, so dropout draws the same masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron.core import communication, device, parallel_state

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


# ----------------------------------------------------------------------------- activation recompute


def _get_rng_states() -> tuple:
    """Every generator a forward may draw from: CPU, accelerator (None on CPU), the tracker's streams."""
    return torch.get_rng_state(), device.get_rng_state(), _RNG_STATE_TRACKER.get_states()


def _set_rng_states(states: tuple) -> None:
    cpu_state, device_state, tracker_states = states
    torch.set_rng_state(cpu_state)
    device.set_rng_state(device_state)
    _RNG_STATE_TRACKER.set_states(tracker_states)


def _split_into_1d_chunk(tensor: torch.Tensor) -> torch.Tensor:
    """This TP rank's 1/t of tensor's elements, flattened, as a new buffer: [numel / t]."""
    world_size = parallel_state.get_tensor_model_parallel_world_size()
    if tensor.numel() % world_size:
        raise ValueError(f"distribute_saved_activations: {tensor.numel()} elements of the saved input "
                         f"{tuple(tensor.shape)} do not split evenly over {world_size} tensor-parallel ranks")
    chunk = tensor.numel() // world_size
    start = parallel_state.get_tensor_model_parallel_rank() * chunk
    return tensor.reshape(-1)[start:start + chunk].clone()  # [numel / t]


def _gather_1d_chunks(chunk: torch.Tensor, shape: torch.Size, stride: tuple) -> torch.Tensor:
    """Inverse of _split_into_1d_chunk: all-gather the t chunks into a tensor of `shape` and `stride`.

    The strides are the original's too (even those of size-1 dims, which a view of a transposed
    [b=1, s, h] tensor has): kernels may take another path for other strides, and the recompute
    would then round differently from the forward it repeats.
    """
    world_size = parallel_state.get_tensor_model_parallel_world_size()
    whole = chunk.new_empty((world_size * chunk.numel(),))  # [numel]
    communication.all_gather_into_tensor(whole, chunk, group=parallel_state.get_tensor_model_parallel_group())
    restored = whole.view(shape)
    if restored.stride() != stride:
        restored = torch.empty_strided(shape, stride, dtype=chunk.dtype, device=chunk.device).copy_(restored)
    return restored


class _MakeViewless(torch.autograd.Function):
    """An alias of a view that is not itself a view (Megatron's make_viewless_tensor): its .data
    can then be swapped without touching the base tensor."""

    @staticmethod
    def forward(ctx, input_):
        out = torch.empty((1,), dtype=input_.dtype, device=input_.device)
        out.data = input_.data
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def make_viewless_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """tensor itself, or when it is a view an alias that is not (Megatron's make_viewless_tensor):
    a pipeline stage's output can then be released (its .data swapped) after it is sent."""
    return tensor if tensor._base is None else _MakeViewless.apply(tensor)


class CheckpointFunction(torch.autograd.Function):
    """Runs `function(*args)` without keeping its activations; backward reruns it (Megatron's).

    Forward saves the generator states and the tensor args only. With
    distribute_saved_activations the first arg (the layer input [s, b, h], replicated over the
    TP ranks) is kept as this rank's 1/t slice: its storage is swapped for the slice in place,
    so the caller's reference holds s*b*h/t too, and backward all-gathers it back before
    rerunning. Backward restores the forward's RNG states, recomputes with grad enabled,
    back-propagates through the recomputed graph, and puts the backward's RNG states back.
    """

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        ctx.run_function = run_function
        # With one TP rank there is nothing to distribute over.
        distribute_saved_activations = (distribute_saved_activations
                                        and parallel_state.get_tensor_model_parallel_world_size() > 1)
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.rng_states = _get_rng_states()
        with torch.no_grad():
            outputs = run_function(*args)
        if distribute_saved_activations:
            ctx.input_0_shape, ctx.input_0_stride = args[0].shape, args[0].stride()
            args[0].data = _split_into_1d_chunk(args[0].data)  # [s, b, h] -> [s * b * h / t]
        # Non-tensor args (None masks, flags) cannot be saved: keep them apart and in order.
        ctx.tensor_positions = [i for i, arg in enumerate(args) if torch.is_tensor(arg)]
        ctx.non_tensor_args = [None if torch.is_tensor(arg) else arg for arg in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint() supports torch.autograd.backward() only, not torch.autograd.grad()")
        args = list(ctx.non_tensor_args)
        for position, saved in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[position] = saved
        if ctx.distribute_saved_activations:
            args[0].data = _gather_1d_chunks(args[0].data, ctx.input_0_shape, ctx.input_0_stride)  # -> [s, b, h]
        detached = [arg.detach().requires_grad_(arg.requires_grad) if torch.is_tensor(arg) else arg for arg in args]

        backward_rng_states = _get_rng_states()
        _set_rng_states(ctx.rng_states)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*detached)
        finally:
            _set_rng_states(backward_rng_states)

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs) if torch.is_tensor(out) and out.requires_grad]
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        grads = tuple(arg.grad if torch.is_tensor(arg) else None for arg in detached)
        return (None, None) + grads


def checkpoint(function, distribute_saved_activations: bool, *args):
    """function(*args), its activations recomputed in backward instead of kept (see CheckpointFunction).

    Megatron's tensor_parallel.checkpoint. A first arg that is a view is first given its own
    tensor object, so that distributing it cannot free the storage of the tensor it views.
    """
    if distribute_saved_activations and args and torch.is_tensor(args[0]) and args[0]._base is not None:
        args = (_MakeViewless.apply(args[0]),) + tuple(args[1:])
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)
