"""Forward/backward schedules over the micro-batches of one global batch.

Only the no-pipelining schedule exists so far: each micro-batch runs forward then backward,
and gradients accumulate in the parameters. The pipelined schedules (1F1B, interleaved) join
this module with the pipeline-parallel issue and share its forward_step/backward_step.

The loss function returned by a forward step may give
    (loss, {name: reported})                   -> loss is the micro-batch's mean; the schedule
                                                 divides it by num_microbatches;
    (loss_sum, num_tokens, {name: [sum, n]})   -> Megatron-Core's form. By default the schedule
                                                 divides loss_sum by num_tokens and by
                                                 num_microbatches (each micro-batch weighs the
                                                 same); with calculate_per_token_loss it keeps
                                                 the sum, and gradients are divided by the total
                                                 number of tokens of the global batch afterwards
                                                 (every token weighs the same).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch

from megatron.core.distributed.finalize_model_grads import scale_gradients

LossDict = Dict[str, torch.Tensor]


def _run_loss_func(loss_func: Callable, output_tensor: torch.Tensor, num_microbatches: int,
                   calculate_per_token_loss: bool) -> tuple[torch.Tensor, torch.Tensor, LossDict]:
    """Apply the loss function; returns (loss to back-propagate, num_tokens, reported values)."""
    outputs = loss_func(output_tensor)
    if len(outputs) == 3:
        loss, num_tokens, reported = outputs
        num_tokens = torch.as_tensor(num_tokens).detach()
        if not calculate_per_token_loss:
            loss = loss / num_tokens.clamp(min=1) / num_microbatches
        return loss, num_tokens, reported
    if len(outputs) == 2:
        if calculate_per_token_loss:
            raise ValueError("--calculate-per-token-loss needs a loss function returning "
                             "(loss_sum, num_tokens, {name: [sum, num_tokens]})")
        loss, reported = outputs
        return loss / num_microbatches, torch.tensor(1), reported
    raise ValueError(f"a loss function must return 2 or 3 values, got {len(outputs)}")


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator: Union[Iterator, List[Iterator]],
                                   model: Union[torch.nn.Module, List[torch.nn.Module]], num_microbatches: int,
                                   seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None,
                                   decoder_seq_length: Optional[int] = None, forward_only: bool = False,
                                   grad_scale_func: Optional[Callable] = None,
                                   calculate_per_token_loss: bool = False,
                                   finalize_model_grads_func: Optional[Callable] = None) -> List[LossDict]:
    """Run num_microbatches forward (and backward) steps; returns each micro-batch's reported losses.

    grad_scale_func scales each loss before backward (the fp16 loss scale). After the last
    backward, finalize_model_grads_func(model_chunks, total_num_tokens or None) runs; without
    one, per-token gradients are divided by the total number of tokens here.
    """
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("virtual pipeline model chunks need the interleaved pipeline schedule")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    losses: List[LossDict] = []
    total_num_tokens = torch.zeros((), dtype=torch.int64)
    for _ in range(num_microbatches):
        output_tensor, loss_func = forward_step_func(data_iterator, model)
        loss, num_tokens, reported = _run_loss_func(loss_func, output_tensor, num_microbatches,
                                                    calculate_per_token_loss)
        total_num_tokens += num_tokens.to(torch.int64).cpu()
        losses.append(reported)
        if not forward_only:
            if grad_scale_func is not None:
                loss = grad_scale_func(loss)
            loss.backward()
    if not forward_only:
        tokens = total_num_tokens if calculate_per_token_loss else None
        if finalize_model_grads_func is not None:
            finalize_model_grads_func([model], tokens)
        elif tokens is not None:
            scale_gradients([model], 1.0 / max(int(tokens), 1))
    return losses


def get_forward_backward_func(pipeline_model_parallel_size: int = 1) -> Callable[..., List[Any]]:
    """The schedule for the pipeline size: no pipelining for 1."""
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    raise ValueError(f"pipeline model parallel size {pipeline_model_parallel_size}: "
                     "pipelined schedules are not available yet")
