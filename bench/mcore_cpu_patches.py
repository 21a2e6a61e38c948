"""The CUDA-only helpers megatron-core's GPT (dense and MoE), BERT and T5 paths call, redone on CPU (MCORE_CPU_PATCHES).

Imported only inside processes that run megatron-core (its package is also called `megatron`):
bench/compare_peers.py's worker and the reference snippets of tests/helpers/mcore_reference.py, which
paste this file's text into the snippet. It imports nothing of this project.
"""

MCORE_CPU_PATCHES = (
    "tensor_parallel.random._get_cuda_rng_state/_set_cuda_rng_state -> torch.get_rng_state/set_rng_state "
    "(the RNG tracker's fork() saves and restores the CUDA generator)",
    "tensor_parallel.random.CudaRNGStatesTracker.add -> a CPU torch.Generator state "
    "(it calls torch.cuda.get_rng_state/manual_seed)",
    "utils.GlobalMemoryBuffer.get_tensor -> allocate on CPU (it passes device=torch.cuda.current_device(); "
    "the unfused attention's baddbmm buffer)",
    "fusions.fused_softmax.get_default_causal_mask -> the same mask built on CPU (it uses device='cuda')",
    "torch.cuda.current_device -> 'cpu' (RotaryEmbedding.get_emb moves its CPU inv_freq to that device)",
    "models.T5.t5_spec.TENorm -> its LNImpl when Transformer Engine is missing (the local block specs take "
    "their final norms from TENorm, None without TE: no final norm at all, unlike a T5 written with TE)",
    "transformer.moe.moe_utils.te_general_gemm -> None when Transformer Engine is missing (the router's "
    "gating linear tests `te_general_gemm is not None`, a name only its TE import defines; None is its "
    "torch.mm path)",
    "transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher: no CUDA side stream (its constructor makes "
    "torch.cuda.Stream()) and _maybe_dtoh_and_synchronize without streams or events: at its copy point the "
    "split sizes become numpy arrays, as its device-to-host copy makes them",
)


def patch_for_cpu() -> None:
    """Apply MCORE_CPU_PATCHES to the megatron-core imported in this process."""
    import functools

    import torch
    from megatron.core import utils as mcore_utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)

    def add(self, name, seed):
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    mcore_random.CudaRNGStatesTracker.add = add

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        numel = 1
        for size in tensor_shape:
            numel *= size
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
        return buffer[:numel].view(*tensor_shape)

    mcore_utils.GlobalMemoryBuffer.get_tensor = get_tensor
    torch.cuda.current_device = lambda: "cpu"
    fused_softmax.get_default_causal_mask = functools.lru_cache(None)(
        lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1))
    from megatron.core.models.T5 import t5_spec

    if t5_spec.TENorm is None:
        t5_spec.TENorm = t5_spec.LNImpl
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no CUDA stream on CPU"  # not None: never made

    def dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = dtoh_and_synchronize
