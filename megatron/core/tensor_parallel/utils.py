"""Partition arithmetic shared by the tensor-parallel layers."""

from __future__ import annotations

import torch


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator as an int; ValueError naming both when it does not divide."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """[..., n] -> num_partitions views [..., n / num_partitions] (copies if contiguous_split_chunks)."""
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


class VocabUtility:
    """Which rows of the (padded) vocabulary a tensor-parallel rank holds: [first, last).

    The padded vocabulary divides evenly by the TP size (the tokenizer's vocabulary is padded to
    a multiple of make_vocab_size_divisible_by x TP), so rank r holds rows [r v/t, (r + 1) v/t).
    """

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)
