"""Token dispatchers: take each token to the ranks holding its experts and bring the results back.

Each rank routes its own tokens x [T, h] (under sequence parallelism its s/t of the sequence).
Expert e lives on expert-parallel rank e // (E/EP), split over that rank's expert tensor-parallel
(ETP) group; an expert's output there is a partial sum over the ETP ranks. Both dispatchers
compute, for every token t,

    y[t] = sum over the experts e that t is routed to of probs[t, e] * expert_e(x[t])

and differ in what they move:

    allgather  all-gather x, probs and the routing map over the expert tensor-and-model group
               (ETP x EP ranks); every rank runs its local experts on the tokens routed to them,
               weights the outputs, adds them into a [group tokens, h] buffer, and one
               reduce-scatter over the group sums the experts' contributions and the ETP partial
               sums and hands each rank its own tokens back (megatron-core's MoEAllGatherTokenDispatcher).
    alltoall   sort this rank's (token, expert) pairs by expert and send each one only to the rank
               of its expert (all-to-all over the EP group, counts exchanged first); gather the
               received tokens over the ETP group; run the experts on them grouped by local expert;
               reduce-scatter the partial outputs over ETP, all-to-all them back, weight and add them
               at their tokens (MoEAlltoAllTokenDispatcher). Only the pairs routed off-rank leave the
               rank (communication.all_to_all_single counts exactly those rows).

Every move is one of megatron.core.tensor_parallel's mappings (all_to_all and the dim-0 gather and
reduce-scatter, with unequal row counts where the experts' loads differ) over an expert group: each
is differentiable (its backward is the transposed collective), and every rank
takes part in every collective whatever its tokens: an expert that receives no token on some
rank (a starved expert) runs on zero rows, so the collectives stay in step and its parameters get
a zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def _expert_groups() -> dict[str, tuple[dist.ProcessGroup | None, int, int]]:
    """name -> (group, size, rank) of the expert-parallel, expert tensor-parallel and their product."""
    return {"ep": (parallel_state.get_expert_model_parallel_group(),
                   parallel_state.get_expert_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_rank()),
            "etp": (parallel_state.get_expert_tensor_parallel_group(),
                    parallel_state.get_expert_tensor_parallel_world_size(),
                    parallel_state.get_expert_tensor_parallel_rank()),
            "etp-ep": (parallel_state.get_expert_tensor_and_model_parallel_group(),
                       parallel_state.get_expert_tensor_and_model_parallel_world_size(),
                       parallel_state.get_expert_tensor_and_model_parallel_rank())}


def _pairs(routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, token) of every routed pair, sorted by expert then token."""
    experts, tokens = routing_map.t().nonzero(as_tuple=True)
    return experts, tokens


class AllGatherDispatcher:
    """See the module docstring; run(x, probs, routing_map, experts) -> y [T, h]."""

    def __init__(self, num_experts: int, num_local_experts: int) -> None:
        self.num_experts, self.num_local_experts = num_experts, num_local_experts

    def run(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts) -> torch.Tensor:
        groups = _expert_groups()
        group, size, _ = groups["etp-ep"]
        _, _, ep_rank = groups["ep"]
        if size > 1:
            x = gather_from_sequence_parallel_region(x, group=group)  # [g T, h]; backward reduce-scatters
            probs = gather_from_sequence_parallel_region(probs, group=group)  # [g T, E]
            routing_map = gather_from_sequence_parallel_region(routing_map.to(torch.uint8), group=group).bool()
        first = ep_rank * self.num_local_experts
        local_map = routing_map[:, first:first + self.num_local_experts]
        expert_index, tokens = _pairs(local_map)
        counts = local_map.sum(0).tolist()
        out = experts(x[tokens], counts)  # [N, h], ETP partial sums
        weights = probs[tokens, first + expert_index].to(out.dtype).unsqueeze(-1)
        combined = out.new_zeros(x.shape).index_add(0, tokens, out * weights)  # [g T, h]
        return reduce_scatter_to_sequence_parallel_region(combined, group=group) if size > 1 else combined


class AlltoAllDispatcher:
    """See the module docstring; run(x, probs, routing_map, experts) -> y [T, h]."""

    def __init__(self, num_experts: int, num_local_experts: int) -> None:
        self.num_experts, self.num_local_experts = num_experts, num_local_experts

    def run(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts) -> torch.Tensor:
        groups = _expert_groups()
        ep_group, ep, _ = groups["ep"]
        etp_group, etp, _ = groups["etp"]
        local = self.num_local_experts
        expert_index, tokens = _pairs(routing_map)
        permuted = x[tokens]  # [N, h], grouped by global expert
        counts = routing_map.sum(0).to(torch.int64).reshape(ep, local)  # [ep, E/EP] sent to each rank
        received = all_to_all(ep_group, counts) if ep > 1 else counts  # [ep, E/EP] from each rank
        send_splits, recv_splits = counts.sum(1).tolist(), received.sum(1).tolist()
        if ep > 1:
            dispatched = all_to_all(ep_group, permuted, recv_splits, send_splits)  # [source][local expert]
        else:
            dispatched = permuted
        if etp > 1:  # the ETP ranks hold slices of the same experts: each needs all their tokens
            all_received = gather_from_sequence_parallel_region(
                received.reshape(1, ep, local), group=etp_group)  # [etp, ep, E/EP]
            etp_sizes = all_received.sum((1, 2)).tolist()
            if max(etp_sizes):
                dispatched = gather_from_sequence_parallel_region(dispatched, group=etp_group,
                                                                  output_split_sizes=etp_sizes)
        else:
            all_received = received.reshape(1, ep, local)
        # Chunks arrive as [etp rank][source ep rank][local expert]; the experts want them by expert.
        chunk_sizes = all_received.reshape(-1).tolist()
        by_expert = [c for e in range(local) for c in range(e, len(chunk_sizes), local)]
        chunks = torch.split(dispatched, chunk_sizes)
        sorted_input = torch.cat([chunks[c] for c in by_expert]) if chunks else dispatched
        out = experts(sorted_input, all_received.sum((0, 1)).tolist())  # [M, h], ETP partial sums
        out_chunks = torch.split(out, [chunk_sizes[c] for c in by_expert])
        back = [None] * len(chunk_sizes)
        for position, c in enumerate(by_expert):
            back[c] = out_chunks[position]
        out = torch.cat(back) if back else out
        if etp > 1 and max(etp_sizes):  # this rank's received rows, summed over ETP
            out = reduce_scatter_to_sequence_parallel_region(out, group=etp_group, input_split_sizes=etp_sizes)
        if ep > 1:
            out = all_to_all(ep_group, out, send_splits, recv_splits)  # [N, h] in `permuted`'s order
        weights = probs[tokens, expert_index].to(out.dtype).unsqueeze(-1)
        return out.new_zeros(x.shape).index_add(0, tokens, out * weights)


def build_dispatcher(kind: str, num_experts: int, num_local_experts: int):
    if kind == "allgather":
        return AllGatherDispatcher(num_experts, num_local_experts)
    if kind == "alltoall":
        return AlltoAllDispatcher(num_experts, num_local_experts)
    raise ValueError(f"moe_token_dispatcher_type must be allgather or alltoall, got {kind!r}")
