"""Mamba context parallelism ("all-to-all", Megatron-Core's scheme): the CP ranks split the heads, not the sequence.

A scan is sequential along the sequence, so it cannot run on the load-balanced chunks a CP rank holds
(megatron/core/context_parallel.py: chunks r and 2N-1-r of 2N). Around the conv + scan the mixer
trades the sequence split for a head split:

    in_proj   [s/N, b, P/t]        this CP rank's tokens, this TP rank's heads (P: the in_proj rows)
    a2a       x, B, C, dt          -> [s, b, (ch + nh)/(t N)]: every token, the CP rank's share of the
                                   TP rank's heads and groups (head block j of N to CP rank j)
    reorder                        rank-chunk order -> position order (the load balancing undone)
    conv, scan                     on the whole sequence with the CP rank's conv channels, dt_bias,
                                   A_log and D (slices of the TP rank's parameters; no new parameters)
    reorder, a2a  y                [s, b, d_in/(t N)] -> [s/N, b, d_in/t], back in rank-chunk order
    gated norm, out_proj           on the CP rank's tokens, as without CP

z (the gate) never travels: the gated RMSNorm normalises each token's groups, so it runs after the
return trip on the tokens this rank holds, with z as in_proj made it. (Megatron-Core sends z there and
back too; the result is the same.) Both exchanges are heads_to_sequence / sequence_to_heads of
core/context_parallel.py: autograd-aware (each is the other's backward) and counted by
communication.py as "all_to_all" on the "cp" group.

Needs nh/t and ng/t divisible by N (mamba_dims refuses other sizes): a CP rank owns whole groups,
so its heads read only its B and C. The slices' gradients are the whole gradient of those channels
(every token went through them on this rank); the other ranks' are 0 there, and the gradient
reduction over DP x CP sums them, as it does the attention's per-token gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.context_parallel import cp_positions, heads_to_sequence, sequence_to_heads


def _position_order(seq_length: int, cp_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the permutation putting the CP ranks' concatenated tokens in position order, its inverse)."""
    held = torch.cat([cp_positions(seq_length, cp_size, r, device) for r in range(cp_size)])  # [s]
    order = torch.argsort(held)
    return order, torch.argsort(order)


class MambaContextParallel:
    """The two exchanges of one mixer and the CP rank's slices of its per-channel parameters.

    part_sizes: the TP rank's sizes of the exchanged parts of in_proj's output, (d_in/t, ng n/t, ng n/t,
    nh/t) for x, B, C and dt; each is split evenly over the N CP ranks."""

    def __init__(self, group: dist.ProcessGroup, cp_size: int, cp_rank: int, part_sizes: tuple[int, ...]) -> None:
        self.group, self.size, self.rank = group, cp_size, cp_rank
        self.part_sizes = part_sizes
        self.local_sizes = tuple(size // cp_size for size in part_sizes)

    def to_heads(self, xbc: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """xbc [s/N, b, ch/t], dt [s/N, b, nh/t] (this CP rank's tokens) -> xbc [s, b, ch/(t N)],
        dt [s, b, nh/(t N)]: every token in position order, this CP rank's heads and groups."""
        s_local, b = xbc.shape[:2]
        n = self.size
        parts = (*torch.split(xbc, self.part_sizes[:3], dim=-1), dt)  # x, B, C, dt
        # each part [s/N, b, c] -> [s/N, b, N, c/N]; packed along the last dim: one exchange for all four
        packed = torch.cat([part.reshape(s_local, b, n, part.shape[-1] // n) for part in parts], dim=-1)
        gathered = heads_to_sequence(packed, self.group)  # [N s/N, b, 1, W]: rank j's tokens j-th
        order, _ = _position_order(s_local * n, n, xbc.device)
        gathered = gathered.squeeze(2).index_select(0, order)  # [s, b, W], position order
        x, B, C, dt_local = torch.split(gathered, self.local_sizes, dim=-1)
        return torch.cat((x, B, C), dim=-1), dt_local

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """y [s, b, d_in/(t N)] in position order -> [s/N, b, d_in/t]: this CP rank's tokens, every
        head of the TP rank (the inverse of to_heads for the scan's output)."""
        s, b, width = y.shape
        _, inverse = _position_order(s, self.size, y.device)
        y = y.index_select(0, inverse).unsqueeze(2)  # [s, b, 1, d_in/(t N)], rank-chunk order
        return sequence_to_heads(y, self.group).reshape(s // self.size, b, self.size * width)  # [s/N, b, d_in/t]

    def conv_slice(self, param: torch.Tensor) -> torch.Tensor:
        """This CP rank's channels of a conv1d parameter [ch/t, ...]: its x, B and C slices."""
        pieces, start = [], 0
        for size, local in zip(self.part_sizes[:3], self.local_sizes[:3]):
            pieces.append(param.narrow(0, start + self.rank * local, local))
            start += size
        return torch.cat(pieces)

    def head_slice(self, param: torch.Tensor) -> torch.Tensor:
        """This CP rank's heads of a per-head parameter [nh/t] (dt_bias, A_log, D)."""
        local = self.local_sizes[3]
        return param.narrow(0, self.rank * local, local)
