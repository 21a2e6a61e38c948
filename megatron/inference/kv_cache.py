"""The paged key/value cache of the serving engine: fixed-size blocks, block tables, prefix sharing.

| object | holds |
|---|---|
| BlockPool | num_blocks block ids, a reference count each, the free list, the prefix cache (chain key -> block) |
| PagedContext | per self-attention layer two tensors [num_blocks * block_size, ng/t, hn] (K and V, one row per token slot), and the current step's layout |

A request owns a list of blocks (its block table): token position p of the request lives in slot
table[p // block_size] * block_size + p % block_size of every layer's K and V. Long and short
requests share one pool without padding to the longest; a block is the unit of allocation.

A step runs T tokens packed into one sequence [1, T] (Megatron-Core's dynamic engine packs them
the same way): for each of the step's B requests its next chunk (one token when it decodes, up to
the step's token budget when it prefills). Every self-attention layer writes the chunk's K/V into
the request's slots, gathers each request's blocks into [B, nb * block_size, ng/t, hn] and runs the
layer's own core attention over it, the queries laid out [max_q, B, np/t, hn] and a mask that hides
the positions after each query (causal) and past each request's length. The output goes back to
the packed order [T, 1, np/t * hn]. The model code is the one generate_tokens runs: the context
takes the place of InferenceContext (its `paged` attribute tells the layers which one they hold).

Prefix caching: a block filled entirely with prompt tokens is registered under a chain key, the
SHA-256 of the previous block's key and the block's token ids, so a key names the whole prefix up to
the block's end. A new request looks its prompt's full blocks up in order and shares the longest
run found (reference counted); its prefill starts after them. The last prompt token always runs (its
logits choose the first token), so at most (prompt_len - 1) // block_size blocks are shared and a
shared block is never written. With eviction policy "ref_zero" (Megatron's default) a block leaves
the cache when its last user releases it; with "lru" it stays cached while unused and is taken back,
least recently used first, only when the free list is empty.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import torch

EVICTION_POLICIES = ("ref_zero", "lru")


def chain_keys(tokens: Sequence[int], block_size: int, blocks: int) -> list[bytes]:
    """The prefix-cache keys of the first `blocks` full blocks of tokens."""
    keys, previous = [], b""
    for j in range(blocks):
        chunk = ",".join(str(t) for t in tokens[j * block_size:(j + 1) * block_size]).encode()
        previous = hashlib.sha256(previous + b"|" + chunk).digest()
        keys.append(previous)
    return keys


class BlockPool:
    """Block ids 0 .. num_blocks - 1: reference counts, a free list and the prefix cache."""

    def __init__(self, num_blocks: int, eviction_policy: str = "ref_zero") -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction policy must be one of {EVICTION_POLICIES}, got {eviction_policy!r}")
        self.num_blocks = num_blocks
        self.eviction_policy = eviction_policy
        self.refcount = [0] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.cached: dict[bytes, int] = {}  # chain key -> block
        self.key_of: dict[int, bytes] = {}  # block -> chain key
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused blocks (lru), oldest first
        self.lookups = 0  # prefix blocks looked up by admitted requests (the engine counts)
        self.hits = 0  # of which found in the cache

    def available(self) -> int:
        """Blocks an allocation can take now (free, or cached and unused)."""
        return len(self.free) + len(self.evictable)

    def in_use(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self.available()

    def allocate(self, n: int) -> list[int]:
        if n > self.available():
            raise RuntimeError(f"asked for {n} KV blocks with {self.available()} available")  # the engine checks first
        blocks = []
        for _ in range(n):
            if self.free:
                block = self.free.pop()
            else:  # lru: take back the least recently used cached block
                block, _ = self.evictable.popitem(last=False)
                del self.cached[self.key_of.pop(block)]
            self.refcount[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.refcount[block] -= 1
            if self.refcount[block] > 0:
                continue
            if block in self.key_of and self.eviction_policy == "lru":
                self.evictable[block] = None
                continue
            if block in self.key_of:
                del self.cached[self.key_of.pop(block)]
            self.free.append(block)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of keys from the first, each now referenced once more."""
        found = []
        for key in keys:
            block = self.cached.get(key)
            if block is None:
                break
            found.append(block)
        for block in found:
            self.refcount[block] += 1
            self.evictable.pop(block, None)
        return found

    def register(self, key: bytes, block: int) -> None:
        """Offer a full prompt block to the prefix cache (a key already cached keeps its block)."""
        if key not in self.cached and block not in self.key_of:
            self.cached[key] = block
            self.key_of[block] = key


class PagedContext:
    """The inference context of the engine's steps (see the module docstring).

    The engine calls set_step() before each forward; the model's layers call attention(), GPTModel
    reads token_positions (RoPE) and last_token_hidden() (the logits of each request's last token)."""

    paged = True
    materialize_only_last_token_logits = True

    def __init__(self, num_blocks: int, block_size: int, max_sequence_length: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_sequence_length = max_sequence_length
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.token_positions: torch.Tensor | None = None

    def set_step(self, chunks: Sequence[tuple[int, int, Sequence[int]]], device: torch.device) -> None:
        """chunks: per request of the step (start, length, block table): the step runs its positions
        [start, start + length), and attends over [0, start + length)."""
        bs = self.block_size
        starts = torch.tensor([c[0] for c in chunks], dtype=torch.int64)
        lengths = torch.tensor([c[1] for c in chunks], dtype=torch.int64)
        b, max_q = len(chunks), int(lengths.max())
        request = torch.repeat_interleave(torch.arange(b), lengths)  # [T]: the request of each token
        row = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)  # [T]
        positions = starts[request] + row  # [T]
        kv_lengths = starts + lengths  # [B]
        nb = int((kv_lengths.max() + bs - 1) // bs)
        tables = torch.zeros(b, nb, dtype=torch.int64)  # padding points at block 0, masked out
        for i, (_, _, table) in enumerate(chunks):
            used = min(len(table), nb)
            tables[i, :used] = torch.tensor(list(table[:used]), dtype=torch.int64)
        slots = tables[request, positions // bs] * bs + positions % bs  # [T]
        key = torch.arange(nb * bs)  # [sk]
        query_position = starts[:, None] + torch.arange(max_q)[None, :]  # [B, max_q]; padded rows see their prefix
        mask = (key[None, None, :] > query_position[:, :, None]) | (key[None, None, :] >= kv_lengths[:, None, None])
        self.decode_only = max_q == 1
        self.token_positions = positions.to(device)
        self.slots = slots.to(device)
        self.tables = tables.to(device)
        self.request, self.row = request.to(device), row.to(device)
        self.max_q, self.batch = max_q, b
        self.mask = mask[:, None].to(device)  # [B, 1, max_q, sk], True = masked out
        self.last_token_index = (lengths.cumsum(0) - 1).to(device)  # [B]

    def attention(self, layer_number: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  core_attention: torch.nn.Module) -> torch.Tensor:
        """query [T, 1, np/t, hn], key and value [T, 1, ng/t, hn] of the packed step -> [T, 1, np/t * hn]."""
        t, _, heads, hn = query.shape
        groups = key.shape[2]
        if layer_number not in self.key_value_memory_dict:
            # Zeros: a padding slot read under the mask multiplies a probability of 0 (never a NaN).
            shape = (self.num_blocks * self.block_size, groups, hn)
            self.key_value_memory_dict[layer_number] = (key.new_zeros(shape), value.new_zeros(shape))
        key_cache, value_cache = self.key_value_memory_dict[layer_number]
        key_cache.index_copy_(0, self.slots, key[:, 0])  # [T, ng/t, hn] into their slots
        value_cache.index_copy_(0, self.slots, value[:, 0])
        b, nb, bs = self.batch, self.tables.shape[1], self.block_size
        keys = key_cache.view(self.num_blocks, bs, groups, hn)[self.tables]  # [B, nb, bs, ng/t, hn]
        values = value_cache.view(self.num_blocks, bs, groups, hn)[self.tables]
        keys = keys.view(b, nb * bs, groups, hn).transpose(0, 1)  # [sk, B, ng/t, hn]
        values = values.view(b, nb * bs, groups, hn).transpose(0, 1)
        if self.decode_only:  # T == B: one query per request
            queries = query.transpose(0, 1)  # [T, 1, np/t, hn] -> [1, B, np/t, hn]
        else:
            queries = query.new_zeros(self.max_q, b, heads, hn)  # [max_q, B, np/t, hn]
            queries[self.row, self.request] = query[:, 0]
        context = core_attention(queries, keys, values, self.mask, False, None)  # [max_q, B, np/t * hn]
        if self.decode_only:
            return context.transpose(0, 1)  # [1, B, np/t hn] -> [T, 1, np/t hn]
        return context[self.row, self.request].unsqueeze(1)  # [T, 1, np/t * hn]

    def last_token_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, 1, h] -> [1, B, h]: each request's last token of the step."""
        return hidden_states[self.last_token_index].transpose(0, 1)  # [B, 1, h] -> [1, B, h]

    def rotary_freqs(self, rotary_pos_emb: torch.nn.Module, device: torch.device) -> torch.Tensor:
        """RoPE's angles [T, 1, 1, rot] of the step's token positions."""
        return rotary_pos_emb(self.max_sequence_length, 0).to(device)[self.token_positions]
