"""Auxiliary losses that ride on activations (MoE load balancing, router z-loss) and their log record.

A layer that adds an auxiliary loss L_aux to the objective does not return it: it attaches it
to one of its activations with AuxLossAutoScaler.apply(activation, L_aux), the identity in
forward, whose backward also hands L_aux the gradient `backward_scale` (Megatron-Core's
MoEAuxLossAutoScaler). The schedule sets that scale to what the main loss is multiplied by
before its backward: 1 / num_microbatches (1 with per-token loss) times the fp16 loss scale.
So the gradients are those of main_loss + sum of aux losses, with no change to the loss
functions, the pipeline schedules or the reported LM loss.

The record (`record_loss`, `record_tokens`) keeps, per 1-based layer number, the detached
values each micro-batch adds (a layer's value of this rank's tokens, on its device: no host sync), and `collect` sums them
over every rank (one all-reduce) at each iteration for the log line (training_log). What a
value means (a sum or a mean over ranks) is said by the `divide_by` the recorder gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron.core import communication


class AuxLossAutoScaler(torch.autograd.Function):
    """forward(activation, aux_loss) -> activation; backward gives aux_loss the gradient backward_scale."""

    backward_scale: float = 1.0

    @staticmethod
    def forward(ctx, activation: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return activation

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, AuxLossAutoScaler.backward_scale)

    @staticmethod
    def set_loss_scale(scale: float) -> None:
        """The factor the main loss gets before backward (the schedule calls this)."""
        AuxLossAutoScaler.backward_scale = float(scale)


@dataclass
class _Record:
    losses: dict[str, torch.Tensor] = field(default_factory=dict)      # name -> [L] float32
    routed: torch.Tensor | None = None                                 # [L, E] tokens the router chose
    kept: torch.Tensor | None = None                                   # [L, E] tokens the experts ran


_RECORD = _Record()


def _grow(tensor: torch.Tensor | None, shape: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
    """`tensor` with `shape` (zeros where it had none), on its device (else `device`, else the CPU)."""
    if tensor is not None and tuple(tensor.shape) == shape:
        return tensor
    grown = torch.zeros(shape, dtype=torch.float32, device=tensor.device if tensor is not None else device)
    if tensor is not None:  # (a record made with another layer count: keep what both cover)
        overlap = tuple(slice(0, min(a, b)) for a, b in zip(shape, tensor.shape))
        grown[overlap] = tensor[overlap]
    return grown


def record_loss(name: str, layer_number: int, num_layers: int, value: torch.Tensor, divide_by: int = 1) -> None:
    """Add a layer's aux-loss value (without its coefficient) for this micro-batch; `divide_by`: over
    how many ranks per data-parallel replica the summed values make one value (1: they add up to it)."""
    if layer_number is None:
        return
    # On the value's device, without reading it back: no host sync per layer and micro-batch.
    losses = _grow(_RECORD.losses.get(name), (num_layers,), value.device)
    losses[layer_number - 1] += value.detach().float() / divide_by
    _RECORD.losses[name] = losses


def record_tokens(layer_number: int, num_layers: int, routed: torch.Tensor, kept: torch.Tensor) -> None:
    """Add a layer's per-expert token counts of this rank's tokens (routed: chosen by the router;
    kept: left after capacity dropping)."""
    if layer_number is None:
        return
    experts = routed.numel()
    _RECORD.routed = _grow(_RECORD.routed, (num_layers, experts), routed.device)
    _RECORD.kept = _grow(_RECORD.kept, (num_layers, experts), kept.device)
    _RECORD.routed[layer_number - 1] += routed.detach().float()
    _RECORD.kept[layer_number - 1] += kept.detach().float()


def has_records() -> bool:
    return bool(_RECORD.losses) or _RECORD.routed is not None


def clear() -> None:
    """Forget the values recorded so far (after each collect, and between runs)."""
    global _RECORD
    _RECORD = _Record()


@dataclass
class MoEStats:
    """One iteration's values, summed over every rank: losses per layer (already divided as their
    recorders said, and by the data-parallel size and micro-batch count), token counts per layer."""

    losses: dict[str, torch.Tensor]
    routed: torch.Tensor | None
    kept: torch.Tensor | None


def collect(names: list[str], num_layers: int, num_experts: int, data_parallel_size: int, num_microbatches: int,
            group: torch.distributed.ProcessGroup | None = None, device: torch.device | None = None) -> MoEStats:
    """Sum the record over `group` (None: the world, when distributed) in one all-reduce and clear it.

    Every rank calls this (a collective) with the same names, num_layers and num_experts (from the
    config): a rank that recorded nothing (a pipeline stage without MoE layers) contributes zeros.
    """
    experts = num_experts
    parts = [_grow(_RECORD.losses.get(name), (num_layers,)) for name in names]
    if experts:
        parts += [_grow(_RECORD.routed, (num_layers, experts)).reshape(-1),
                  _grow(_RECORD.kept, (num_layers, experts)).reshape(-1)]
    flat = torch.cat([part.to(device) for part in parts]) if parts else torch.zeros(0)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and flat.numel():
        communication.all_reduce(flat, group=group)  # (on `device`: NCCL reduces only accelerator tensors)
    flat = flat.cpu()
    losses, offset = {}, 0
    for name in names:
        losses[name] = flat[offset:offset + num_layers] / (data_parallel_size * num_microbatches)
        offset += num_layers
    routed = kept = None
    if experts:
        routed = flat[offset:offset + num_layers * experts].reshape(num_layers, experts)
        offset += num_layers * experts
        kept = flat[offset:offset + num_layers * experts].reshape(num_layers, experts)
    clear()
    return MoEStats(losses, routed, kept)
