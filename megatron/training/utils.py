"""Small helpers of the training framework, under Megatron-LM's megatron.training.utils names.

The rank-aware print helpers live in megatron.core.utils (the lower layers print through them
too, and never import this package); they are imported here under the names Megatron's scripts
import from megatron.training.utils. Also Megatron's batch helpers that Accelerate and recipes
written for Megatron call: get_ltor_masks_and_position_ids, average_losses_across_data_parallel_group,
calc_params_l2_norm, report_memory.
"""

from __future__ import annotations

import datetime
import resource
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from megatron.core.utils import (  # noqa: F401  (Megatron's megatron.training.utils names)
    get_rank_safe,
    get_world_size_safe,
    is_last_rank,
    print_line,
    print_rank_0,
    print_rank_last,
)
from megatron.core import communication, device, parallel_state
from megatron.core.context_parallel import split_for_cp_rank


def print_datetime(string: str) -> None:
    """Megatron's '[string] datetime: YYYY-MM-DD HH:MM:SS' marker line."""
    print_rank_0(f"[{string}] datetime: {timestamp()} ")


def timestamp() -> str:
    """Local time as Megatron prints it in its log lines: 'YYYY-MM-DD HH:MM:SS'."""
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")


def get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int, pad_token: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool, pad_mask_loss: bool,
                                    create_attention_mask: bool = True
                                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-to-right masks of a batch, Megatron-LM's (core_v0.15+ signature; create_attention_mask is
    its latest addition): (attention_mask bool [b or 1, 1, s, s], True = masked, or None without
    create_attention_mask; loss_mask float [b, s]; position_ids long [b, s]) for data [b, s].

    The mask is one causal [1, 1, s, s] shared by the batch, or per sample [b, 1, s, s] with
    reset_attention_mask (no attending across an eod; the eod belongs to the document it ends).
    reset_position_ids restarts positions after each eod. eod_mask_loss / pad_mask_loss zero the loss
    on eod / pad tokens. Documents end at eod tokens only: Megatron's loop intersects the eod and pad
    positions (`&` of two index lists), which is the eod positions when pad_token == eod_token (as
    Accelerate passes it) and fails or misplaces the resets otherwise; pad tokens here only mask the loss.
    """
    if reset_attention_mask and not create_attention_mask:
        raise ValueError("get_ltor_masks_and_position_ids: reset_attention_mask needs create_attention_mask")
    batch, seq = data.shape
    loss_mask = torch.ones((batch, seq), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    if pad_mask_loss:
        loss_mask[data == pad_token] = 0.0
    positions = torch.arange(seq, dtype=torch.long, device=data.device)  # [s]
    position_ids = positions.unsqueeze(0).expand_as(data)  # [b, s], a view as in Megatron
    if reset_position_ids or reset_attention_mask:
        is_eod = (data == eod_token).long()
        document = torch.cumsum(is_eod, dim=1) - is_eod  # [b, s]: eods strictly before each position
    if reset_position_ids:
        starts = torch.ones((batch, seq), dtype=torch.bool, device=data.device)
        starts[:, 1:] = document[:, 1:] != document[:, :-1]  # first position of each document
        first = torch.cummax(torch.where(starts, positions, torch.zeros_like(positions)), dim=1).values
        position_ids = position_ids - first  # [b, s]
    attention_mask = None
    if create_attention_mask:
        causal = torch.ones((seq, seq), dtype=torch.bool, device=data.device).triu(1)  # [s, s] True above diagonal
        if reset_attention_mask:
            attention_mask = (causal | (document[:, :, None] != document[:, None, :])).unsqueeze(1)  # [b, 1, s, s]
        else:
            attention_mask = causal.view(1, 1, seq, seq)
    return attention_mask, loss_mask, position_ids


def get_batch_on_this_cp_rank(batch: Dict[str, Optional[torch.Tensor]]) -> Dict[str, Optional[torch.Tensor]]:
    """Megatron's: this context-parallel rank's tokens of every tensor of the batch, load-balanced
    (the sequence in 2N chunks, rank r keeping chunks r and 2N-1-r; megatron/core/context_parallel.py).

    Tensors are [b, s] (tokens, labels, loss_mask, position_ids) and cut along dim 1; an attention
    mask [b, 1, s, s] keeps this rank's query rows (dim 2) and every key. A packed batch's
    cu_seqlens [b, s + 1] (the uncut row's document boundaries) is kept whole: the model cuts the
    masks and positions it makes from them. None values pass through; the batch is returned
    unchanged when the CP size is 1.
    """
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return batch
    rank = parallel_state.get_context_parallel_rank()
    return {key: value if value is None or key == "cu_seqlens"
            else split_for_cp_rank(value, 2 if key == "attention_mask" else 1, cp, rank)
            for key, value in batch.items()}


def average_losses_across_data_parallel_group(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """Megatron's: the losses (each one value) as one detached [n] tensor, averaged over the
    data-parallel group (a collective there; nothing to reduce with one data-parallel rank)."""
    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])  # [n]
    world = parallel_state.get_data_parallel_world_size()
    if world > 1:
        communication.all_reduce(averaged, group=parallel_state.get_data_parallel_group())
    return averaged / world


def calc_params_l2_norm(model: Union[torch.nn.Module, List[torch.nn.Module]],
                        force_create_fp32_copy: bool = False) -> float:
    """Megatron's L2 norm of the model's parameters (a collective over the model-parallel groups;
    megatron.core.optimizer.optimizer.params_norm). Under --bf16 it reads the optimizer's fp32 main
    parameters, as Megatron does, unless force_create_fp32_copy asks for the model's own values
    converted; parameters without a main copy (the distributed optimizer shards its copies) are
    read from the model. Accumulated in fp64 here, where Megatron's kernel sums in fp32."""
    from megatron.core.optimizer.optimizer import params_norm
    from megatron.training.global_vars import get_args

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return params_norm(chunks, use_main_params=bool(get_args().bf16) and not force_create_fp32_copy)


def report_memory(name: str) -> None:
    """Megatron's '[Rank r] <name> memory (MB) | allocated: ... | max reserved: ...' line, printed by
    data-parallel rank 0 of each model-parallel group. On a CPU, which has no accelerator allocator
    to report, the line gives this process's peak resident memory instead."""
    mega_bytes = 1024.0 * 1024.0
    stats = device.memory_stats()
    line = name + " memory (MB)"
    if stats:
        line += " | allocated: {}".format(stats["allocated_bytes"] / mega_bytes)
        line += " | max allocated: {}".format(stats["max_allocated_bytes"] / mega_bytes)
        line += " | reserved: {}".format(stats["reserved_bytes"] / mega_bytes)
        line += " | max reserved: {}".format(stats["max_reserved_bytes"] / mega_bytes)
    else:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        line += " | max resident (process): {}".format(peak_kib / 1024.0)
    if parallel_state.get_data_parallel_rank() == 0:
        print_line("[Rank {}] {}".format(get_rank_safe(), line))
