"""Activation memory of one transformer layer: the bytes it saves for backward, measured, next to
the formulas of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (sec. 4), per layer on one tensor-parallel rank:

| case                           | bytes per layer              |
|---|---|
| no parallelism                 | sbh (34 + 5as/h)             |
| tensor parallel (t)            | sbh (10 + 24/t + 5as/(ht))   |
| tensor + sequence parallel     | sbh (34/t + 5as/(ht))        |
| tensor parallel + selective    | sbh (10 + 24/t)              |
| tensor + sequence + selective  | sbh (34/t)                   |
| full recompute                 | 2sbh (2sbh/t with SP or distributed saved inputs) |

s sequence, b micro-batch, h hidden, a heads, t TP size; 16-bit activations and 1-byte dropout
masks. docs/memory.md explains, term by term, where the measurement differs.

The measurement runs a real TransformerLayer forward under torch.autograd.graph.saved_tensors_hooks
and adds up the storages autograd keeps, each once (tensors sharing a storage -- q, k and v
of one QKV output -- count once, with the storage's full size), leaving out parameters and the
attention mask (one [1, 1, s, s] tensor for all layers, not a per-layer cost). With TP > 1 it
needs the tensor-parallel group (parallel_state) and gives this rank's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from megatron.core import device, parallel_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.model.transformer_config import TransformerConfig
from megatron.model.transformer_layer import TransformerBlock, TransformerLayer
from megatron.model.utils import get_causal_attention_mask

RECOMPUTE_MODES = (None, "selective", "full")


def saved_tensor_bytes(fn: Callable[..., Any], *args: Any, exclude: Iterable[torch.Tensor] = (),
                       records: list | None = None) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn(*args) runs.

    Each storage counts once, with its full size, whatever number of tensors (views) are saved
    from it; storages of `exclude` (e.g. parameters) do not count. `records`, if given, receives
    (shape, dtype, storage bytes) of each counted storage, for a breakdown.
    """
    excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in excluded and pointer not in storages:
            storages[pointer] = storage.nbytes()
            if records is not None:
                records.append((tuple(tensor.shape), tensor.dtype, storage.nbytes()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args)
    return sum(storages.values())


def layer_config(hidden_size: int, num_attention_heads: int, *, dtype: torch.dtype = torch.bfloat16,
                 sequence_parallel: bool = False, recompute: str | None = None,
                 distribute_saved_activations: bool = False, use_flash_attn: bool = False,
                 dropout: float = 0.1) -> TransformerConfig:
    """A one-layer config for the measurement (the paper's layer: ffn 4h, hn = h / a, dropout on)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    full = recompute == "full"
    return TransformerConfig(
        num_layers=1, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        sequence_parallel=sequence_parallel, hidden_dropout=dropout, attention_dropout=dropout,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        recompute_granularity=recompute, recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None, distribute_saved_activations=distribute_saved_activations,
        use_flash_attn=use_flash_attn)


def measure_layer_activation_bytes(seq_length: int, micro_batch_size: int, hidden_size: int,
                                   num_attention_heads: int, *, dtype: torch.dtype = torch.bfloat16,
                                   sequence_parallel: bool = False, recompute: str | None = None,
                                   distribute_saved_activations: bool = False, use_flash_attn: bool = False,
                                   dropout: float = 0.1, records: list | None = None) -> int:
    """Bytes one training-mode layer saves for backward on this TP rank (see the module docstring).

    recompute: None, "selective" (core attention rerun) or "full" (the layer keeps its input only).
    Collective over the tensor-parallel group when TP > 1: every rank of it must call this.
    """
    config = layer_config(hidden_size, num_attention_heads, dtype=dtype, sequence_parallel=sequence_parallel,
                          recompute=recompute, distribute_saved_activations=distribute_saved_activations,
                          use_flash_attn=use_flash_attn, dropout=dropout)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    local_seq = seq_length // tp if sequence_parallel else seq_length
    tracker = get_cuda_rng_tracker()
    states = (torch.get_rng_state(), device.get_rng_state(), tracker.get_states(), set(tracker.seeds_))
    # Own seeds (the dropouts need the tracker's stream); the caller's generators are put back after.
    model_parallel_cuda_manual_seed(1234)
    try:
        # A one-layer block (no final norm) runs the layer through the block's recompute path.
        full = recompute == "full"
        module = TransformerBlock(config, post_process=False) if full else TransformerLayer(config, layer_number=1)
        module.train()
        hidden_states = torch.randn(local_seq, micro_batch_size, hidden_size, dtype=dtype,
                                    requires_grad=True)  # [s, b, h] ([s/t, b, h] with SP)
        mask = get_causal_attention_mask(seq_length)  # [1, 1, s, s]
        exclude = list(module.parameters()) + [mask]
        args = (hidden_states, mask) if full else (hidden_states, mask, True)
        return saved_tensor_bytes(module, *args, exclude=exclude, records=records)
    finally:
        torch.set_rng_state(states[0])
        device.set_rng_state(states[1])
        tracker.set_states(states[2])
        tracker.seeds_ = states[3]


def paper_activation_bytes(seq_length: int, micro_batch_size: int, hidden_size: int, num_attention_heads: int,
                           tensor_parallel_size: int = 1, sequence_parallel: bool = False,
                           recompute: str | None = None, distribute_saved_activations: bool = False) -> float:
    """Korthikanti et al. 2022's bytes per layer on one TP rank (the table in the module docstring)."""
    s, b, h, a, t = seq_length, micro_batch_size, hidden_size, num_attention_heads, tensor_parallel_size
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel or distribute_saved_activations else 1)
    per_token = 34 / t if sequence_parallel else 10 + 24 / t  # layer norms, linears' inputs, GeLU, masks
    attention = 0.0 if recompute == "selective" else 5 * a * s / (h * t)  # scores, softmax, its dropout
    return sbh * (per_token + attention)
