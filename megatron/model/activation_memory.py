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

A Llama-style layer (llama_query_groups g: RMSNorm, SwiGLU of width f, g K/V groups, RoPE, no
biases; unfused rope and SwiGLU), exactly, without parallelism: sbh (18 + 8f/h) + 5as^2b + 8sb
+ 16 s hn (llama_activation_bytes has the TP, SP and recompute cases; docs/memory.md the terms).

The measurement runs a real TransformerLayer forward under torch.autograd.graph.saved_tensors_hooks
and adds up the storages autograd keeps, each once (tensors sharing a storage -- q, k and v
of one QKV output -- count once, with the storage's full size), leaving out parameters and the
attention mask (one [1, 1, s, s] tensor for all layers, not a per-layer cost). With TP > 1 it
needs the tensor-parallel group (parallel_state) and gives this rank's bytes; with CP > 1 (the
context-parallel group) the layer runs on this CP rank's s/N tokens and exchanges K/V with the others.
Every per-token term is then 1/N of the serial one; the attention's s^2 terms are not (see docs/parallelism.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core import device, parallel_state
from megatron.core.context_parallel import split_for_cp_rank
from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.model.positions import RotaryEmbedding
from megatron.model.transformer_config import TransformerConfig
from megatron.model.layer_specs import layer_spec_from_config
from megatron.model.transformer_block import TransformerBlock
from megatron.model.transformer_layer import TransformerLayer
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
    # Every saved tensor is held until fn returns: a storage that autograd saved and then released
    # (a transient node's) must not hand its address to a later saved storage, which the dedup by
    # address would then skip (what the allocator reuses depends on what ran before in the process)
    held: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        held.append(tensor)
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in excluded and pointer not in storages:
            storages[pointer] = storage.nbytes()
            if records is not None:
                records.append((tuple(tensor.shape), tensor.dtype, storage.nbytes()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args)
    held.clear()
    return sum(storages.values())


def llama_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron's --swiglu default width, int(4h x 2/3 / 64) x 64."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64


def _llama_fields(hidden_size: int, num_query_groups: int | None, fused: bool = True) -> dict:
    """RMSNorm, SwiGLU, GQA, no biases; rope is given to the layer as freqs. fused: the RoPE and
    SwiGLU fusions on (the defaults), else their PyTorch formulas."""
    return dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                num_query_groups=num_query_groups, ffn_hidden_size=llama_ffn_hidden_size(hidden_size),
                bias_swiglu_fusion=fused, apply_rope_fusion=fused)


def layer_config(hidden_size: int, num_attention_heads: int, *, dtype: torch.dtype = torch.bfloat16,
                 sequence_parallel: bool = False, recompute: str | None = None,
                 distribute_saved_activations: bool = False, use_flash_attn: bool = False,
                 dropout: float = 0.1, llama_query_groups: int | None = None,
                 llama_fused: bool = True) -> TransformerConfig:
    """A one-layer config for the measurement: the paper's layer (ffn 4h, hn = h / a, dropout on), or
    with llama_query_groups g a Llama-style layer (_llama_fields) with g key/value groups."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    full = recompute == "full"
    llama = {} if llama_query_groups is None else _llama_fields(hidden_size, llama_query_groups, llama_fused)
    return TransformerConfig(**llama,
        num_layers=1, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        sequence_parallel=sequence_parallel, hidden_dropout=dropout, attention_dropout=dropout,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        recompute_granularity=recompute, recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None, distribute_saved_activations=distribute_saved_activations,
        use_flash_attn=use_flash_attn)


def measure_layer_activation_bytes(seq_length: int, micro_batch_size: int, hidden_size: int,
                                   num_attention_heads: int, *, dtype: torch.dtype = torch.bfloat16,
                                   sequence_parallel: bool = False, recompute: str | None = None,
                                   distribute_saved_activations: bool = False, use_flash_attn: bool = False,
                                   dropout: float = 0.1, records: list | None = None,
                                   llama_query_groups: int | None = None, llama_fused: bool = True) -> int:
    """Bytes one training-mode layer saves for backward on this TP rank (see the module docstring).

    recompute: None, "selective" (core attention rerun) or "full" (the layer keeps its input only).
    llama_query_groups: measure the Llama-style layer (RMSNorm, SwiGLU, that many K/V groups, RoPE,
    no biases) instead of the paper's, with the RoPE and SwiGLU fusions (llama_fused, the defaults)
    or their PyTorch formulas. Collective over the tensor-parallel group when TP > 1.
    """
    config = layer_config(hidden_size, num_attention_heads, dtype=dtype, sequence_parallel=sequence_parallel,
                          recompute=recompute, distribute_saved_activations=distribute_saved_activations,
                          use_flash_attn=use_flash_attn, dropout=dropout, llama_query_groups=llama_query_groups,
                          llama_fused=llama_fused)
    tp, cp = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_context_parallel_world_size()
    cp_seq = seq_length // cp  # this CP rank's tokens (the load-balanced chunks r and 2N-1-r)
    local_seq = cp_seq // tp if sequence_parallel else cp_seq
    tracker = get_cuda_rng_tracker()
    states = (torch.get_rng_state(), device.get_rng_state(), tracker.get_states(), set(tracker.seeds_))
    # Own seeds (the dropouts need the tracker's stream); the caller's generators are put back after.
    model_parallel_cuda_manual_seed(1234)
    try:
        # A one-layer block (no final norm) runs the layer through the block's recompute path.
        full = recompute == "full"
        module = TransformerBlock(config, post_process=False) if full \
            else TransformerLayer(config, layer_spec_from_config(config).submodules, layer_number=1)
        module.train()
        hidden_states = torch.randn(local_seq, micro_batch_size, hidden_size, dtype=dtype,
                                    requires_grad=True)  # [s, b, h] ([s/t, b, h] with SP)
        mask = get_causal_attention_mask(seq_length)  # [1, 1, s, s]
        if cp > 1:  # this CP rank's query rows of it: [1, 1, s/N, s], as get_batch_on_this_cp_rank cuts it
            mask = split_for_cp_rank(mask, 2, cp, parallel_state.get_context_parallel_rank())
        # RoPE's angles, like the mask, are made once per model and shared by its layers.
        freqs = None
        if llama_query_groups is not None:  # [s/cp, 1, 1, hn]: the angles of this CP rank's positions
            freqs = split_for_cp_rank(RotaryEmbedding(config.kv_channels)(seq_length), 0, cp,
                                      parallel_state.get_context_parallel_rank())
        exclude = list(module.parameters()) + [mask] + ([freqs] if freqs is not None else [])
        if full:
            return saved_tensor_bytes(lambda x: module(x, mask, rotary_pos_emb=freqs), hidden_states,
                                      exclude=exclude, records=records)
        return saved_tensor_bytes(lambda x: module(x, mask, True, rotary_pos_emb=freqs), hidden_states,
                                  exclude=exclude, records=records)
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


def llama_activation_bytes(seq_length: int, micro_batch_size: int, hidden_size: int, num_attention_heads: int,
                           num_query_groups: int, tensor_parallel_size: int = 1, sequence_parallel: bool = False,
                           recompute: str | None = None, distribute_saved_activations: bool = False,
                           fused: bool = True) -> int:
    """Exact bytes per layer on one TP rank of the Llama-style layer that measure_layer_activation_bytes
    builds with llama_query_groups (bf16, dropout on; docs/memory.md goes term by term). hn = h / a,
    f = llama_ffn_hidden_size(h), g key/value groups. fused (the defaults): fused_kernels.rotary_pos_emb
    keeps only the shared angles and bias_swiglu only its input; unfused, RoPE keeps cos and sin and
    SwiGLU also silu(gate)."""
    s, b, h, a, g, t = (seq_length, micro_batch_size, hidden_size, num_attention_heads, num_query_groups,
                        tensor_parallel_size)
    if recompute == "full":
        return 2 * s * b * h // (t if sequence_parallel or distribute_saved_activations else 1)
    hn, f = h // a, llama_ffn_hidden_size(h)
    heads, groups = a // t, max(1, g // t)  # this rank's query heads and K/V groups (replicated if g < t)
    local = s // t if sequence_parallel else s  # tokens of the norms, residual dropouts, QKV/fc1 inputs
    # two RMSNorm inputs + their fp32 1/rms, the QKV and fc1 inputs (norm outputs), two 1-byte masks
    replicated = local * b * (2 * 2 * h + 2 * 4 + 2 * 2 * h + 2 * h)
    qkv_storage = 2 * s * b * (heads + 2 * groups) * hn  # the QKV output [s, b, (np/t + 2 ng/t) hn]
    rope = 0 if fused else 4 * 4 * s * hn  # unfused, the rotation keeps cos and sin (fp32 [s, 1, 1, hn]) for q and k
    query = 2 * s * b * heads * hn  # rotated q
    if recompute == "selective":
        # the checkpoint keeps its inputs: q, k (rotated, ng/t groups) and v, a view of the QKV output
        core = query + 2 * s * b * groups * hn + qkv_storage
    else:
        # QK^T and x V keep q, k and v with k, v repeated to np/t heads (a copy when ng < np, else v
        # is a view of the QKV output); softmax output, dropout mask and output: 5 a s^2 b / t
        values = 2 * s * b * heads * hn if groups < heads else qkv_storage
        core = query + 2 * s * b * heads * hn + values + 5 * heads * s * s * b
    projection_input = 2 * s * b * heads * hn
    # fc1 output [s, b, 2f/t] and fc2's input silu(gate) * up [s, b, f/t]; unfused also silu(gate)
    mlp = (6 if fused else 8) * s * b * f // t
    return replicated + rope + core + projection_input + mlp
