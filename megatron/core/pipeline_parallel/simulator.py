"""Pipeline schedule simulator: replay every rank's sends and receives and find a deadlock before launch.

    record(pp, vpp, m)          -> [[Exchange, ...] per pipeline rank], by running the schedules'
                                   own code (schedules.py) with a fake p2p layer and a one-number model
    find_deadlock(exchanges)    -> None, or a Deadlock: which rank waits in which exchange on whom
    check_schedule(pp, vpp, m)  -> raises ScheduleDeadlockError with that description

The schedule code is the real one: schedules.parallel_state (and its device and watchdog) and
p2p_communication's parallel_state and _communicate are swapped, for the duration of one rank's
replay, for a fake pipeline position on the CPU and a recorder. The real p2p functions still decide what an edge stage skips,
so the recorded order is exactly what that rank would post. No process group is needed.

Matching model (the strictest of gloo and NCCL): one exchange posts its sends and receives
together and completes when every one of them has a partner posted; the n-th send from rank a to
rank b with a tag (forward: activations, backward: gradients) pairs with the n-th receive on b
from a with that tag. A rank blocks in its exchange until then. If no rank can advance and some
have exchanges left, that is a deadlock (a send nobody receives counts too).
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

FORWARD, BACKWARD = "activations", "gradients"


class ScheduleDeadlockError(RuntimeError):
    """A pipeline layout whose schedules would wait on each other forever."""


@dataclass(frozen=True)
class Op:
    kind: str   # "send" or "recv"
    peer: int   # pipeline rank
    tag: str    # FORWARD or BACKWARD


@dataclass(frozen=True)
class Exchange:
    """One p2p call of a rank's schedule: what it posts together and then waits for."""

    rank: int
    index: int
    name: str                       # the p2p function (send_forward_recv_backward, ...)
    ops: Tuple[Op, ...]
    microbatch: Optional[int]
    virtual_stage: Optional[int]

    def label(self) -> str:
        where = [f"micro-batch {self.microbatch}"] if self.microbatch is not None else []
        if self.virtual_stage is not None:
            where.append(f"chunk {self.virtual_stage}")
        return f"{self.name} #{self.index}" + (f" ({', '.join(where)})" if where else "")


@dataclass(frozen=True)
class Deadlock:
    """Ranks blocked for good: rank -> (its exchange, the ops with no partner posted, why)."""

    blocked: Dict[int, Tuple[Exchange, List[str]]]
    done: List[int]

    def describe(self) -> str:
        lines = []
        for rank, (exchange, waits) in sorted(self.blocked.items()):
            lines.append(f"rank {rank} waits in {exchange.label()}: " + "; ".join(waits))
        if self.done:
            lines.append(f"ranks {self.done} finished their schedule")
        return "\n".join(lines)


# ------------------------------------------------------------------------------ recording

class _Position:
    """The parallel_state functions the schedules and p2p layer ask, for one fake rank."""

    def __init__(self, rank: int, pp: int, vpp: Optional[int]) -> None:
        self.rank, self.pp, self.vpp, self.virtual = rank, pp, vpp, 0 if vpp else None

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.rank

    def get_virtual_pipeline_model_parallel_world_size(self) -> Optional[int]:
        return self.vpp

    def set_virtual_pipeline_model_parallel_rank(self, rank: Optional[int]) -> None:
        self.virtual = rank

    def is_pipeline_first_stage(self, ignore_virtual: bool = False) -> bool:
        if not ignore_virtual and self.vpp is not None and self.virtual != 0:
            return False
        return self.rank == 0

    def is_pipeline_last_stage(self, ignore_virtual: bool = False) -> bool:
        if not ignore_virtual and self.vpp is not None and self.virtual != self.vpp - 1:
            return False
        return self.rank == self.pp - 1

    def get_context_parallel_world_size(self) -> int:
        return 1

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_group(self) -> None:
        return None

    def get_pipeline_model_parallel_last_rank(self) -> int:
        return self.pp - 1


class _Chunk(torch.nn.Module):
    """A model chunk of one weight: output = input * w (the first stage: w itself), [1, 1, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1, 1, 1))
        self.config = types.SimpleNamespace(sequence_parallel=False, hidden_size=1, params_dtype=torch.float32)
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.input_tensor = tensor


def _forward_step(data_iterator, model: _Chunk):
    source = model.input_tensor if model.input_tensor is not None else torch.ones(1, 1, 1)
    return source * model.weight, lambda output: (output.sum(), {})


@contextlib.contextmanager
def _as_rank(position: _Position, exchanges: List[Exchange]) -> Iterator[None]:
    """Swap the schedules' and p2p layer's parallel_state (and p2p's _communicate) for fakes."""
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    def communicate(*, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, dtype,
                    op_name, where):
        nxt, prev = (position.rank + 1) % position.pp, (position.rank - 1) % position.pp
        ops = [Op("send", nxt, FORWARD)] if tensor_send_next is not None else []
        ops += [Op("send", prev, BACKWARD)] if tensor_send_prev is not None else []
        ops += [Op("recv", prev, FORWARD)] if recv_prev else []
        ops += [Op("recv", nxt, BACKWARD)] if recv_next else []
        if ops:
            exchanges.append(Exchange(position.rank, len(exchanges), op_name, tuple(ops),
                                      getattr(where, "microbatch", None), getattr(where, "virtual_stage", None)))

        def received(wanted: bool):
            return torch.zeros(tensor_shape, dtype=dtype, requires_grad=True) if wanted else None

        return received(recv_prev), received(recv_next)

    silent = types.SimpleNamespace(note_schedule=lambda *a, **k: None, note_step=lambda *a, **k: None,
                                   watch=lambda *a, **k: contextlib.nullcontext())
    on_cpu = types.SimpleNamespace(get_device=lambda: torch.device("cpu"))  # validation runs before set_device
    saved = (schedules.parallel_state, schedules.watchdog, schedules.device, p2p_communication.parallel_state,
             p2p_communication._communicate)
    schedules.parallel_state, schedules.watchdog, schedules.device = position, silent, on_cpu
    p2p_communication.parallel_state, p2p_communication._communicate = position, communicate
    try:
        yield
    finally:
        (schedules.parallel_state, schedules.watchdog, schedules.device, p2p_communication.parallel_state,
         p2p_communication._communicate) = saved


def record(pp: int, vpp: Optional[int], num_microbatches: int, forward_only: bool = False,
           schedule: Optional[Callable] = None) -> List[List[Exchange]]:
    """Every pipeline rank's exchanges, in the order its schedule posts them.

    schedule: a function taking the schedules' keyword arguments (default: the one
    get_forward_backward_func picks for pp and vpp).
    """
    from megatron.core.pipeline_parallel import schedules

    vpp = vpp if vpp and vpp > 1 else None
    func = schedule or schedules.get_forward_backward_func(pp, vpp)
    per_rank = []
    for rank in range(pp):
        exchanges: List[Exchange] = []
        chunks = [_Chunk() for _ in range(vpp or 1)]
        with _as_rank(_Position(rank, pp, vpp), exchanges):
            func(forward_step_func=_forward_step, data_iterator=None if vpp is None else [None] * vpp,
                 model=chunks if vpp else chunks[0], num_microbatches=num_microbatches, seq_length=1,
                 micro_batch_size=1, forward_only=forward_only)
        per_rank.append(exchanges)
    return per_rank


# ------------------------------------------------------------------------------ replay

def find_deadlock(per_rank: List[List[Exchange]]) -> Optional[Deadlock]:
    """Replay the ranks' exchanges under the matching model above; None when all of them finish."""
    partner = _partners(per_rank)
    position = [0] * len(per_rank)

    def unmatched(exchange: Exchange) -> List[Tuple[Op, Optional[Tuple[int, int]]]]:
        missing = []
        for k, op in enumerate(exchange.ops):
            other = partner.get((exchange.rank, exchange.index, k))
            if other is None or position[other[0]] < other[1]:
                missing.append((op, other))
        return missing

    progressed = True
    while progressed:
        progressed = False
        for rank, exchanges in enumerate(per_rank):
            while position[rank] < len(exchanges) and not unmatched(exchanges[position[rank]]):
                position[rank] += 1
                progressed = True
    blocked = {}
    for rank, exchanges in enumerate(per_rank):
        if position[rank] < len(exchanges):
            exchange = exchanges[position[rank]]
            blocked[rank] = (exchange, [_why(op, other, per_rank, position) for op, other in unmatched(exchange)])
    if not blocked:
        return None
    return Deadlock(blocked, [r for r in range(len(per_rank)) if r not in blocked])


def _partners(per_rank: List[List[Exchange]]) -> Dict[Tuple[int, int, int], Tuple[int, int]]:
    """(rank, exchange, op) -> (peer rank, peer's exchange) of its partner: the n-th send a -> b
    with a tag pairs with the n-th receive on b from a with that tag."""
    sends: Dict[Tuple[int, int, str], List[Tuple[int, int]]] = {}
    recvs: Dict[Tuple[int, int, str], List[Tuple[int, int]]] = {}
    for exchanges in per_rank:
        for exchange in exchanges:
            for k, op in enumerate(exchange.ops):
                if op.kind == "send":
                    sends.setdefault((exchange.rank, op.peer, op.tag), []).append((exchange.index, k))
                else:
                    recvs.setdefault((op.peer, exchange.rank, op.tag), []).append((exchange.index, k))
    partner = {}
    for (src, dst, tag), posted in sends.items():
        for (index, k), (other_index, other_k) in zip(posted, recvs.get((src, dst, tag), [])):
            partner[(src, index, k)] = (dst, other_index)
            partner[(dst, other_index, other_k)] = (src, index)
    return partner


def _why(op: Op, other: Optional[Tuple[int, int]], per_rank: List[List[Exchange]], position: List[int]) -> str:
    what = (f"send {op.tag} to rank {op.peer}" if op.kind == "send"
            else f"receive {op.tag} from rank {op.peer}")
    if other is None:
        return f"{what}: rank {op.peer} posts no matching {'receive' if op.kind == 'send' else 'send'}"
    peer, index = other  # posted later than where the peer is blocked (a finished peer matched everything)
    return (f"{what}, matched by its {per_rank[peer][index].label()}, while rank {peer} is blocked in "
            f"{per_rank[peer][position[peer]].label()}")


def check_schedule(pp: int, vpp: Optional[int], num_microbatches: int, schedule: Optional[Callable] = None) -> None:
    """Raise ScheduleDeadlockError if the layout's training or evaluation schedule would deadlock."""
    for forward_only in (False, True):
        deadlock = find_deadlock(record(pp, vpp, num_microbatches, forward_only, schedule))
        if deadlock is not None:
            kind = "evaluation (forward-only)" if forward_only else "training"
            raise ScheduleDeadlockError(
                f"the {kind} pipeline schedule deadlocks for --pipeline-model-parallel-size {pp}"
                + (f", {vpp} virtual stages per rank" if vpp and vpp > 1 else "")
                + f", {num_microbatches} micro-batches:\n{deadlock.describe()}")
