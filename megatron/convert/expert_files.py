"""Where the experts of an MoE model live in our classic (`--ckpt-format torch`) per-rank files.

    iter_*/mp_rank_TT[_PPP]_EEE/model_optim_rng.pt     (Megatron's naming: _EEE only when EP > 1)

    file (TP rank t, stage p, EP rank e) holds      as
    the dense tensors of stage p                    TP shard t (the same in every e's file)
    ...mlp.router.*                                 whole (replicated)
    experts e * E/EP ... (e + 1) * E/EP - 1         local_experts.{0 .. E/EP - 1}, each cut for the
                                                    expert-tensor-parallel rank t % ETP over ETP

E experts (args.num_experts), EP = args.expert_model_parallel_size, ETP =
args.expert_tensor_parallel_size (None: the TP size, Megatron's default). The file of a rank is
named by its dense TP rank and its EP rank, as Megatron's get_checkpoint_name names it; a process
with TP rank t has expert-TP rank t % ETP when ETP divides TP (Megatron's rank order: the expert
grid's ETP ranks are the first ETP of the TP ranks). So this format needs ETP to divide TP;
other ETP sizes are for the torch_dist format (megatron/dist_checkpointing), where experts are
global tensors.

The converter's stream names experts globally (local_experts.{global}), as a TP = 1, EP = 1 model's
state dict does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List

from megatron.convert.layout_rules import expert_key, renumber_expert


@dataclass(frozen=True)
class ExpertGrid:
    experts: int  # E, 0 for a dense model
    ep: int
    etp: int
    tp: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> "ExpertGrid":
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        experts = int(getattr(args, "num_experts", None) or 0)
        ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
        etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
        return cls(experts, ep, etp, tp)

    @property
    def per_rank(self) -> int:
        return self.experts // self.ep if self.experts else 0

    def global_name(self, name: str, ep_rank: int) -> str:
        """A file's local expert name (EP rank ep_rank) -> the stream's global one."""
        return renumber_expert(name, ep_rank * self.per_rank + expert_key(name)[1])

    def place(self, name: str) -> tuple:
        """A stream's global expert name -> (EP rank, its local name)."""
        index = expert_key(name)[1]
        return index // self.per_rank, renumber_expert(name, index % self.per_rank)

    def problems(self, ffn: int) -> List[str]:
        """Why this grid cannot be written as classic files (empty: it can)."""
        out = []
        if self.ep < 1 or self.etp < 1:
            return ["expert parallel sizes must be >= 1"]
        if not self.experts:
            if self.ep > 1 or self.etp != self.tp:
                out.append("expert parallelism needs an MoE model (--num-experts)")
            return out
        if self.experts % self.ep:
            out.append(f"{self.experts} experts do not split over {self.ep} EP ranks")
        if ffn % self.etp:
            out.append(f"the expert ffn hidden size {ffn} does not split over {self.etp} expert-TP ranks")
        if self.tp % self.etp:
            out.append(f"expert-tensor-parallel size {self.etp} does not divide the TP size {self.tp}: the "
                       "classic per-rank files cannot hold it (use --ckpt-format torch_dist)")
        return out


def is_expert(name: str) -> bool:
    return expert_key(name) is not None
