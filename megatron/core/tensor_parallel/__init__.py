"""Tensor (and sequence) parallelism: split layers, region mappings, vocab-parallel loss, RNG streams,
activation recompute (checkpoint)."""

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.data import broadcast_data
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.layout import (
    gather_tensor_parallel,
    merge_shards,
    shard_for_rank,
    without_duplicate_rows,
)
from megatron.core.tensor_parallel.mappings import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (
    CudaRNGStatesTracker,
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_rng_tracker,
    make_viewless_tensor,
    model_parallel_cuda_manual_seed,
)
from megatron.core.tensor_parallel.utils import (
    VocabUtility,
    divide,
    split_tensor_along_last_dim,
)

__all__ = [
    "ColumnParallelLinear",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabUtility",
    "all_to_all",
    "broadcast_data",
    "checkpoint",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "divide",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_tensor_parallel",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "merge_shards",
    "model_parallel_cuda_manual_seed",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "shard_for_rank",
    "split_tensor_along_last_dim",
    "vocab_parallel_cross_entropy",
    "without_duplicate_rows",
]
