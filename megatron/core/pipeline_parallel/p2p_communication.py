"""Point-to-point traffic between adjacent pipeline stages.

Activations travel forward (stage p -> p+1), their gradients backward (p+1 -> p). Shapes are
known in advance: a stage boundary carries a [s/cp (or s/(cp*t) under sequence parallelism),
micro-batch, hidden] tensor, or several (an encoder-decoder model's decoder stages pass their
hidden states and the encoder output), so receivers allocate before the data arrives and no
shape exchange is needed. A tensor_shape is one shape (one tensor each way) or a list of shapes
(a list of tensors each way, in that order). The ranks form a ring (stage pp-1's "next" is stage 0), which the
interleaved schedule uses to pass a model chunk's output to the first stage's next chunk.

Every call posts all of its sends and receives together (torch.distributed.batch_isend_irecv)
and then waits for them, so a stage that sends forward while receiving backward cannot deadlock
against its neighbour doing the opposite. Forward traffic and backward traffic use different
tags, and each call orders its operations (sends next, sends previous, receives previous,
receives next) so that with two stages, where "next" and "previous" are the same rank, a
backend that matches by order (NCCL) pairs them the same way as one that matches by tag (gloo).

No silent hangs: the waits have a deadline (set_p2p_timeout, which initialize sets from
--distributed-timeout-minutes). Past it the waiting rank raises
PipelineTimeoutError naming its global rank, its stage and virtual stage, the micro-batch, the
operation and the peer it waited on. The hang watchdog (megatron/core/watchdog.py), when started,
watches the same waits, moves this deadline past its own, and at its own prints what the rank waits
on and exits the process.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import communication, device, parallel_state, watchdog

# Tags: activations going to the next stage, gradients going to the previous one.
_FORWARD_TAG = 1
_BACKWARD_TAG = 2

_timeout_seconds: Optional[float] = None


class PipelineTimeoutError(RuntimeError):
    """A pipeline send/receive did not complete within the configured timeout."""


def set_p2p_timeout(seconds: Optional[float]) -> None:
    """Fail a send/receive still pending after `seconds` (None: wait forever)."""
    global _timeout_seconds
    if seconds is not None and seconds <= 0:
        raise ValueError(f"pipeline send/receive timeout must be positive, got {seconds}")
    _timeout_seconds = seconds


def get_p2p_timeout() -> Optional[float]:
    """The deadline of a send/receive: set_p2p_timeout's, or past the watchdog's if that is later,
    so that a running watchdog names the stuck collective before the pipeline gives up."""
    if _timeout_seconds is None:
        return None
    watchdog_deadline = watchdog.deadline()
    if watchdog_deadline is None:
        return _timeout_seconds
    return max(_timeout_seconds, watchdog_deadline + watchdog.grace_seconds())


@dataclass
class Where:
    """What the schedule is doing when it communicates, for the timeout message."""

    microbatch: Optional[int] = None      # the micro-batch whose tensor is awaited (or sent)
    virtual_stage: Optional[int] = None
    sending: Optional[int] = None         # in a combined exchange: the micro-batch sent meanwhile

    def describe(self) -> str:
        parts = []
        if self.virtual_stage is not None:
            parts.append(f"virtual stage {self.virtual_stage}")
        if self.microbatch is not None:
            parts.append(f"micro-batch {self.microbatch}")
        if self.sending is not None and self.sending != self.microbatch:
            parts.append(f"while sending micro-batch {self.sending}")
        return ", ".join(parts)


# ------------------------------------------------------------------------------ peers

def _next_rank() -> int:
    return parallel_state.get_pipeline_model_parallel_next_rank()


def _prev_rank() -> int:
    return parallel_state.get_pipeline_model_parallel_prev_rank()


def _stage_label(global_rank: int) -> str:
    ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    return f"rank {global_rank} (stage {ranks.index(global_rank)})"


# ------------------------------------------------------------------------------ the exchange

def _wait(requests: Sequence[dist.Work], description: str, where: Optional[Where], gloo: bool) -> None:
    """Wait for every request; past the timeout raise PipelineTimeoutError describing the wait.

    gloo requests complete only inside wait(), which takes a timeout; NCCL requests report
    completion through is_completed(), polled here against the deadline.
    """
    timeout_seconds = get_p2p_timeout()
    if timeout_seconds is None:
        for request in requests:
            request.wait()
        return
    deadline = time.monotonic() + timeout_seconds
    if gloo:
        for request in requests:
            remaining = max(deadline - time.monotonic(), 1e-3)
            try:
                request.wait(timeout=datetime.timedelta(seconds=remaining))
            except RuntimeError as error:
                if "timed out" not in str(error).lower():
                    raise
                raise _timeout_error(description, where) from error
        return
    pause = 0.0
    while not all(request.is_completed() for request in requests):
        if time.monotonic() > deadline:
            raise _timeout_error(description, where)
        if pause:
            time.sleep(pause)
        pause = min(max(pause * 2, 1e-5), 1e-3)  # spin briefly, then poll at most every millisecond
    for request in requests:
        request.wait()


def _timeout_error(description: str, where: Optional[Where]) -> PipelineTimeoutError:
    stage = parallel_state.get_pipeline_model_parallel_rank()
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    context = where.describe() if where is not None else ""
    return PipelineTimeoutError(
        f"pipeline timeout: global rank {dist.get_rank()} (pipeline stage {stage} of {stages}"
        + (f", {context}" if context else "") + f") waited more than {get_p2p_timeout():g} s on "
        f"{description}; the neighbouring stage is stalled, crashed or running a different schedule "
        "(see --distributed-timeout-minutes)")


def _as_shapes(tensor_shape) -> Tuple[List[Tuple[int, ...]], bool]:
    """(the shapes, whether the caller gave a list of them) of a tensor_shape argument."""
    if isinstance(tensor_shape, (list, tuple)) and tensor_shape and isinstance(tensor_shape[0], (list, tuple, torch.Size)):
        return [tuple(shape) for shape in tensor_shape], True
    return [tuple(tensor_shape)], False


def _as_tensors(tensors) -> List[torch.Tensor]:
    if tensors is None:
        return []
    return list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]


def _communicate(*, tensor_send_next, tensor_send_prev, recv_prev: bool, recv_next: bool, tensor_shape,
                 dtype: torch.dtype, op_name: str, where: Optional[Where]):
    """Post the sends and receives of one step together and wait; returns (from prev, from next),
    each a tensor, or a list of tensors when tensor_shape is a list of shapes.

    Received activations (from prev) require grad: the stage back-propagates into them.
    """
    group = parallel_state.get_pipeline_model_parallel_group()
    next_rank, prev_rank = _next_rank(), _prev_rank()
    where_to = device.get_device()
    shapes, many = _as_shapes(tensor_shape)

    def buffers() -> List[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype, device=where_to, requires_grad=True) for shape in shapes]

    from_prev = buffers() if recv_prev else []
    from_next = buffers() if recv_next else []
    ops: List[dist.P2POp] = []
    waits_on: List[str] = []
    count = f" ({len(shapes)} tensors)" if many and len(shapes) > 1 else ""
    for tensor in _as_tensors(tensor_send_next):
        ops.append(dist.P2POp(dist.isend, _contiguous(tensor), next_rank, group, _FORWARD_TAG))
    if tensor_send_next is not None:
        waits_on.append(f"send activations to {_stage_label(next_rank)}")
    for tensor in _as_tensors(tensor_send_prev):
        ops.append(dist.P2POp(dist.isend, _contiguous(tensor), prev_rank, group, _BACKWARD_TAG))
    if tensor_send_prev is not None:
        waits_on.append(f"send gradients to {_stage_label(prev_rank)}")
    for buffer in from_prev:
        ops.append(dist.P2POp(dist.irecv, buffer.data, prev_rank, group, _FORWARD_TAG))
    if recv_prev:
        waits_on.append(f"receive activations{count} from {_stage_label(prev_rank)}")
    for buffer in from_next:
        ops.append(dist.P2POp(dist.irecv, buffer.data, next_rank, group, _BACKWARD_TAG))
    if recv_next:
        waits_on.append(f"receive gradients{count} from {_stage_label(next_rank)}")
    if ops:
        with watchdog.watch(op_name, group, peer="; ".join(waits_on),
                            microbatch=where.microbatch if where is not None else None,
                            virtual_stage=where.virtual_stage if where is not None else None):
            requests = communication.batch_isend_irecv(ops)
            _wait(requests, f"{op_name} ({'; '.join(waits_on)})", where, dist.get_backend(group) == "gloo")

    def result(received: List[torch.Tensor]):
        if not received:
            return None
        return received if many else received[0]

    return result(from_prev), result(from_next)


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous()


# ------------------------------------------------------------------------------ the schedule's calls
# Each returns what it received; sends of None and receives on the edge stages are skipped.

def recv_forward(tensor_shape: Sequence[int], dtype: torch.dtype, where: Optional[Where] = None) -> Optional[torch.Tensor]:
    """The previous stage's activations (None on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    return _communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=True, recv_next=False,
                        tensor_shape=tensor_shape, dtype=dtype, op_name="recv_forward", where=where)[0]


def recv_backward(tensor_shape: Sequence[int], dtype: torch.dtype, where: Optional[Where] = None) -> Optional[torch.Tensor]:
    """The gradient of this stage's output from the next stage (None on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    return _communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=True,
                        tensor_shape=tensor_shape, dtype=dtype, op_name="recv_backward", where=where)[1]


def send_forward(output_tensor: Optional[torch.Tensor], tensor_shape: Sequence[int], dtype: torch.dtype,
                 where: Optional[Where] = None) -> None:
    if parallel_state.is_pipeline_last_stage() or output_tensor is None:
        return
    _communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False, recv_next=False,
                 tensor_shape=tensor_shape, dtype=dtype, op_name="send_forward", where=where)


def send_backward(input_tensor_grad: Optional[torch.Tensor], tensor_shape: Sequence[int], dtype: torch.dtype,
                  where: Optional[Where] = None) -> None:
    if parallel_state.is_pipeline_first_stage() or input_tensor_grad is None:
        return
    _communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False, recv_next=False,
                 tensor_shape=tensor_shape, dtype=dtype, op_name="send_backward", where=where)


def send_forward_recv_backward(output_tensor: Optional[torch.Tensor], tensor_shape: Sequence[int],
                               dtype: torch.dtype, where: Optional[Where] = None) -> Optional[torch.Tensor]:
    """Send this micro-batch's activations and receive the gradient of an earlier one."""
    if parallel_state.is_pipeline_last_stage():
        return None
    return _communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False, recv_next=True,
                        tensor_shape=tensor_shape, dtype=dtype, op_name="send_forward_recv_backward",
                        where=where)[1]


def send_backward_recv_forward(input_tensor_grad: Optional[torch.Tensor], tensor_shape: Sequence[int],
                               dtype: torch.dtype, where: Optional[Where] = None) -> Optional[torch.Tensor]:
    """Send a gradient back and receive the next micro-batch's activations."""
    if parallel_state.is_pipeline_first_stage():
        return None
    return _communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=True, recv_next=False,
                        tensor_shape=tensor_shape, dtype=dtype, op_name="send_backward_recv_forward",
                        where=where)[0]


def send_forward_recv_forward(output_tensor: Optional[torch.Tensor], recv_prev: bool, tensor_shape: Sequence[int],
                              dtype: torch.dtype, where: Optional[Where] = None) -> Optional[torch.Tensor]:
    """Interleaved schedule: send to the next rank, receive from the previous one (the ring)."""
    return _communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=recv_prev,
                        recv_next=False, tensor_shape=tensor_shape, dtype=dtype,
                        op_name="send_forward_recv_forward", where=where)[0]


def send_backward_recv_backward(input_tensor_grad: Optional[torch.Tensor], recv_next: bool,
                                tensor_shape: Sequence[int], dtype: torch.dtype,
                                where: Optional[Where] = None) -> Optional[torch.Tensor]:
    """Interleaved schedule: send a gradient to the previous rank, receive one from the next."""
    return _communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False,
                        recv_next=recv_next, tensor_shape=tensor_shape, dtype=dtype,
                        op_name="send_backward_recv_backward", where=where)[1]


def send_forward_backward_recv_forward_backward(
        output_tensor: Optional[torch.Tensor], input_tensor_grad: Optional[torch.Tensor], recv_prev: bool,
        recv_next: bool, tensor_shape: Sequence[int], dtype: torch.dtype,
        where: Optional[Where] = None) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Interleaved steady state: both directions in one exchange; returns (activations, gradient)."""
    return _communicate(tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad, recv_prev=recv_prev,
                        recv_next=recv_next, tensor_shape=tensor_shape, dtype=dtype,
                        op_name="send_forward_backward_recv_forward_backward", where=where)
