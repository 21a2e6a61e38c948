"""finalize_model_grads: the gradient reductions between the last backward and the optimizer step.

In this order (Megatron's):
    1. data-parallel reduction: DistributedDataParallel.finish_grad_sync on each chunk waits for
       (or runs) every bucket's all-reduce, or reduce-scatter with the distributed optimizer.
    2. sequence-parallel reduction: parameters replicated on every tensor-parallel rank but fed
       only this rank's s/t tokens under --sequence-parallel (layer norms, row-parallel biases,
       marked `param.sequence_parallel`) hold partial gradients; they are summed over the TP
       group in one flat all-reduce.
    2b. replicated key/value rows (fewer query groups than TP ranks): summed over the ranks
       holding the same group (allreduce_replicated_kv_grads).
    3. embedding-group reduction (pipeline parallelism with tied input/output embeddings): the
       first stage's word embedding and the last stage's copy of it are one logical weight; their
       gradients are summed over the embedding group, so both copies take the same step. An
       encoder-decoder split (T5) adds the first decoder stage's copy to the group, and sums the
       learned position table of its first encoder and first decoder stage likewise, and a
       stack's relative position table over the stack's stages.
    3b. the MoE routers' aux-loss-free expert bias (update_router_expert_bias): not a gradient, but
       Megatron updates it here, once per global batch, from the step's token counts.
    4. per-token normalisation (--calculate-per-token-loss): gradients divided by the number of
       loss tokens of the global batch (each replica's count summed over the data-parallel group;
       DistributedDataParallel summed, not averaged, the replicas' gradients).

Steps 2 and 3 are sums, so they commute with the data-parallel sum. With the distributed
optimizer only this rank's shard of each bucket holds the reduced gradient; TP ranks share one
buffer layout, and the pipeline-shared embedding sits in a bucket of its own on both stages, so
the shard ranges match across the groups summed in steps 2 and 3.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from megatron.core import communication, device, parallel_state
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel, split_position_embedding
from megatron.core.utils import unwrap_model


def _grad_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient the optimizer will read: the fp32 main_grad when there is one, else .grad."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def allreduce_sequence_parallel_grads(model_chunks: List[nn.Module]) -> None:
    """Sum the partial gradients of `sequence_parallel` parameters over the tensor-parallel group."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [grad for chunk in model_chunks for param in chunk.parameters()
             if param.requires_grad and getattr(param, "sequence_parallel", False)
             and (grad := _grad_of(param)) is not None]
    if not grads:
        return
    by_dtype: dict = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same_dtype])  # one collective instead of one per tensor
        communication.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
        offset = 0
        for grad in same_dtype:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def allreduce_replicated_kv_grads(model_chunks: List[nn.Module]) -> None:
    """Sum the gradients of replicated key/value rows over the ranks that hold the same query group.

    With fewer query groups than tensor-parallel ranks (multi-query attention under TP) a group's
    K/V rows of linear_qkv sit on several ranks, each computing a partial gradient from its own
    query heads (param.replicated_kv_rows = (first row, end row, group, groups)). One all-reduce
    over the TP group of a [groups, rows, ...] buffer where each rank fills its group's slot sums
    every group over exactly its replicas; each rank then takes its slot back.
    """
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    for chunk in model_chunks:
        for param in chunk.parameters():
            rows = getattr(param, "replicated_kv_rows", None)
            grad = _grad_of(param) if rows is not None and param.requires_grad else None
            if grad is None:
                continue
            start, end, group, groups = rows
            slots = grad.new_zeros((groups, end - start) + tuple(grad.shape[1:]))
            slots[group] = grad[start:end]
            communication.all_reduce(slots, group=parallel_state.get_tensor_model_parallel_group())
            grad[start:end] = slots[group]


def allreduce_embedding_grads(model_chunks: List[nn.Module]) -> None:
    """Sum the tied embedding's gradient over the first and last pipeline stages."""
    if (parallel_state.get_pipeline_model_parallel_world_size() == 1
            or not parallel_state.is_rank_in_embedding_group(ignore_virtual=True)):
        return
    # The embedding lives in the first chunk of the first stage, the output copy in the last
    # chunk of the last stage.
    if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
        chunk = unwrap_model(model_chunks[0])
    else:
        chunk = unwrap_model(model_chunks[-1])
    if not getattr(chunk, "share_embeddings_and_output_weights", False):
        return
    grad = _grad_of(chunk.shared_embedding_or_output_weight())
    if grad is not None:
        communication.all_reduce(grad, group=parallel_state.get_embedding_group())


def allreduce_position_embedding_grads(model_chunks: List[nn.Module]) -> None:
    """Sum the learned position table's gradient over the first encoder and first decoder stage
    (an encoder-decoder pipeline split holds the table on both)."""
    if (parallel_state.get_pipeline_model_parallel_world_size() == 1
            or not parallel_state.is_rank_in_position_embedding_group()):
        return
    table = split_position_embedding(unwrap_model(model_chunks[0]))
    grad = _grad_of(table) if table is not None else None
    if grad is not None:
        communication.all_reduce(grad, group=parallel_state.get_position_embedding_group())


def allreduce_pipeline_stack_grads(model_chunks: List[nn.Module]) -> None:
    """Sum the gradients of the parameters every stage of a stack holds (T5's relative position
    tables, marked pipeline_stack_shared) over the stack's pipeline stages."""
    if (parallel_state.get_pipeline_model_parallel_world_size() == 1
            or parallel_state.get_pipeline_stack_world_size() == 1):
        return
    for chunk in model_chunks:
        for param in unwrap_model(chunk).parameters():
            grad = _grad_of(param) if getattr(param, "pipeline_stack_shared", False) else None
            if grad is not None:
                communication.all_reduce(grad, group=parallel_state.get_pipeline_stack_group())


def scale_gradients(model_chunks: List[nn.Module], factor: float) -> None:
    """Multiply every gradient by factor."""
    for chunk in model_chunks:
        for param in chunk.parameters():
            grad = _grad_of(param)
            if grad is not None:
                grad.mul_(factor)


def _check_normalisation(model_chunks: List[nn.Module], per_token: bool) -> None:
    """The schedule's normalisation must be the one each DistributedDataParallel chunk was built for:
    DDP sums per-token gradients over the replicas but pre-scales the others by 1/d, so a mismatch
    would divide by the data-parallel size twice (or not at all)."""
    for chunk in model_chunks:
        if isinstance(chunk, DistributedDataParallel) and chunk.config.calculate_per_token_loss != per_token:
            raise ValueError(
                f"the schedule ran with calculate_per_token_loss={per_token} but DistributedDataParallel was "
                f"built with config.calculate_per_token_loss={chunk.config.calculate_per_token_loss}: set the "
                "model config's field to the schedule's (core_transformer_config_from_args does)")


def _token_count_group(model_chunks: List[nn.Module]) -> Optional[torch.distributed.ProcessGroup]:
    """The group the chunks' gradients were summed over: DistributedDataParallel's (it may have been
    given one), else parallel_state's data-parallel group (with context parallelism)."""
    groups = [chunk.data_parallel_group for chunk in model_chunks if isinstance(chunk, DistributedDataParallel)]
    if not groups:
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
    if any(group is not groups[0] for group in groups):
        raise ValueError("the model chunks reduce their gradients over different data-parallel groups")
    return groups[0]


def divide_by_global_token_count(model_chunks: List[nn.Module], num_tokens: torch.Tensor) -> None:
    """Divide every gradient by num_tokens summed over the data-parallel group (per-token loss).

    Every replica's gradient is a sum over its own loss tokens and DDP summed them, so this makes
    the gradient of (sum of all loss tokens' losses) / (their count) over the global batch.
    """
    # [1] int64, on the device: NCCL reduces only accelerator tensors
    total = torch.as_tensor(num_tokens).to(device=device.get_device(), dtype=torch.int64).reshape(1).clone()
    group = _token_count_group(model_chunks)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        communication.all_reduce(total, group=group)
    count = int(total.item())
    if count > 0:  # no loss token anywhere: the gradients are zero already (Megatron skips too)
        scale_gradients(model_chunks, 1.0 / count)


def update_router_expert_bias(model_chunks: List[nn.Module]) -> None:
    """The aux-loss-free balancing step of every MoE router with an expert bias (Megatron-Core's
    _update_router_expert_bias): its token counts of the step's micro-batches are summed over the
    TP x CP x DP ranks (all that saw other tokens of the global batch), then

        expert_bias += rate * sign(mean_e(count) - count)       (rate: moe_router_bias_update_rate)

    so an expert that got fewer tokens than the mean is favoured next step, and every replica
    keeps the same bias. The counts are zeroed for the next step."""
    routers = [module for chunk in model_chunks for module in chunk.modules()
               if getattr(module, "expert_bias", None) is not None]
    if not routers:  # a dense model, or a pipeline stage without MoE layers
        return
    counts = torch.stack([router.local_tokens_per_expert for router in routers])  # [L, E] fp32
    for group in (parallel_state.get_tensor_and_data_parallel_group(),
                  parallel_state.get_context_parallel_group()):
        if group is not None and torch.distributed.get_world_size(group) > 1:
            communication.all_reduce(counts, group=group)  # [L, E], summed over TP x DP, then CP
    offset = counts.sum(dim=-1, keepdim=True) / counts.shape[-1] - counts  # [L, E]
    with torch.no_grad():
        for router, step in zip(routers, torch.sign(offset)):
            router.expert_bias += step * router.config.moe_router_bias_update_rate
            router.local_tokens_per_expert.zero_()


def finalize_model_grads(model_chunks: List[nn.Module], num_tokens: Optional[torch.Tensor] = None) -> None:
    """Run the reductions above; num_tokens (per-token loss only) is this replica's token count.

    Order as in Megatron: the data-parallel reduction first (DistributedDataParallel chunks: wait
    for, or run, every bucket's all-reduce / reduce-scatter), then the tensor-parallel and
    pipeline reductions on the data-parallel result, then the per-token division by the global
    batch's token count (summed over the data-parallel group the gradients were summed over).
    """
    _check_normalisation(model_chunks, per_token=num_tokens is not None)
    for chunk in model_chunks:
        finish = getattr(chunk, "finish_grad_sync", None)
        if finish is not None:
            finish()
    allreduce_sequence_parallel_grads(model_chunks)
    allreduce_replicated_kv_grads(model_chunks)
    allreduce_embedding_grads(model_chunks)
    allreduce_position_embedding_grads(model_chunks)
    allreduce_pipeline_stack_grads(model_chunks)
    update_router_expert_bias(model_chunks)
    if num_tokens is not None:
        divide_by_global_token_count(model_chunks, num_tokens)
