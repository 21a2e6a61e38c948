"""InferenceContext: the key/value cache of incremental decoding (Megatron-Core's InferenceParams).

Mamba layers (megatron/model/mamba/) keep instead a fixed-size state per layer, mamba_state_dict
(mamba_states): the last k-1 inputs of the causal convolution and the SSM state, updated in place by
every forward with the context; a one-token step costs the same at every position.

Each self-attention layer keeps the keys and values of the tokens seen so far, after RoPE, in a
preallocated buffer per layer (this rank's query groups only):

    key_value_memory_dict[layer_number] = (key [max_b, ng/t, hn, max_s], value [max_b, ng/t, max_s, hn])

Batch-major, where Megatron-Core's buffers are [max_s, max_b, ng/t, hn]: the attention multiplies,
per (row, group), the queries by the cached keys transposed and the probabilities by the cached
values, and in this layout each (row, group)'s cached prefix is a plain strided matrix for both
products (K^T as [hn, offset + s], V as [offset + s, hn], with the buffer's row length), so the
batched matmuls read the cache in place; the keys are kept transposed because the bf16 batched
matmul copies a transposed operand. append_key_value hands the prefix back in the model's
[s, b, ng/t, hn] order as a permuted view (no copy).

A forward with a context runs s new tokens at absolute positions offset .. offset + s - 1
(offset = sequence_len_offset): every layer writes their K/V at rows [offset, offset + s) and
batch columns [batch_size_offset, batch_size_offset + b), and attends over rows [0, offset + s).
The caller advances the offset after the forward (increment). A prefill is a forward at offset 0
with s > 1, a decode step one with s = 1. With materialize_only_last_token_logits (Megatron-Core's
name) the model computes the logits of the last of the s positions only: a generation that does not
return the prompt's log-probs needs no others, and the prefill's output layer over all of them is
most of its cost.
"""

from __future__ import annotations

import torch


class InferenceContext:
    """KV cache and sequence offset of one generation (Megatron-Core's InferenceParams names)."""

    paged = False  # the engine's PagedContext (kv_cache.py) says True: the layers then let it attend

    def __init__(self, max_batch_size: int, max_sequence_length: int,
                 materialize_only_last_token_logits: bool = False) -> None:
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(f"max_batch_size ({max_batch_size}) and max_sequence_length "
                             f"({max_sequence_length}) must be positive")
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.materialize_only_last_token_logits = materialize_only_last_token_logits
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Mamba layers: (conv state [max_b, ch/t, k-1], SSM state [max_b, nh/t, hd, n] fp32) per layer.
        self.mamba_state_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def mamba_states(self, layer_number: int, b: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int],
                     dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's rows of a Mamba layer's states (views the layer updates in place): the conv state,
        the last k-1 inputs of its convolution [b, ch/t, k-1], and the SSM state [b, nh/t, hd, n] (fp32).
        A forward at offset 0 starts a sequence: the rows are zeroed first. Unlike the key/value cache the
        states do not grow with the sequence: one token per step costs the same at every position."""
        first, last = self.batch_size_offset, self.batch_size_offset + b
        if last > self.max_batch_size:
            raise ValueError(f"the inference context holds {self.max_batch_size} rows; this step needs {last}")
        if layer_number not in self.mamba_state_dict:
            self.mamba_state_dict[layer_number] = (
                torch.zeros(self.max_batch_size, *conv_shape, dtype=dtype, device=device),
                torch.zeros(self.max_batch_size, *ssm_shape, dtype=torch.float32, device=device))
        conv_state, ssm_state = (state[first:last] for state in self.mamba_state_dict[layer_number])
        if self.sequence_len_offset == 0:
            conv_state.zero_()
            ssm_state.zero_()
        return conv_state, ssm_state

    def append_key_value(self, layer_number: int, key: torch.Tensor,
                         value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's key and value [s, b, ng/t, hn] of layer `layer_number` at the offset;
        return the keys and values to attend over, [key_length(s), b, ng/t, hn]: the cached prefix
        (offset + s positions), or the whole buffer (see key_length)."""
        s, b = key.shape[:2]
        start, end = self.sequence_len_offset, self.sequence_len_offset + s
        first, last = self.batch_size_offset, self.batch_size_offset + b
        if end > self.max_sequence_length or last > self.max_batch_size:
            raise ValueError(f"the inference context holds {self.max_sequence_length} positions x "
                             f"{self.max_batch_size} rows; this step needs positions up to {end} and rows up to {last}")
        if layer_number not in self.key_value_memory_dict:
            groups, hn = key.shape[2:]
            b_max, s_max = self.max_batch_size, self.max_sequence_length
            # Zeros: a step that reads the whole buffer (key_length) multiplies its unwritten tail by 0.
            self.key_value_memory_dict[layer_number] = (key.new_zeros(b_max, groups, hn, s_max),  # K^T
                                                        value.new_zeros(b_max, groups, s_max, hn))
        key_cache, value_cache = self.key_value_memory_dict[layer_number]
        key_cache[first:last, :, :, start:end] = key.permute(1, 2, 3, 0)  # [s, b, ng/t, hn] -> [b, ng/t, hn, s]
        value_cache[first:last, :, start:end] = value.permute(1, 2, 0, 3)  # -> [b, ng/t, s, hn]
        length = self.key_length(s)
        keys = key_cache[first:last, :, :, :length].permute(3, 0, 1, 2)  # [key_length, b, ng/t, hn], views
        values = value_cache[first:last, :, :length].permute(2, 0, 1, 3)
        return keys, values

    def key_length(self, s: int) -> int:
        """How many key positions a forward of s new tokens attends over: the offset + s cached ones,
        or, for a one-token step in half precision once the cache is at least half full, the whole
        buffer, its positions past offset + s masked out (causal_mask). The half-precision batched
        matmul copies a strided prefix of the cache on every call; the whole buffer it reads in place,
        and at least half full that costs less than the copy. fp32's reads a strided prefix in place."""
        end = self.sequence_len_offset + s
        if (s == 1 and self.sequence_len_offset > 0 and 2 * end >= self.max_sequence_length
                and self.key_value_memory_dict):  # (a model of Mamba layers only has no key/value cache)
            key_cache, _ = next(iter(self.key_value_memory_dict.values()))  # a decode step: after a prefill
            if key_cache.dtype in (torch.float16, torch.bfloat16):
                return self.max_sequence_length
        return end

    def causal_mask(self, s: int, device: torch.device) -> torch.Tensor:
        """bool [1, 1, s, key_length(s)], True = masked out: query i (position offset + i) sees keys
        0 .. offset + i (and none of the buffer's positions past offset + s)."""
        offset = self.sequence_len_offset
        return torch.ones(s, self.key_length(s), dtype=torch.bool, device=device).triu(offset + 1)[None, None]

    def pad_to_key_length(self, tensor: torch.Tensor, s: int, value: float | bool) -> torch.Tensor:
        """A mask or bias [..., offset + s] of a forward of s tokens, widened to key_length(s)
        positions with `value` (True: masked out; 0: no bias) -- the buffer's positions past offset + s."""
        extra = self.key_length(s) - tensor.shape[-1]
        if extra <= 0:
            return tensor
        return torch.cat([tensor, tensor.new_full((*tensor.shape[:-1], extra), value)], dim=-1)

    def swap_key_value_dict(self, batch_idx: torch.Tensor) -> None:
        """Reorder the cached rows (Megatron-Core's name): row i of every layer's cache becomes the old
        row batch_idx[i] (beam search: each new beam continues a parent beam). Only the first
        len(batch_idx) rows are kept valid."""
        end, n = self.sequence_len_offset, len(batch_idx)
        for key_cache, value_cache in self.key_value_memory_dict.values():
            index = batch_idx.to(key_cache.device)
            key_cache[:n, :, :, :end] = key_cache[..., :end].index_select(0, index)  # [n, ng/t, hn, offset]
            value_cache[:n, :, :end] = value_cache[:, :, :end].index_select(0, index)  # [n, ng/t, offset, hn]
        for states in self.mamba_state_dict.values():
            for state in states:  # [max_b, ...]
                state[:n] = state.index_select(0, batch_idx.to(state.device))

    def increment(self, s: int) -> None:
        """Advance the offset past the s tokens just run."""
        self.sequence_len_offset += s

    def reset(self) -> None:
        """Start over (the buffers are kept and overwritten)."""
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
