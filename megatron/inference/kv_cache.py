"""The paged key/value cache of the serving engine: fixed-size blocks, block tables, prefix sharing.

| object | holds |
|---|---|
| BlockPool | num_blocks block ids, a reference count each, the free list, the prefix cache (chain key -> block) |
| PagedContext | per self-attention layer two tensors [ng/t, num_blocks * block_size, hn] (K and V, one row per token slot and group), and the current step's layout |

A request owns a list of blocks (its block table): token position p of the request lives in slot
table[p // block_size] * block_size + p % block_size of every layer's K and V. Long and short
requests share one pool without padding to the longest; a block is the unit of allocation.

A step runs T tokens packed into one sequence [1, T] (Megatron-Core's dynamic engine packs them
the same way): for each of the step's B requests its next chunk (one token when it decodes, up to
the step's token budget when it prefills). Every self-attention layer writes the chunk's K/V into
the request's slots and runs the layer's own core attention in groups: the decoding requests
together (queries [1, B_d, np/t, hn] over their blocks gathered, in one index_select, into
[B_d, ng/t, nb * block_size, hn], padded to the longest: the layout the core attention reads in
place), each prefill chunk alone (queries [q, 1, np/t, hn]), with a mask
that hides the positions after each query (causal) and past each request's length (and, for an
ALiBi model, the bias -slope x (query position - key position) of each request's own positions). The outputs
go back to the packed order [T, 1, np/t * hn]. The model code is the one generate_tokens runs: the context
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
        self._indices: dict = {}
        self.alibi_slopes: torch.Tensor | None = None  # [np/t]: set by an ALiBi model's forward

    def set_step(self, chunks: Sequence[tuple[int, int, Sequence[int]]], device: torch.device) -> None:
        """chunks: per request of the step (start, length, block table): the step runs its positions
        [start, start + length), and attends over [0, start + length).

        The attention runs in groups: the one-token chunks (decoding requests) together, one query
        each, their keys padded to the longest of them; each longer chunk (a prefill) alone, so a
        prefill's queries are not padded out to the whole batch and no decoder's to the prefill's."""
        bs = self.block_size
        starts = torch.tensor([c[0] for c in chunks], dtype=torch.int64)
        lengths = torch.tensor([c[1] for c in chunks], dtype=torch.int64)
        request = torch.repeat_interleave(torch.arange(len(chunks)), lengths)  # [T]: the request of each token
        first = lengths.cumsum(0) - lengths  # [B]: each chunk's first token in the packed step
        row = torch.arange(int(lengths.sum())) - first[request]  # [T]: its place in the chunk
        positions = starts[request] + row  # [T]
        tables = [torch.tensor(list(c[2][:(c[0] + c[1] + bs - 1) // bs]), dtype=torch.int64) for c in chunks]
        slots = torch.cat([tables[i][torch.arange(c[0], c[0] + c[1]) // bs] for i, c in enumerate(chunks)]) * bs \
            + positions % bs  # [T]: chunks are consecutive in the packed order
        decoding = [i for i, c in enumerate(chunks) if c[1] == 1]
        groups = [decoding] if decoding else []
        groups += [[i] for i, c in enumerate(chunks) if c[1] > 1]
        self.groups, self._query_positions = [], []
        for members in groups:
            nb = max(len(tables[i]) for i in members)
            table = torch.zeros(len(members), nb, dtype=torch.int64)  # padding points at block 0, masked out
            for j, i in enumerate(members):
                table[j, :len(tables[i])] = tables[i]
            q = int(lengths[members[0]])  # 1 for the decoders' group
            kv_lengths = (starts + lengths)[members]  # [Bg]
            key = torch.arange(nb * bs)  # [sk]
            query_position = starts[members][:, None] + torch.arange(q)[None, :]  # [Bg, q]
            mask = (key[None, None, :] > query_position[:, :, None]) | (key[None, None, :] >= kv_lengths[:, None, None])
            tokens = first[members] if q == 1 else torch.arange(int(first[members[0]]), int(first[members[0]]) + q)
            self.groups.append((tokens.to(device), table.to(device), mask[:, None].to(device)))  # mask [Bg, 1, q, sk]
            self._query_positions.append(query_position.to(device))
        self._indices: dict = {}  # the groups' gather indices and ALiBi biases, made by the first layer
        self.token_positions = positions.to(device)
        self.slots = slots.to(device)
        self.last_token_index = (lengths.cumsum(0) - 1).to(device)  # [B]

    def attention(self, layer_number: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  core_attention: torch.nn.Module) -> torch.Tensor:
        """query [T, 1, np/t, hn], key and value [T, 1, ng/t, hn] of the packed step -> [T, 1, np/t * hn]."""
        t, _, heads, hn = query.shape
        groups = key.shape[2]
        if layer_number not in self.key_value_memory_dict:
            # [ng/t, slots, hn]: a gather of each head group's slots in (request, group, position)
            # order is the [b, ng, sk, hn] the core attention reads in place. Zeros: a padding slot
            # read under the mask multiplies a probability of 0 (never a NaN).
            shape = (groups, self.num_blocks * self.block_size, hn)
            self.key_value_memory_dict[layer_number] = (key.new_zeros(shape), value.new_zeros(shape))
        key_cache, value_cache = self.key_value_memory_dict[layer_number]
        key_cache.index_copy_(1, self.slots, key[:, 0].transpose(0, 1))  # [ng/t, T, hn] into their slots
        value_cache.index_copy_(1, self.slots, value[:, 0].transpose(0, 1))
        if len(self.groups) == 1 and len(self.groups[0][0]) == t and self.groups[0][2].shape[2] == 1:
            return self._group(query.transpose(0, 1), key_cache, value_cache, 0, core_attention
                               ).transpose(0, 1)  # decoders only: [1, T, np/t hn] -> [T, 1, np/t hn]
        output = query.new_empty(t, 1, heads * hn)
        for index, (tokens, _, mask) in enumerate(self.groups):
            q = query[tokens]  # [Bg, 1, np/t, hn] (decoders) or [q, 1, np/t, hn] (one prefill)
            if mask.shape[2] == 1:
                q = q.transpose(0, 1)  # [1, Bg, np/t, hn]
            context = self._group(q, key_cache, value_cache, index, core_attention)  # [q, Bg, np/t hn]
            output[tokens] = context.transpose(0, 1) if mask.shape[2] == 1 else context
        return output  # [T, 1, np/t * hn]

    def _group(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, index: int,
               core_attention: torch.nn.Module) -> torch.Tensor:
        """Group `index`'s attention: query [q, Bg, np/t, hn] over its requests' blocks -> [q, Bg, np/t * hn]."""
        _, table, mask = self.groups[index]
        groups, slots, hn = key_cache.shape
        b, sk = table.shape[0], table.shape[1] * self.block_size
        rows = self._gather_index(table, groups, slots)  # [Bg ng sk]
        keys = key_cache.view(-1, hn).index_select(0, rows).view(b, groups, sk, hn)  # [Bg, ng/t, sk, hn]
        values = value_cache.view(-1, hn).index_select(0, rows).view(b, groups, sk, hn)
        # [sk, Bg, ng/t, hn] views of them, as the core attention takes keys and values
        return core_attention(query, keys.permute(2, 0, 1, 3), values.permute(2, 0, 1, 3), mask, False,
                              self._alibi_bias(index, sk))

    def _alibi_bias(self, index: int, sk: int) -> torch.Tensor | None:
        """Group `index`'s ALiBi bias (None without ALiBi), fp32 [Bg, np/t, 1, sk] for the decoders
        (one query per request) or [1, np/t, q, sk] for a prefill chunk: -slope x (query position - key
        position), 0 for keys after the query (masked anyway); kept for the step's other layers."""
        if self.alibi_slopes is None:
            return None
        bias = self._indices.get(("alibi", index))
        if bias is None:
            positions = self._query_positions[index]  # [Bg, q]
            key = torch.arange(sk, device=positions.device)
            distance = (positions[:, :, None] - key[None, None, :]).clamp(min=0).float()  # [Bg, q, sk]
            bias = -self.alibi_slopes.to(positions.device)[None, :, None, None] * distance[:, None]  # [Bg, np/t, q, sk]
            self._indices[("alibi", index)] = bias
        return bias

    def _gather_index(self, table: torch.Tensor, groups: int, slots: int) -> torch.Tensor:
        """Rows of the [ng/t x slots, hn] cache of a group's requests, in [Bg, ng/t, sk] order (kept per step)."""
        cached = self._indices.get(id(table))
        if cached is None:
            bs = self.block_size
            positions = (table[:, :, None] * bs + torch.arange(bs, device=table.device)).flatten(1)  # [Bg, sk]
            cached = (torch.arange(groups, device=table.device)[None, :, None] * slots + positions[:, None, :]).flatten()
            self._indices[id(table)] = cached
        return cached

    def last_token_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, 1, h] -> [1, B, h]: each request's last token of the step."""
        return hidden_states[self.last_token_index].transpose(0, 1)  # [B, 1, h] -> [1, B, h]

    def rotary_freqs(self, rotary_pos_emb: torch.nn.Module, device: torch.device) -> torch.Tensor:
        """RoPE's angles [T, 1, 1, rot] of the step's token positions."""
        return rotary_pos_emb(self.max_sequence_length, 0).to(device)[self.token_positions]
