"""Model- and data-parallel process groups, with Megatron's `parallel_state.get_*` accessor names.

The layout is pure rank arithmetic (`RankGenerator`, unit-tested without any process group);
`initialize_model_parallel` turns that arithmetic into `torch.distributed` groups. Megatron's
default order "tp-cp-ep-dp-pp" makes the first axis vary fastest:

    global rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so tensor-parallel peers are neighbouring ranks (one node, fastest link) and pipeline stages
are the farthest apart. 16 ranks with TP=2, PP=4 (hence DP=2):

    TP groups  [0, 1] [2, 3] [4, 5] ... [14, 15]
    DP groups  [0, 2] [1, 3] [4, 6] [5, 7] [8, 10] [9, 11] [12, 14] [13, 15]
    PP groups  [0, 4, 8, 12] [1, 5, 9, 13] [2, 6, 10, 14] [3, 7, 11, 15]

Expert layers lay the same ranks out as their own grid (etp, ep, expert-dp, pp) in the same
order, context parallelism folded into expert-dp. 8 ranks with TP=2, EP=2 (ETP = TP = 2):

    etp groups        [0, 1] [2, 3] [4, 5] [6, 7]    (the TP groups themselves)
    ep groups         [0, 2] [1, 3] [4, 6] [5, 7]
    expert-dp groups  [0, 4] [1, 5] [2, 6] [3, 7]    (expert gradients are reduced here)
    tp-ep groups      [0, 1, 2, 3] [4, 5, 6, 7]      (tp-ep-pp: the same, with pp = 1)

Before `initialize_model_parallel` (and after `destroy_model_parallel`) the accessors describe
the trivial layout: every rank its own model, data parallelism over the whole world.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Optional

import torch.distributed as dist

_AXES = ("tp", "cp", "ep", "dp", "pp")
_AXIS_WORDS = {"tp": "tensor", "cp": "context", "ep": "expert", "dp": "data", "pp": "pipeline"}

# Groups created by initialize_model_parallel, in creation order (every rank creates every group
# in this same order, as torch.distributed requires), keyed by the name group_name() reports.
_GROUP_NAMES = ("tp", "pp", "dp", "dp-cp", "cp", "mp", "tp-dp", "embd", "pos-embd", "pp-stack", "ep", "expert-dp",
                "etp", "tp-ep", "tp-ep-pp", "tp-cp", "cp-a2a", "cp-p2p")
# cp-a2a / cp-p2p are made only with hierarchical_context_parallel_sizes (a2a+p2p): the CP group as
# a grid of inner all-to-all groups (consecutive CP ranks) and outer rings across them.
# Expert groups that often list the same ranks as a group made before them (etp = tp when the
# expert tensor size is the dense one; tp-ep = ep when etp = 1; tp-ep-pp = mp when ep = 1):
# a rank list already created is reused instead of becoming a second process group. The older
# kinds keep a group of their own, so group_name() (the communication counter's label) still
# tells a "dp" collective from a "dp-cp" one.
_REUSES_EQUAL_GROUPS = ("etp", "tp-ep", "tp-ep-pp", "tp-cp")
_PIPELINE_SUBSET_KINDS = ("embd", "pos-embd", "pp-stack")  # picked stages, not grid axes: never lent
# Groups spanning the whole world in the trivial (uninitialised) layout; every other group is one rank.
_WORLD_WIDE_WHEN_TRIVIAL = ("dp", "dp-cp", "tp-dp", "expert-dp")


# --------------------------------------------------------------------------- rank arithmetic

def _strides(shape: list[int]) -> list[int]:
    """Mixed-radix strides with the first axis fastest: [2, 3, 4] -> [1, 2, 6]."""
    out, step = [], 1
    for size in shape:
        out.append(step)
        step *= size
    return out


def _linear_index(index: int, shape: list[int], strides: list[int]) -> int:
    """Offset of the index-th point of `shape` (first axis fastest) in a grid with `strides`."""
    offset = 0
    for size, stride in zip(shape, strides):
        offset += (index % size) * stride
        index //= size
    return offset


def generate_masked_orthogonal_rank_groups(world_size: int, parallel_size: list[int],
                                           mask: list[bool]) -> list[list[int]]:
    """Split a rank grid into the groups that vary the masked axes and fix the others.

    `parallel_size` lists the axis sizes, first axis fastest; `mask[i]` says axis i varies
    inside a group. With sizes [tp=2, dp=3, pp=2] (12 ranks) and mask [False, True, False]
    (the dp groups), rank = tp_rank + 2 * dp_rank + 6 * pp_rank and the groups are
    [0, 2, 4] [1, 3, 5] [6, 8, 10] [7, 9, 11]: groups enumerate the fixed axes first axis
    fastest, and ranks inside a group enumerate the masked axes the same way.
    """
    if len(parallel_size) != len(mask):
        raise ValueError(f"parallel_size {parallel_size} and mask {mask} differ in length")
    if any(not isinstance(size, int) or size < 1 for size in parallel_size):
        raise ValueError(f"parallel sizes must be positive integers, got {parallel_size}")
    if prod(parallel_size) != world_size:
        raise ValueError(f"world size ({world_size}) is not the product of the parallel sizes "
                         f"{parallel_size} = {prod(parallel_size)}")
    strides = _strides(parallel_size)
    varying = [(size, stride) for size, stride, m in zip(parallel_size, strides, mask) if m]
    fixed = [(size, stride) for size, stride, m in zip(parallel_size, strides, mask) if not m]
    varying_shape, varying_strides = [s for s, _ in varying], [d for _, d in varying]
    fixed_shape, fixed_strides = [s for s, _ in fixed], [d for _, d in fixed]
    group_size = prod(varying_shape)
    groups = []
    for group_index in range(world_size // group_size):
        base = _linear_index(group_index, fixed_shape, fixed_strides)
        groups.append([base + _linear_index(i, varying_shape, varying_strides) for i in range(group_size)])
    return groups


class RankGenerator:
    """Rank groups of a (tp, cp, ep, dp, pp) grid laid out in `order` (first token fastest).

    Axes of size 1 may be left out of `order` (they are appended); leaving out a larger axis is
    an error. `rank_offset` shifts every rank (a grid placed after other ranks).
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0) -> None:
        sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
        for axis, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{_AXIS_WORDS[axis]} parallel size ({axis}) must be a positive integer, got {size!r}")
        tokens = order.split("-") if order else []
        unknown = [t for t in tokens if t not in sizes]
        if unknown or len(set(tokens)) != len(tokens):
            raise ValueError(f"order {order!r} must be distinct axes from {'-'.join(_AXES)}")
        for axis in _AXES:
            if axis not in tokens:
                if sizes[axis] != 1:
                    raise ValueError(f"order {order!r} leaves out {axis} whose size is {sizes[axis]}; "
                                     "only axes of size 1 may be left out")
                tokens.append(axis)
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.name_to_size = sizes
        self.order = "-".join(tokens)
        self.ordered_size = [sizes[t] for t in tokens]
        self.world_size = prod(self.ordered_size)

    def get_mask(self, token: str) -> list[bool]:
        """Which axes of the order vary inside the groups named by `token` ("tp-dp": tp and dp)."""
        names = token.split("-")
        unknown = [n for n in names if n not in self.name_to_size]
        if unknown or len(set(names)) != len(names):
            raise ValueError(f"rank token {token!r} must be distinct axes from {'-'.join(_AXES)}")
        return [axis in names for axis in self.order.split("-")]

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group that varies the axes in `token` and holds the others fixed."""
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, self.get_mask(token))
        return [[rank + self.rank_offset for rank in group] for group in groups]


def _embedding_ranks(pp_group: list[int], split_rank: Optional[int] = None) -> list[int]:
    # The word embedding lives on the first stage and the tied output layer on the last;
    # their gradients are all-reduced between the two. An encoder-decoder split adds the first
    # decoder stage, which embeds the decoder's input with the same table.
    if len(pp_group) == 1:
        return list(pp_group)
    ranks = [pp_group[0]] + ([pp_group[split_rank]] if split_rank is not None else []) + [pp_group[-1]]
    return list(dict.fromkeys(ranks))


def _position_embedding_ranks(pp_group: list[int], split_rank: Optional[int] = None) -> list[int]:
    # Learned positions: the first stage, and the first decoder stage of an encoder-decoder split.
    return [pp_group[0]] + ([pp_group[split_rank]] if split_rank is not None and len(pp_group) > 1 else [])


def _stack_ranks(pp_group: list[int], split_rank: Optional[int] = None) -> list[list[int]]:
    # The stages of each stack of an encoder-decoder split (T5's relative position table of a stack
    # lives on all of them); without a split the whole pipeline is one stack.
    if split_rank is None or len(pp_group) == 1:
        return [list(pp_group)]
    return [pp_group[:split_rank], pp_group[split_rank:]]


def _hierarchical_cp_ranks(cp_groups: list[list[int]], sizes: list[int]) -> dict[str, list[list[int]]]:
    """Each CP group [c0 .. c(N-1)] as an a x p grid, a = sizes[0] fastest: the a2a groups hold a
    consecutive CP ranks, the p2p groups every a-th ({"cp-a2a": ..., "cp-p2p": ...})."""
    inner, outer = sizes
    a2a, p2p = [], []
    for group in cp_groups:
        a2a += [group[i * inner:(i + 1) * inner] for i in range(outer)]
        p2p += [group[j::inner] for j in range(inner)]
    return {"cp-a2a": a2a, "cp-p2p": p2p}


def _check_hierarchical_sizes(sizes: Optional[list[int]], cp: int) -> None:
    if sizes is None:
        return
    if len(sizes) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in sizes) \
            or sizes[0] * sizes[1] != cp:
        raise ValueError(f"hierarchical_context_parallel_sizes must be two positive integers (the a2a size, then "
                         f"the p2p size) whose product is the context-parallel size ({cp}), got {sizes!r}")


def _check_split_rank(split_rank: Optional[int], pp: int) -> None:
    if split_rank is None:
        return
    if isinstance(split_rank, bool) or not isinstance(split_rank, int) or not 0 < split_rank < pp:
        raise ValueError(f"pipeline_model_parallel_split_rank must be an integer in [1, pipeline size - 1] = "
                         f"[1, {pp - 1}] (the first decoder stage), got {split_rank!r}")


def _plan_rank_groups(world_size: int, tp: int, pp: int, cp: int, ep: int, etp: int,
                      order: str, split_rank: Optional[int] = None,
                      hierarchical_cp: Optional[list[int]] = None) -> dict[str, list[list[int]]]:
    """Every group's ranks, by group name; raises ValueError (naming the sizes) on a bad layout."""
    dense = tp * pp * cp
    if world_size % dense:
        raise ValueError(f"world size ({world_size}) is not divisible by tensor ({tp}) x pipeline ({pp}) "
                         f"x context ({cp}) = {dense}")
    expert = etp * ep * pp
    if world_size % expert:
        raise ValueError(f"world size ({world_size}) is not divisible by expert tensor ({etp}) x expert ({ep}) "
                         f"x pipeline ({pp}) = {expert}")
    # Dense layers see ep as 1; expert layers see cp as 1 and their own tp and dp sizes.
    decoder = RankGenerator(tp=tp, ep=1, dp=world_size // dense, pp=pp, cp=cp, order=order)
    experts = RankGenerator(tp=etp, ep=ep, dp=world_size // expert, pp=pp, cp=1, order=order)
    pp_groups = decoder.get_ranks("pp")
    if experts.get_ranks("pp") != pp_groups:
        raise ValueError(f"order {order!r} puts pipeline stages on different ranks for dense layers "
                         f"(tensor ({tp}) x context ({cp})) and expert layers (expert tensor ({etp}) x "
                         f"expert ({ep})); make the two products equal or put pp last")
    plan = {
        "tp": decoder.get_ranks("tp"),
        "pp": pp_groups,
        "dp": decoder.get_ranks("dp"),
        "dp-cp": decoder.get_ranks("dp-cp"),
        "cp": decoder.get_ranks("cp"),
        "mp": decoder.get_ranks("tp-pp"),
        "tp-dp": decoder.get_ranks("tp-dp"),
        "embd": [_embedding_ranks(group, split_rank) for group in pp_groups],
        "pos-embd": [_position_embedding_ranks(group, split_rank) for group in pp_groups],
        "pp-stack": [stack for group in pp_groups for stack in _stack_ranks(group, split_rank)],
        "ep": experts.get_ranks("ep"),
        "expert-dp": experts.get_ranks("dp"),
        "etp": experts.get_ranks("tp"),
        "tp-ep": experts.get_ranks("tp-ep"),        # the allgather dispatcher's group
        "tp-ep-pp": experts.get_ranks("tp-ep-pp"),  # every distinct expert param once: expert grad norms
        "tp-cp": decoder.get_ranks("tp-cp"),  # the ranks holding one sequence's tokens (MoE token counts)
    }
    if hierarchical_cp is not None:
        plan.update(_hierarchical_cp_ranks(plan["cp"], hierarchical_cp))
    return plan


# --------------------------------------------------------------------------- process groups

@dataclass(frozen=True)
class _Membership:
    """This rank's group of one kind: its global ranks and the process group (None: no dist)."""

    ranks: tuple[int, ...]
    group: Optional[dist.ProcessGroup]


@dataclass
class _State:
    initialized: bool = False
    rank: int = 0  # global rank, recorded once: accessors run on every forward
    memberships: dict[str, _Membership] = field(default_factory=dict)
    created: list[dist.ProcessGroup] = field(default_factory=list)  # to destroy, this rank's only
    names_by_id: dict[int, str] = field(default_factory=dict)
    virtual_pipeline_rank: Optional[int] = None
    virtual_pipeline_world_size: Optional[int] = None
    pipeline_split_rank: Optional[int] = None  # the first decoder stage of an encoder-decoder model


_STATE = _State()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _global_rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _check_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                              order: str = "tp-cp-ep-dp-pp",
                              expert_tensor_parallel_size: Optional[int] = None,
                              pipeline_model_parallel_split_rank: Optional[int] = None,
                              hierarchical_context_parallel_sizes: Optional[list[int]] = None) -> None:
    """Create every model/data-parallel group (Megatron's layout); call on all ranks alike.

    Everything is validated before the first group is created, so a bad size raises the same
    ValueError on every rank instead of leaving some ranks waiting inside `new_group`. Without
    torch.distributed only a world of one process is possible; its groups are None.
    `expert_tensor_parallel_size` defaults to the tensor-parallel size, as in Megatron.
    `pipeline_model_parallel_split_rank` (encoder-decoder models, Megatron's
    --pipeline-model-parallel-split-rank): stages [0, split) hold the encoder, [split, pp) the
    decoder; the embedding groups gain the first decoder stage.
    `hierarchical_context_parallel_sizes` [a, p] (a x p = CP; --cp-comm-type a2a+p2p) also splits
    each CP group into all-to-all groups of a consecutive CP ranks and rings of p across them.
    """
    global _STATE
    if _STATE.initialized:
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel() first")
    tp, pp, cp, ep = (tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
                      expert_model_parallel_size)
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("context_parallel_size", cp), ("expert_model_parallel_size", ep),
                        ("expert_tensor_parallel_size", etp)):
        _check_size(name, value)
    if virtual_pipeline_model_parallel_size is not None:
        _check_size("virtual_pipeline_model_parallel_size", virtual_pipeline_model_parallel_size)
    _check_split_rank(pipeline_model_parallel_split_rank, pp)
    _check_hierarchical_sizes(hierarchical_context_parallel_sizes, cp)
    if pipeline_model_parallel_split_rank is not None and virtual_pipeline_model_parallel_size is not None:
        raise ValueError("an encoder-decoder pipeline split (pipeline_model_parallel_split_rank) does not take "
                         "virtual pipeline stages")
    rank, world_size = _global_rank_and_world()
    if not _distributed() and max(tp, pp, cp, ep, etp) > 1:
        raise ValueError(f"torch.distributed is not initialized (a world of 1 process), so every parallel size "
                         f"must be 1; got tensor ({tp}), pipeline ({pp}), context ({cp}), expert ({ep}), "
                         f"expert tensor ({etp})")
    plan = _plan_rank_groups(world_size, tp, pp, cp, ep, etp, order, pipeline_model_parallel_split_rank,
                             hierarchical_context_parallel_sizes)

    state = _State(rank=rank, virtual_pipeline_world_size=virtual_pipeline_model_parallel_size,
                   virtual_pipeline_rank=0 if virtual_pipeline_model_parallel_size is not None else None,
                   pipeline_split_rank=pipeline_model_parallel_split_rank)
    by_ranks: dict[tuple[int, ...], Optional[dist.ProcessGroup]] = {}  # every group made, member or not
    for name in _GROUP_NAMES:
        for ranks in plan.get(name, ()):
            key = tuple(ranks)
            # The plan is the same on every rank, so every rank reuses (or creates) the same lists
            # and the new_group calls, collective over the whole world, stay in step.
            reused = name in _REUSES_EQUAL_GROUPS and key in by_ranks
            if reused:
                group = by_ranks[key]
            else:
                group = dist.new_group(ranks) if _distributed() else None
                if name not in _PIPELINE_SUBSET_KINDS:  # their one-rank groups would lend odd names
                    by_ranks.setdefault(key, group)
            if rank in ranks:
                state.memberships[name] = _Membership(key, group)
                if group is not None and not reused:
                    state.created.append(group)
                    state.names_by_id[id(group)] = name
    state.initialized = True
    _STATE = state


def destroy_model_parallel() -> None:
    """Destroy the groups initialize_model_parallel created and forget the layout (safe to repeat)."""
    global _STATE
    if _distributed():
        for group in _STATE.created:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):
                # Already gone: the default group was destroyed (taking its subgroups) and perhaps re-created.
                pass
    _STATE = _State()


def model_parallel_is_initialized() -> bool:
    return _STATE.initialized


def _membership(name: str) -> _Membership:
    """This rank's group `name`, or the trivial layout's when nothing is initialised."""
    if _STATE.initialized:
        if name not in _STATE.memberships:  # only embedding groups leave ranks out
            raise RuntimeError(f"rank {_STATE.rank} is in no {name} group; "
                               "ask is_rank_in_embedding_group() / is_rank_in_position_embedding_group() first")
        return _STATE.memberships[name]
    rank, world_size = _global_rank_and_world()
    if name in _WORLD_WIDE_WHEN_TRIVIAL:
        return _Membership(tuple(range(world_size)), dist.group.WORLD if _distributed() else None)
    return _Membership((rank,), None)


def _group(name: str) -> Optional[dist.ProcessGroup]:
    member = _membership(name)
    if not _STATE.initialized and len(member.ranks) == 1 and _global_rank_and_world()[1] > 1:
        # A one-rank group that was never created: None would mean WORLD to a collective.
        raise RuntimeError(f"the {name} process group is not initialized; call initialize_model_parallel() first")
    return member.group


def _global_rank() -> int:
    return _STATE.rank if _STATE.initialized else _global_rank_and_world()[0]


def _rank_in(name: str) -> int:
    return _membership(name).ranks.index(_global_rank())


def _size_of(name: str) -> int:
    return len(_membership(name).ranks)


def group_name(group: Optional[dist.ProcessGroup]) -> str:
    """Short name of a group made here ("tp", "dp-cp", ...); "world" for None/WORLD, else "other"."""
    if group is None or (_distributed() and group is dist.group.WORLD):
        return "world"
    return _STATE.names_by_id.get(id(group), "other")


# --------------------------------------------------------------------------- accessors

def get_tensor_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group("tp")


def get_tensor_model_parallel_world_size() -> int:
    return _size_of("tp")


def get_tensor_model_parallel_rank() -> int:
    return _rank_in("tp")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's TP group (the broadcast source)."""
    return _membership("tp").ranks[0]


def get_pipeline_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group("pp")


def get_pipeline_model_parallel_world_size() -> int:
    return _size_of("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _rank_in("pp")


def get_pipeline_model_parallel_first_rank() -> int:
    return _membership("pp").ranks[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _membership("pp").ranks[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wrapping round, as Megatron's p2p ring does)."""
    ranks = _membership("pp").ranks
    return ranks[(_rank_in("pp") + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _membership("pp").ranks
    return ranks[(_rank_in("pp") - 1) % len(ranks)]


def get_data_parallel_group(with_context_parallel: bool = False) -> Optional[dist.ProcessGroup]:
    """The DP group; with_context_parallel=True: DP x CP, over which dense gradients are reduced."""
    return _group("dp-cp" if with_context_parallel else "dp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _size_of("dp-cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _rank_in("dp-cp" if with_context_parallel else "dp")


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return _membership("dp-cp" if with_context_parallel else "dp").ranks[0]


def get_context_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group("cp")


def get_context_parallel_world_size() -> int:
    return _size_of("cp")


def get_context_parallel_rank() -> int:
    return _rank_in("cp")


def get_context_parallel_global_ranks() -> list[int]:
    return list(_membership("cp").ranks)


def get_tensor_and_context_parallel_group() -> Optional[dist.ProcessGroup]:
    """TP x CP: the ranks among which one micro-batch's tokens are spread (SP and CP split them)."""
    return _group("tp-cp")


def get_tensor_and_context_parallel_world_size() -> int:
    return _size_of("tp-cp")


def get_hierarchical_context_parallel_groups() -> Optional[list[Optional[dist.ProcessGroup]]]:
    """[the a2a group, the p2p ring] of this rank (hierarchical_context_parallel_sizes), else None."""
    if not _STATE.initialized or "cp-a2a" not in _STATE.memberships:
        return None
    return [_STATE.memberships["cp-a2a"].group, _STATE.memberships["cp-p2p"].group]


def get_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """TP x PP: the ranks holding one model replica (grad-norm and found-inf reductions)."""
    return _group("mp")


def get_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's model-parallel (TP x PP) group."""
    return _membership("mp").ranks[0]


def get_tensor_and_data_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group("tp-dp")


def get_expert_model_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group("ep")


def get_expert_model_parallel_world_size() -> int:
    return _size_of("ep")


def get_expert_model_parallel_rank() -> int:
    return _rank_in("ep")


def get_expert_data_parallel_group() -> Optional[dist.ProcessGroup]:
    return _group("expert-dp")


def get_expert_data_parallel_world_size() -> int:
    return _size_of("expert-dp")


def get_expert_data_parallel_rank() -> int:
    return _rank_in("expert-dp")


def get_expert_tensor_parallel_group() -> Optional[dist.ProcessGroup]:
    """The ranks splitting one expert's weights (expert_tensor_parallel_size; the TP group when equal)."""
    return _group("etp")


def get_expert_tensor_parallel_world_size() -> int:
    return _size_of("etp")


def get_expert_tensor_parallel_rank() -> int:
    return _rank_in("etp")


def get_expert_tensor_and_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """Expert tensor x expert model parallel: the ranks among which a token's experts are spread."""
    return _group("tp-ep")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _size_of("tp-ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _rank_in("tp-ep")


def get_expert_tensor_model_pipeline_parallel_group() -> Optional[dist.ProcessGroup]:
    """Expert tensor x expert model x pipeline: the ranks holding every expert parameter once (the
    expert params' part of the grad norm is summed over it, as the dense part over the model-parallel group)."""
    return _group("tp-ep-pp")


def get_pipeline_stack_group() -> Optional[dist.ProcessGroup]:
    """The pipeline stages of this rank's stack: with an encoder-decoder split the encoder's stages
    [0, split) or the decoder's [split, pp) of its pipeline, else the whole pipeline group."""
    return _group("pp-stack")


def get_pipeline_stack_world_size() -> int:
    return _size_of("pp-stack")


def get_pipeline_stack_rank() -> int:
    return _rank_in("pp-stack")


def get_embedding_group() -> Optional[dist.ProcessGroup]:
    """First and last stage of this rank's pipeline (tied word embeddings); one rank when PP = 1."""
    return _group("embd")


def get_position_embedding_group() -> Optional[dist.ProcessGroup]:
    return _group("pos-embd")


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """Whether this rank holds a tied embedding; with virtual stages, only in its first/last chunk."""
    rank = _global_rank()
    if _STATE.initialized and "embd" not in _STATE.memberships:
        return False
    ranks = _membership("embd").ranks
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage()
    if rank == ranks[-1]:
        return is_pipeline_last_stage()
    return True


def is_rank_in_position_embedding_group() -> bool:
    return not _STATE.initialized or "pos-embd" in _STATE.memberships


# --------------------------------------------------------------------------- pipeline stages

def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return _STATE.virtual_pipeline_rank


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    _STATE.virtual_pipeline_rank = rank


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return _STATE.virtual_pipeline_world_size


def set_virtual_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    _STATE.virtual_pipeline_world_size = world_size


def get_pipeline_model_parallel_split_rank() -> Optional[int]:
    """The first decoder stage of an encoder-decoder pipeline (None: no split)."""
    return _STATE.pipeline_split_rank


def is_pipeline_stage_before_split(rank: Optional[int] = None) -> bool:
    """Whether pipeline stage `rank` (this one by default) holds encoder layers; every stage without a split."""
    split = _STATE.pipeline_split_rank
    if get_pipeline_model_parallel_world_size() == 1 or split is None:
        return True
    return (get_pipeline_model_parallel_rank() if rank is None else rank) < split


def is_pipeline_stage_after_split(rank: Optional[int] = None) -> bool:
    """Whether pipeline stage `rank` (this one by default) holds decoder layers; every stage without a split."""
    split = _STATE.pipeline_split_rank
    if get_pipeline_model_parallel_world_size() == 1 or split is None:
        return True
    return (get_pipeline_model_parallel_rank() if rank is None else rank) >= split


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """First pipeline stage; with virtual stages, also the first model chunk unless ignore_virtual."""
    if not ignore_virtual and _STATE.virtual_pipeline_world_size is not None \
            and _STATE.virtual_pipeline_rank != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """Last pipeline stage; with virtual stages, also the last model chunk unless ignore_virtual."""
    size = _STATE.virtual_pipeline_world_size
    if not ignore_virtual and size is not None and _STATE.virtual_pipeline_rank != size - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1
