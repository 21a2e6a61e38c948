"""Which node each rank runs on, and how the parallel groups fall across the nodes.

A rank's node is what torchrun says: GROUP_RANK (the agent's rank among the nodes), else
rank // LOCAL_WORLD_SIZE, else 0. The host name would not do: the loopback test runs two
"nodes" on one machine. At start-up every rank's node is gathered once, and rank 0 prints

    > node topology: 2 nodes x 2 ranks (node 0: ranks 0-1, node 1: ranks 2-3)
    > groups on nodes: tensor-parallel 2 x 2 ranks, each inside a node | data-parallel 2 x 2 ranks, across 2 nodes

plus a WARNING for a tensor-parallel (or expert tensor-parallel) group that spans nodes: those
groups all-reduce in every layer, and belong on the fast links inside a node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import communication

# The kinds reported, in Megatron's order, with the names used in the printed lines.
_KINDS = (("tp", "tensor-parallel"), ("cp", "context-parallel"), ("ep", "expert-parallel"),
          ("etp", "expert tensor-parallel"), ("dp", "data-parallel"), ("pp", "pipeline-parallel"))
_MUST_STAY_INSIDE = ("tp", "etp")
_SHOWN_GROUPS = 4  # a warning names at most this many groups


def local_node_index(rank: int, env: Mapping[str, str] = os.environ) -> int:
    """This process's node: torchrun's GROUP_RANK, else rank // LOCAL_WORLD_SIZE, else 0."""
    if env.get("GROUP_RANK", "") != "":
        return int(env["GROUP_RANK"])
    if env.get("LOCAL_WORLD_SIZE", "") != "":
        return rank // int(env["LOCAL_WORLD_SIZE"])
    return 0


def gather_node_indices(device: torch.device) -> list[int]:
    """Every rank's node, by global rank (one all-gather over the world; call on every rank)."""
    mine = torch.tensor([local_node_index(dist.get_rank())], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    communication.all_gather(every, mine)  # [world] x [1]
    return [int(t.item()) for t in every]


def _ranges(ranks: Sequence[int]) -> str:
    """'0-3, 8' for [0, 1, 2, 3, 8]."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def describe_nodes(nodes: Sequence[int]) -> str:
    """One line: how many nodes, and which ranks each holds (past 3 nodes: the first two, '...', the last)."""
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    sizes = {len(ranks) for ranks in by_node.values()}
    count = _plural(len(by_node), "node") + (f" x {_plural(sizes.pop(), 'rank')}" if len(sizes) == 1 else "")
    shown = [f"node {node}: ranks {_ranges(ranks)}" for node, ranks in sorted(by_node.items())]
    if len(shown) > 3:
        shown = [*shown[:2], "...", shown[-1]]
    return f"> node topology: {count} ({', '.join(shown)})"


def describe_groups(plan: Mapping[str, list[list[int]]], nodes: Sequence[int],
                    kinds: Sequence[str]) -> tuple[str, list[str]]:
    """The groups-on-nodes line and the warnings, from every group's ranks and every rank's node."""
    parts, warnings = [], []
    for kind, name in _KINDS:
        if kind not in kinds:
            continue
        groups = plan[kind]
        spanning = [g for g in groups if len({nodes[r] for r in g}) > 1]
        widest = max(len({nodes[r] for r in g}) for g in groups)
        where = "each inside a node" if not spanning else (
            f"across {widest} nodes" if len(spanning) == len(groups) else
            f"{len(spanning)} of them across nodes")
        parts.append(f"{name} {len(groups)} x {len(groups[0])} ranks, {where}")
        if spanning and kind in _MUST_STAY_INSIDE:
            named = "; ".join(f"ranks {g} on nodes {sorted({nodes[r] for r in g})}"
                              for g in spanning[:_SHOWN_GROUPS])
            more = f" (and {len(spanning) - _SHOWN_GROUPS} more)" if len(spanning) > _SHOWN_GROUPS else ""
            warnings.append(f"WARNING: {len(spanning)} of {len(groups)} {name} groups span nodes: {named}{more}. "
                            f"They all-reduce in every layer over the network between nodes; make the "
                            f"{name} size divide the ranks per node (--nproc-per-node)")
    return "> groups on nodes: " + " | ".join(parts), warnings


def report(plan: Mapping[str, list[list[int]]], kinds: Sequence[str], device: torch.device,
           print_fn=print) -> Optional[list[int]]:
    """Gather the nodes and, on rank 0, print the two lines and any warning; returns the nodes.

    Does nothing (returns None) without torch.distributed or in a world of one process.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    nodes = gather_node_indices(device)
    if dist.get_rank() == 0:
        groups_line, warnings = describe_groups(plan, nodes, kinds)
        for line in (describe_nodes(nodes), groups_line, *warnings):
            print_fn(line)
    return nodes
