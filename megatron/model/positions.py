"""Position information that is not an embedding table: rotary embeddings (RoPE) and ALiBi.

RotaryEmbedding (Su et al. 2021; Megatron-Core's, with its flags) gives, for positions
offset .. offset + s - 1, the angles freqs [s, 1, 1, rot_dim] in fp32 that apply_rotary_pos_emb
turns into a rotation of the first rot_dim = kv_channels * rotary_percent channels of each
query and key head (the rest pass through: GPT-NeoX's partial rotary):

    inv_freq[i] = rotary_base ** (-2i / rot_dim),  i < rot_dim / 2
    angle[p, i] = (p / seq_len_interpolation_factor) * inv_freq[i]
    freqs       = cat(angle, angle)               (rotate_half pairs channel i with i + rot_dim/2)
                  or each angle twice in a row    (rotary_interleaved: pairs 2i, 2i + 1)

rope_scaling (--use-rope-scaling) rescales inv_freq as Llama 3.1 does: wavelengths longer than
original_max_position / low_freq_factor are divided by rope_scaling_factor, shorter than
original_max_position / high_freq_factor kept, and those between interpolated smoothly.

ALiBi (Press et al. 2022, "Train Short, Test Long"): no position embedding; head n adds
-slope_n * (i - j) to the score of query i and key j. The slopes are the paper's geometric
sequence, 2 ** (-8 k / n_heads) for k = 1 .. n_heads when n_heads is a power of two, and
otherwise those of the next lower power of two followed by every other slope of the next
higher one. Each tensor-parallel rank adds the bias of its own heads.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.nn import functional as F

from megatron import fused_kernels
from megatron.fused_kernels import backend


class RotaryEmbedding(nn.Module):
    """forward(seq_len, offset=0) -> freqs [seq_len, 1, 1, rot_dim], fp32 (no parameters, no state)."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: float | None = None, rotary_base: float = 10000,
                 rope_scaling: bool = False, rope_scaling_factor: float = 8.0) -> None:
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        if dim <= 0 or dim % 2:
            raise ValueError(f"rotary dimension kv_channels x rotary_percent = {kv_channels} x {rotary_percent} "
                             f"= {dim} must be a positive even number")
        self.dim = dim
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if rope_scaling:
            inv_freq = llama3_scaled_inv_freq(inv_freq, rope_scaling_factor)
        self.inv_freq = inv_freq.float()  # [dim/2]; a plain attribute, as Megatron-Core's (not in the state dict)
        self._last: tuple[tuple[int, int], torch.Tensor] | None = None  # every step asks for the same angles

    def forward(self, seq_len: int, offset: int = 0) -> torch.Tensor:
        if self._last is None or self._last[0] != (seq_len, offset):
            self._last = ((seq_len, offset), self._angles(seq_len, offset))
        return self._last[1]

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """freqs [s, b, 1, rot_dim] fp32 for per-token positions [b, s] (packed sequences, whose
        positions restart at each document); apply_rotary_pos_emb takes them unfused."""
        return self._angles_of(positions.t().float())[:, :, None, :]  # [s, b, 1, dim]

    def _angles(self, seq_len: int, offset: int) -> torch.Tensor:
        positions = torch.arange(offset, offset + seq_len, dtype=torch.float32)
        return self._angles_of(positions)[:, None, None, :]  # [s, 1, 1, dim]

    def _angles_of(self, positions: torch.Tensor) -> torch.Tensor:
        """[..., dim] angles of fp32 positions [...]."""
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        angles = positions[..., None] * self.inv_freq.to(positions.device)  # [..., dim/2]
        if self.rotary_interleaved:
            return angles.repeat_interleave(2, dim=-1)  # [..., dim]: a0 a0 a1 a1 ...
        return torch.cat((angles, angles), dim=-1)  # [..., dim]: a0 a1 ... a0 a1 ...


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float = 8.0, low_freq_factor: float = 1.0,
                           high_freq_factor: float = 4.0, original_max_position: int = 8192) -> torch.Tensor:
    """Llama 3.1's frequency scaling of inv_freq (Megatron-Core's defaults for the other constants)."""
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = original_max_position / low_freq_factor
    high_freq_wavelength = original_max_position / high_freq_factor
    smooth = (original_max_position / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    between = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(between, interpolated, scaled)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config) -> torch.Tensor:
    """Rotate the first rot_dim channels of t [s, b, heads, hn] by freqs [s, 1, 1, rot_dim]
    (or [s, b, 1, rot_dim]: per-token positions of packed sequences).

    config.apply_rope_fusion: fused_kernels.rotary_pos_emb; otherwise, and for per-row freqs
    (which the fused kernels do not take), the formula in PyTorch ops (cos and sin in fp32, the
    result in t's dtype), Megatron-Core's unfused path.
    """
    if config.apply_rope_fusion and freqs.shape[1] == 1:
        return fused_kernels.rotary_pos_emb(t, freqs, interleaved=config.rotary_interleaved,
                                            impl=backend.implementation(config.fused_kernels_cpu_impl, t))
    rot_dim = freqs.shape[-1]
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = freqs.cos(), freqs.sin()
    rotated = (rotated.float() * cos + _rotate_half(rotated.float(), config.rotary_interleaved) * sin).to(t.dtype)
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """[num_heads] fp32: the ALiBi paper's slopes (see the module docstring)."""

    def power_of_two_slopes(n: int) -> list[float]:
        return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]

    lower = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two_slopes(lower)
    if lower < num_heads:
        slopes += power_of_two_slopes(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(nn.Module):
    """forward(sq, sk) -> the additive bias [1, local heads, sq, sk] (fp32) of this rank's heads
    first_head .. first_head + local_heads - 1: -slope * (i - j) for query i, key j (the last sq
    of sk positions; keys after the query are masked anyway)."""

    def __init__(self, num_heads: int, first_head: int = 0, local_heads: int | None = None) -> None:
        super().__init__()
        local_heads = num_heads if local_heads is None else local_heads
        self.slopes = alibi_slopes(num_heads)[first_head:first_head + local_heads]  # [heads/t]

    def forward(self, sq: int, sk: int) -> torch.Tensor:
        return _alibi_bias(tuple(self.slopes.tolist()), sq, sk)


@functools.lru_cache(maxsize=8)
def _alibi_bias(slopes: tuple[float, ...], sq: int, sk: int) -> torch.Tensor:
    query = torch.arange(sk - sq, sk, dtype=torch.float32)[:, None]
    key = torch.arange(sk, dtype=torch.float32)[None, :]
    distance = (query - key).clamp(min=0)  # [sq, sk]
    return -torch.tensor(slopes)[None, :, None, None] * distance  # [1, heads, sq, sk]


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int = 32,
                             max_distance: int = 128) -> torch.Tensor:
    """T5's bucket of each relative position (key - query), long, same shape (Raffel et al. 2020).

    Bidirectional (the encoder): half the buckets for keys after the query, half for keys before.
    Unidirectional (the decoder): keys after the query share bucket 0 (they are masked anyway).
    Of a direction's n buckets the first n/2 are the exact distances 0 .. n/2 - 1, the rest
    cover n/2 .. max_distance logarithmically; farther distances take the last bucket.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_ratio = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """T5's relative position bias: forward(sq, sk) -> [1, local heads, sq, sk] in the table's dtype.

    Key: relative_attention_bias.weight [num_buckets, num_heads] (all heads, replicated over the
    tensor-parallel ranks; a rank adds its heads first_head .. first_head + local_heads - 1, so its
    gradient is partial over the ranks: the weight is marked sequence_parallel, which makes
    finalize_model_grads sum it over the tensor-parallel group, as the q/k layer norms are).
    One per stack, computed once per forward and shared by its layers (HF T5 keeps it in layer 0).
    """

    def __init__(self, num_heads: int, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128,
                 first_head: int = 0, local_heads: int | None = None, dtype: torch.dtype = torch.float32,
                 init_method=None, tensor_parallel: bool = False) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.first_head = first_head
        self.local_heads = num_heads if local_heads is None else local_heads
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads, dtype=dtype)
        if init_method is not None:
            with torch.no_grad():
                init_method(self.relative_attention_bias.weight)
        if tensor_parallel:
            self.relative_attention_bias.weight.sequence_parallel = True

    def forward(self, sq: int, sk: int) -> torch.Tensor:
        device = self.relative_attention_bias.weight.device
        query = torch.arange(sk - sq, sk, dtype=torch.long, device=device)[:, None]  # the last sq of sk positions
        key = torch.arange(sk, dtype=torch.long, device=device)[None, :]
        buckets = relative_position_bucket(key - query, self.bidirectional, self.num_buckets, self.max_distance)
        weight = self.relative_attention_bias.weight[:, self.first_head:self.first_head + self.local_heads]
        values = F.embedding(buckets, weight)  # [sq, sk, heads/t]
        return values.permute(2, 0, 1).unsqueeze(0)  # [1, heads/t, sq, sk]
