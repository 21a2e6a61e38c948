"""Packed sequences: several documents (SFT conversations) in one row, none attending to another.

PackedSeqParams carries the documents' boundaries as the SFT batch gives them (Megatron-LM's
`cu_seqlens` key): per row b, cu_seqlens[b] = [0, e1, ..., s, s, ...], the cumulative lengths
padded with s to s + 1 entries. From them the model takes, for a row of s tokens:

    segment_ids(s)     [b, s]        the document of each token
    positions(s)       [b, s]        each token's position in its document (0 at each start)
    attention_mask(s)  [b, 1, s, s]  bool, True = masked: a query sees the keys of its own
                                     document up to itself (a per-document causal mask)

GPTModel.forward(..., packed_seq_params=...) hands the mask to every attention core (the CPU
fused core, the unfused path and SDPA all take a bool mask) and rotates q and k by each
token's own position (RoPE restarts per document). Every pipeline stage gets the boundaries
(the SFT recipe reads the batch on every stage), so a stage needs no activations but its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedSeqParams:
    """cu_seqlens: int [b, s + 1] (or [s + 1] for one row), each row's document boundaries."""

    cu_seqlens: torch.Tensor

    def _rows(self) -> torch.Tensor:
        cu = self.cu_seqlens.to(torch.int64)
        return cu[None] if cu.dim() == 1 else cu  # [b, s + 1]

    def segment_ids(self, s: int) -> torch.Tensor:
        """[b, s] int64: the document index of each token."""
        cu = self._rows()
        tokens = torch.arange(s, device=cu.device).expand(cu.shape[0], s).contiguous()
        return torch.searchsorted(cu, tokens, right=True) - 1

    def positions(self, s: int) -> torch.Tensor:
        """[b, s] int64: the position of each token in its document."""
        cu = self._rows()
        starts = torch.gather(cu, 1, self.segment_ids(s))
        return torch.arange(s, device=cu.device)[None, :] - starts

    def attention_mask(self, s: int, device: torch.device | None = None) -> torch.Tensor:
        """[b, 1, s, s] bool, True = masked: causal within each document, nothing across documents."""
        segments = self.segment_ids(s).to(device)  # [b, s]
        other_document = segments[:, :, None] != segments[:, None, :]  # [b, sq, sk]
        future = torch.ones(s, s, dtype=torch.bool, device=device).triu_(1)  # [sq, sk]
        return (other_document | future)[:, None]  # [b, 1, s, s]
