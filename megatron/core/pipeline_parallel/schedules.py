"""Forward/backward schedules over the micro-batches of one global batch.

    forward_backward_no_pipelining                 one stage: each micro-batch forward then
                                                   backward, gradients accumulating.
    forward_backward_pipelining_without_interleaving
                                                   PipeDream-Flush (1F1B): stage p runs
                                                   pp - p - 1 warm-up forwards, then alternates one
                                                   forward and one backward, then drains the
                                                   remaining backwards. At most pp - p micro-batches
                                                   are in flight on stage p.
    forward_backward_pipelining_with_interleaving  the same with v model chunks per rank (virtual
                                                   stages): chunk c of rank p is stage c*pp + p of
                                                   the model, which shrinks the bubble from
                                                   (pp-1)/m to (pp-1)/(v*m).

get_forward_backward_func() picks one from parallel_state. All three take the same keyword
arguments and return the reported losses of each micro-batch (on the last pipeline stage; an
empty list elsewhere).

The loss function returned by a forward step may give
    (loss, {name: reported})                   -> loss is the micro-batch's mean; the schedule
                                                 divides it by num_microbatches. It counts no
                                                 tokens, so with calculate_per_token_loss (accepted,
                                                 as megatron-core accepts it) nothing divides the
                                                 gradients afterwards, and DDP sums (not averages)
                                                 them over the data-parallel replicas, as there;
    (loss_sum, num_tokens, {name: [sum, n]})   -> Megatron-Core's form. By default the schedule
                                                 divides loss_sum by num_tokens and by
                                                 num_microbatches (each micro-batch weighs the
                                                 same); with calculate_per_token_loss it keeps
                                                 the sum, and gradients are divided by the total
                                                 number of tokens of the global batch afterwards
                                                 (every token weighs the same).

Memory: once a stage has sent its output to the next stage it keeps only the autograd graph
behind it; the output's own storage is released (deallocate_pipeline_outputs, on by default)
and backward runs through the graph with the gradient received from the next stage.

Every forward and backward step is reported to the schedule tracer (tracer.py) when it is on.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from megatron.core import communication, device, parallel_state, watchdog
from megatron.core.aux_losses import AuxLossAutoScaler
from megatron.core.distributed.finalize_model_grads import scale_gradients
from megatron.core.pipeline_parallel import p2p_communication, tracer
from megatron.core.pipeline_parallel.p2p_communication import Where
from megatron.core.utils import unwrap_model

LossDict = Dict[str, torch.Tensor]


# ------------------------------------------------------------------------------ shared steps

def _run_loss_func(loss_func: Callable, output_tensor: torch.Tensor, num_microbatches: int,
                   calculate_per_token_loss: bool) -> tuple[torch.Tensor, torch.Tensor, LossDict]:
    """Apply the loss function; returns (loss to back-propagate, num_tokens, reported values)."""
    outputs = loss_func(output_tensor)
    cp = parallel_state.get_context_parallel_world_size()
    if len(outputs) == 3:
        loss, num_tokens, reported = outputs
        num_tokens = torch.as_tensor(num_tokens).detach()
        if not calculate_per_token_loss:
            loss = loss / _micro_batch_token_count(num_tokens, cp) / num_microbatches
        return loss, num_tokens, reported
    if len(outputs) == 2:  # Megatron's legacy form: a mean, averaged over the micro-batches, no token count
        loss, reported = outputs
        # Megatron's: a loss function that already averages over the CP ranks (all-reduce of sum and
        # count) gets its gradient multiplied back by the CP size, which DDP's 1/(DP x CP) divides.
        return loss * cp / num_microbatches, torch.tensor(0), reported
    raise ValueError(f"a loss function must return 2 or 3 values, got {len(outputs)}")


def _micro_batch_token_count(num_tokens: torch.Tensor, cp: int) -> torch.Tensor:
    """What a micro-batch's loss sum is divided by: its token count, at least 1. Under context
    parallelism each rank holds 1/N of the micro-batch's tokens: the count is summed over the CP
    group and divided by N, so that DDP's mean over DP x CP ranks gives the gradient of
    (sum over the whole micro-batch) / (its count) exactly, whatever share of the loss mask each CP
    rank holds. (Megatron divides by the local count, the same when the shares are equal.)"""
    if cp == 1:
        return num_tokens.clamp(min=1)
    total = num_tokens.to(device=device.get_device(), dtype=torch.int64).reshape(1).clone()
    communication.all_reduce(total, group=parallel_state.get_context_parallel_group())
    return total.to(num_tokens.device).reshape(()).clamp(min=1).float() / cp


class _Run:
    """What one call of a schedule shares between its steps."""

    def __init__(self, forward_step_func: Callable, num_microbatches: int, forward_only: bool,
                 grad_scale_func: Optional[Callable], calculate_per_token_loss: bool,
                 deallocate_pipeline_outputs: bool) -> None:
        self.forward_step_func = forward_step_func
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.grad_scale_func = grad_scale_func
        self.calculate_per_token_loss = calculate_per_token_loss
        self.deallocate = deallocate_pipeline_outputs and not forward_only
        self.losses: List[LossDict] = []
        # Auxiliary losses (MoE balancing) get the main loss's backward factor: 1/m, times the loss scale.
        scale = float(grad_scale_func(torch.ones(1)).item()) if grad_scale_func is not None else 1.0
        # Under context parallelism each rank's aux loss covers its 1/N of the tokens and DDP averages
        # over DP x CP: multiplied by N, as Megatron does.
        cp = parallel_state.get_context_parallel_world_size()
        AuxLossAutoScaler.set_loss_scale(scale if calculate_per_token_loss else scale * cp / num_microbatches)
        # On the device: the pipeline broadcast and the data-parallel sum of it must work with NCCL.
        self.total_num_tokens = torch.zeros((), dtype=torch.int64, device=device.get_device())
        watchdog.note_schedule(num_microbatches, forward_only)  # names the micro-batch of a hang

    def forward(self, data_iterator: Optional[Iterator], model: torch.nn.Module,
                input_tensor: Optional[torch.Tensor], microbatch: int, virtual_stage: int) -> torch.Tensor:
        """One forward step; on the last stage the output is the loss to back-propagate."""
        watchdog.note_step(microbatch, virtual_stage)
        with tracer.step("F", microbatch, virtual_stage):
            unwrap_model(model).set_input_tensor(input_tensor)
            output_tensor, loss_func = self.forward_step_func(data_iterator, model)
            if parallel_state.is_pipeline_last_stage():
                loss, num_tokens, reported = _run_loss_func(loss_func, output_tensor, self.num_microbatches,
                                                            self.calculate_per_token_loss)
                self.total_num_tokens += num_tokens.to(device=self.total_num_tokens.device, dtype=torch.int64)
                self.losses.append(reported)
                output_tensor = loss
        if self.forward_only:
            tracer.forward_only_done()
        return output_tensor

    def backward(self, input_tensor: Optional[torch.Tensor], output_tensor: torch.Tensor,
                 output_tensor_grad: Optional[torch.Tensor], microbatch: int, virtual_stage: int,
                 model: torch.nn.Module) -> Optional[torch.Tensor]:
        """One backward step; returns the gradient of the stage's input (None on the first stage).

        Every micro-batch but the last runs under the chunk's no_sync() (DistributedDataParallel):
        gradients accumulate, and only the last micro-batch's backward may launch reductions.
        """
        no_sync = getattr(model, "no_sync", None)
        last = microbatch == self.num_microbatches - 1
        watchdog.note_step(microbatch, virtual_stage)
        with (contextlib.nullcontext() if last or no_sync is None else no_sync()), \
                tracer.step("B", microbatch, virtual_stage):
            inputs = _tensors(input_tensor)
            for tensor in inputs:
                tensor.retain_grad()
            if output_tensor_grad is None:  # the last stage: output_tensor is the loss
                if self.grad_scale_func is not None:
                    output_tensor = self.grad_scale_func(output_tensor)
                torch.autograd.backward(output_tensor)
            else:
                _backward_through(_tensors(output_tensor), _tensors(output_tensor_grad))
            if input_tensor is None:
                return None
            # An input no output depends on (none in the models here) sends a zero gradient back.
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
            return grads if isinstance(input_tensor, list) else grads[0]

    def release(self, output_tensor, input_tensor=None) -> None:
        """Free a sent output's storage; its autograd graph (what backward needs) stays.

        Callers pass None for a loss (the model's last stage sends nothing). An output that is one
        of the stage's inputs passed on (a T5 decoder stage forwards the encoder output) is kept:
        the stage's own graph still reads it.
        """
        if not self.deallocate or output_tensor is None:
            return
        inputs = _tensors(input_tensor)
        for tensor in _tensors(output_tensor):
            if any(tensor is received for received in inputs):
                continue
            if tensor._base is not None:
                raise RuntimeError("a pipeline stage's output must not be a view of another tensor: freeing its "
                                   "storage would free the base too (return a fresh tensor from the stage)")
            tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)

    def finish(self, model: List[torch.nn.Module], finalize_model_grads_func: Optional[Callable]) -> None:
        """After the last backward: the gradient reductions (and per-token scaling)."""
        watchdog.note_step(None)
        if self.forward_only:
            return
        tokens = None
        if self.calculate_per_token_loss:
            tokens = self.total_num_tokens
            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                # Only the last stage counted tokens; every stage divides by the same number.
                group = parallel_state.get_pipeline_model_parallel_group()
                communication.broadcast(tokens, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)
        if finalize_model_grads_func is not None:
            finalize_model_grads_func(model, tokens)
        elif tokens is not None:
            scale_gradients(model, 1.0 / max(int(tokens), 1))


def _tensors(tensor) -> List[torch.Tensor]:
    """A boundary value (None, one tensor, or a list of them) as a list."""
    if tensor is None:
        return []
    return list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]


def _backward_through(outputs: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
    """Back-propagate grads into the outputs' graph, whose storage may have been released.

    torch.autograd.backward checks that each grad has its tensor's shape, which a released output
    (a 1-element placeholder) no longer has; the engine itself needs only the graph.
    """
    if len(outputs) != len(grads):
        raise RuntimeError(f"a pipeline stage sent {len(outputs)} tensors but received {len(grads)} gradients")
    if all(output.shape == grad.shape for output, grad in zip(outputs, grads)):
        torch.autograd.backward(outputs, grad_tensors=grads)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=tuple(outputs), grad_tensors=tuple(grads), keep_graph=False, create_graph=False,
        inputs=tuple(), allow_unreachable=True, accumulate_grad=True)


def _as_list(model: Union[torch.nn.Module, List[torch.nn.Module]]) -> List[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _boundary_shape(model: torch.nn.Module, seq_length: Optional[int], micro_batch_size: Optional[int]
                    ) -> Tuple[Tuple[int, int, int], torch.dtype]:
    """Shape and dtype of the tensor crossing a stage boundary: [s (/ t under SP), b, h]."""
    if seq_length is None or micro_batch_size is None:
        raise ValueError("pipelined schedules need seq_length and micro_batch_size: receivers allocate "
                         "[seq_length, micro_batch_size, hidden_size] before the data arrives")
    config = unwrap_model(model).config
    seq = seq_length // parallel_state.get_context_parallel_world_size()
    if config.sequence_parallel:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if seq % tp:
            raise ValueError(f"sequence length {seq} is not divisible by the tensor-parallel size {tp}")
        seq //= tp
    return (seq, micro_batch_size, config.hidden_size), config.params_dtype


def _boundary_shapes(model: torch.nn.Module, seq_length: Optional[int], micro_batch_size: Optional[int],
                     decoder_seq_length: Optional[int]):
    """(what this stage receives, what it sends, dtype). A model whose stages pass several tensors
    declares their sequence lengths (boundary_sequence_lengths(seq_length, decoder_seq_length) ->
    (received, sent), T5Model's); the shapes are then lists, one [s, b, h] per tensor. Otherwise
    both are the one [seq_length, b, h] shape."""
    declare = getattr(unwrap_model(model), "boundary_sequence_lengths", None)
    if declare is None:
        shape, dtype = _boundary_shape(model, seq_length, micro_batch_size)
        return shape, shape, dtype
    if seq_length is None:
        raise ValueError("pipelined schedules need seq_length: receivers allocate before the data arrives")
    received, sent = declare(seq_length, decoder_seq_length)
    dtype = unwrap_model(model).config.params_dtype
    return ([_boundary_shape(model, s, micro_batch_size)[0] for s in received],
            [_boundary_shape(model, s, micro_batch_size)[0] for s in sent], dtype)


# ------------------------------------------------------------------------------ no pipelining

def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator: Union[Iterator, List[Iterator]],
                                   model: Union[torch.nn.Module, List[torch.nn.Module]], num_microbatches: int,
                                   seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None,
                                   decoder_seq_length: Optional[int] = None, forward_only: bool = False,
                                   grad_scale_func: Optional[Callable] = None,
                                   calculate_per_token_loss: bool = False,
                                   finalize_model_grads_func: Optional[Callable] = None,
                                   deallocate_pipeline_outputs: bool = True) -> List[LossDict]:
    """Run num_microbatches forward (and backward) steps; returns each micro-batch's reported losses.

    grad_scale_func scales each loss before backward (the fp16 loss scale). After the last
    backward, finalize_model_grads_func(model_chunks, total_num_tokens or None) runs; without
    one, per-token gradients are divided by the total number of tokens here.
    """
    chunks = _as_list(model)
    if len(chunks) != 1:
        raise ValueError("virtual pipeline model chunks need the interleaved pipeline schedule")
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    run = _Run(forward_step_func, num_microbatches, forward_only, grad_scale_func, calculate_per_token_loss,
               deallocate_pipeline_outputs=False)
    for i in range(num_microbatches):
        output_tensor = run.forward(data_iterator, chunks[0], None, i, 0)
        if not forward_only:
            run.backward(None, output_tensor, None, i, 0, chunks[0])
    run.finish(chunks, finalize_model_grads_func)
    return run.losses


# ------------------------------------------------------------------------------ 1F1B

def forward_backward_pipelining_without_interleaving(
        *, forward_step_func: Callable, data_iterator: Union[Optional[Iterator], List[Optional[Iterator]]],
        model: Union[torch.nn.Module, List[torch.nn.Module]], num_microbatches: int,
        seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None,
        decoder_seq_length: Optional[int] = None, forward_only: bool = False,
        grad_scale_func: Optional[Callable] = None, calculate_per_token_loss: bool = False,
        finalize_model_grads_func: Optional[Callable] = None,
        deallocate_pipeline_outputs: bool = True) -> List[LossDict]:
    """PipeDream-Flush: warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    chunks = _as_list(model)
    if len(chunks) != 1:
        raise ValueError("the non-interleaved pipeline schedule takes one model chunk per rank, "
                         f"got {len(chunks)}")
    model_chunk = chunks[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    # A stage receives activations (and sends their gradients) in recv_shape, and sends
    # activations (and receives their gradients) in send_shape: the same unless the model declares
    # its boundaries (an encoder-decoder split, where the decoder stages pass two tensors).
    recv_shape, send_shape, dtype = _boundary_shapes(model_chunk, seq_length, micro_batch_size, decoder_seq_length)
    run = _Run(forward_step_func, num_microbatches, forward_only, grad_scale_func, calculate_per_token_loss,
               deallocate_pipeline_outputs)
    p2p = p2p_communication

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    sends = not parallel_state.is_pipeline_last_stage()  # the last stage's outputs are losses
    num_warmup = min(pp - rank - 1, num_microbatches)
    num_steady = num_microbatches - num_warmup

    inputs: List[Optional[torch.Tensor]] = []   # kept for backward, oldest first
    outputs: List[torch.Tensor] = []
    next_forward = 0                           # micro-batch ids, for the tracer and error messages
    next_backward = 0

    def forward(input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        nonlocal next_forward
        output = run.forward(data_iterator, model_chunk, input_tensor, next_forward, 0)
        next_forward += 1
        return output

    def backward(output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        nonlocal next_backward
        grad = run.backward(inputs.pop(0), outputs.pop(0), output_grad, next_backward, 0, model_chunk)
        next_backward += 1
        return grad

    for _ in range(num_warmup):
        input_tensor = p2p.recv_forward(recv_shape, dtype, Where(next_forward))
        output = forward(input_tensor)
        p2p.send_forward(output, send_shape, dtype, Where(next_forward - 1))
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output)
            run.release(output if sends else None, input_tensor)

    input_tensor = p2p.recv_forward(recv_shape, dtype, Where(next_forward)) if num_steady > 0 else None
    for i in range(num_steady):
        last = i == num_steady - 1
        output = forward(input_tensor)
        if forward_only:
            p2p.send_forward(output, send_shape, dtype, Where(next_forward - 1))
            if not last:
                input_tensor = p2p.recv_forward(recv_shape, dtype, Where(next_forward))
            continue
        output_grad = p2p.send_forward_recv_backward(output, send_shape, dtype,
                                                     Where(next_backward, sending=next_forward - 1))
        inputs.append(input_tensor)
        outputs.append(output)
        run.release(output if sends else None, input_tensor)
        input_grad = backward(output_grad)
        if last:
            input_tensor = None
            p2p.send_backward(input_grad, recv_shape, dtype, Where(next_backward - 1))
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad, recv_shape, dtype,
                                                          Where(next_forward, sending=next_backward - 1))

    if not forward_only:
        for _ in range(num_warmup):
            output_grad = p2p.recv_backward(send_shape, dtype, Where(next_backward))
            input_grad = backward(output_grad)
            p2p.send_backward(input_grad, recv_shape, dtype, Where(next_backward - 1))
    run.finish(chunks, finalize_model_grads_func)
    return run.losses


# ------------------------------------------------------------------------------ interleaved 1F1B

def forward_backward_pipelining_with_interleaving(
        *, forward_step_func: Callable, data_iterator: Union[Optional[Iterator], List[Optional[Iterator]]],
        model: Union[torch.nn.Module, List[torch.nn.Module]], num_microbatches: int,
        seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None,
        decoder_seq_length: Optional[int] = None, forward_only: bool = False,
        grad_scale_func: Optional[Callable] = None, calculate_per_token_loss: bool = False,
        finalize_model_grads_func: Optional[Callable] = None,
        deallocate_pipeline_outputs: bool = True) -> List[LossDict]:
    """1F1B over v model chunks per rank (Narayanan et al. 2021, sec. 2.2).

    Steps are numbered k = 0 .. v*m - 1 on every rank. Micro-batches go through in groups of pp:
    step k runs micro-batch (k // (pp*v)) * pp + k % pp on chunk (k % (pp*v)) // pp going
    forward, and on chunk v - 1 - that going backward. Rank p runs (pp - p - 1) * 2 + (v - 1) * pp
    warm-up forwards (all of them when m == pp), then alternates, then drains the backwards.
    A chunk's output goes to the next rank, and the last rank's to rank 0's next chunk (a ring).
    """
    chunks = _as_list(model)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    v = len(chunks)
    if v < 2:
        raise ValueError("the interleaved schedule needs at least 2 model chunks per rank")
    if parallel_state.get_virtual_pipeline_model_parallel_world_size() != v:
        raise ValueError(f"{v} model chunks but the virtual pipeline size is "
                         f"{parallel_state.get_virtual_pipeline_model_parallel_world_size()}")
    if num_microbatches % pp:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({num_microbatches}) to be a "
                         f"multiple of the pipeline-parallel size ({pp})")
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator] * v
    if len(iterators) != v:
        raise ValueError(f"the interleaved schedule takes one data iterator per model chunk ({v}), got {len(iterators)}")
    if getattr(unwrap_model(chunks[0]), "boundary_sequence_lengths", None) is not None:
        raise ValueError(f"{type(unwrap_model(chunks[0])).__name__} declares its own pipeline boundaries, which "
                         "the interleaved schedule does not take")
    shape, dtype = _boundary_shape(chunks[0], seq_length, micro_batch_size)
    run = _Run(forward_step_func, num_microbatches, forward_only, grad_scale_func, calculate_per_token_loss,
               deallocate_pipeline_outputs)
    p2p = p2p_communication
    set_chunk = parallel_state.set_virtual_pipeline_model_parallel_rank

    rank = parallel_state.get_pipeline_model_parallel_rank()
    total = num_microbatches * v
    all_warmup = forward_only or num_microbatches == pp
    num_warmup = total if all_warmup else min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    num_steady = total - num_warmup

    inputs: List[List[Optional[torch.Tensor]]] = [[] for _ in range(v)]
    outputs: List[List[torch.Tensor]] = [[] for _ in range(v)]
    output_grads: List[List[Optional[torch.Tensor]]] = [[] for _ in range(v)]

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (pp * v)) // pp
        return c if forward else v - 1 - c

    def microbatch_of(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    def forward_step(k: int) -> torch.Tensor:
        c = chunk_of(k, forward=True)
        set_chunk(c)
        if parallel_state.is_pipeline_first_stage() and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)  # the first stage reads its input from the data
        output = run.forward(iterators[c], chunks[c], inputs[c][-1], microbatch_of(k), c)
        outputs[c].append(output)
        if forward_only:  # nothing is kept for a backward step
            inputs[c].pop()
            outputs[c].pop()
        return output

    def backward_step(k: int) -> Optional[torch.Tensor]:
        c = chunk_of(k, forward=False)
        set_chunk(c)
        if parallel_state.is_pipeline_last_stage() and not output_grads[c]:
            output_grads[c].append(None)  # the loss: no gradient comes from a next stage
        return run.backward(inputs[c].pop(0), outputs[c].pop(0), output_grads[c].pop(0), microbatch_of(k), c,
                            chunks[c])

    def where(k: int, forward: bool) -> Where:
        return Where(microbatch_of(k) if 0 <= k < total else None,
                     chunk_of(k, forward) if 0 <= k < total else None)

    # Warm-up: forwards only; the last one also receives the first gradient (unless all warm-up).
    set_chunk(0)
    inputs[0].append(p2p.recv_forward(shape, dtype, where(0, True)))
    for k in range(num_warmup):
        output = forward_step(k)
        c = chunk_of(k, forward=True)
        next_c = chunk_of(k + 1, forward=True)
        recv_prev = not (parallel_state.is_pipeline_first_stage(ignore_virtual=True) and next_c == 0)
        if k == total - 1:
            recv_prev = False
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and c == v - 1:
            output = None  # the model's last stage: its output is the loss, sent nowhere
        if k == num_warmup - 1 and not all_warmup:
            recv_next = not parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
                output, None, recv_prev, recv_next, shape, dtype, where(k + 1, True))
            output_grads[v - 1].append(output_grad)
        else:
            input_tensor = p2p.send_forward_recv_forward(output, recv_prev, shape, dtype, where(k + 1, True))
        inputs[next_c].append(input_tensor)
        run.release(output)

    # Steady state: forward step k + num_warmup, backward step k, one exchange for both.
    for k in range(num_steady):
        forward_k = k + num_warmup
        output = forward_step(forward_k)
        input_grad = backward_step(k)

        set_chunk(chunk_of(forward_k, forward=True))
        if parallel_state.is_pipeline_last_stage():
            output = None
        set_chunk(chunk_of(k, forward=False))
        if parallel_state.is_pipeline_first_stage():
            input_grad = None

        # What arrives next: on the first rank the last rank's output, which lags pp - 1 steps and
        # feeds the following chunk; on the last rank, likewise for gradients from the first.
        recv_prev = True
        if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
            next_forward_c = chunk_of(forward_k - (pp - 1), forward=True)
            if next_forward_c == v - 1:
                recv_prev = False
            next_forward_c += 1
        else:
            next_forward_c = chunk_of(forward_k + 1, forward=True)
        recv_next = True
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            next_backward_c = chunk_of(k - (pp - 1), forward=False)
            if next_backward_c == 0:
                recv_next = False
            next_backward_c -= 1
        else:
            next_backward_c = chunk_of(k + 1, forward=False)
        if k == num_steady - 1:
            recv_prev = False

        input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
            output, input_grad, recv_prev, recv_next, shape, dtype, where(k + 1, False))
        run.release(output)
        if recv_prev:
            inputs[next_forward_c].append(input_tensor)
        if recv_next:
            output_grads[next_backward_c].append(output_grad)

    # Cool-down: the remaining backwards.
    if not forward_only:
        if all_warmup:
            set_chunk(v - 1)
            output_grads[v - 1].append(p2p.recv_backward(shape, dtype, where(0, False)))
        for k in range(num_steady, total):
            input_grad = backward_step(k)
            next_c = chunk_of(k + 1, forward=False)
            recv_next = not (parallel_state.is_pipeline_last_stage(ignore_virtual=True) and next_c == v - 1)
            if k == total - 1:
                recv_next = False
            output_grads[next_c].append(
                p2p.send_backward_recv_backward(input_grad, recv_next, shape, dtype, where(k + 1, False)))
    set_chunk(0)
    run.finish(chunks, finalize_model_grads_func)
    return run.losses


def get_forward_backward_func(pipeline_model_parallel_size: Optional[int] = None,
                              virtual_pipeline_model_parallel_size: Optional[int] = None) -> Callable[..., List[Any]]:
    """The schedule for this rank's pipeline layout (from parallel_state unless given)."""
    pp = (parallel_state.get_pipeline_model_parallel_world_size() if pipeline_model_parallel_size is None
          else pipeline_model_parallel_size)
    vpp = (parallel_state.get_virtual_pipeline_model_parallel_world_size()
           if virtual_pipeline_model_parallel_size is None and pipeline_model_parallel_size is None
           else virtual_pipeline_model_parallel_size)
    if pp == 1:
        return forward_backward_no_pipelining
    if vpp is not None and vpp > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
