"""The index arithmetic of megatron.core.tensor_parallel.layout, without processes: each layout's
shards (as the layers draw them) merge back into the whole tensor, and shard_for_rank inverts it."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import _init_partition
from megatron.core.tensor_parallel.layout import (
    merge_shards,
    partition_indices,
    shard_for_rank,
    strided_partition_indices,
    without_duplicate_rows,
)
from megatron.model.attention import qkv_partition_rows


def _attrs(dim: int, stride: int = 1, rows=None) -> dict:
    attrs = {"tensor_model_parallel": True, "partition_dim": dim, "partition_stride": stride}
    if rows is not None:
        attrs["partition_rows"] = rows
    return attrs


def _drawn_shard(monkeypatch, full_shape, dim, stride, tp, rank, rows=None) -> torch.Tensor:
    """What the layers' _init_partition keeps on `rank` of `tp` (the init draws arange values)."""
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: rank)
    local_shape = list(full_shape)
    local_shape[dim] = len(rows) if rows is not None else full_shape[dim] // tp
    weight = torch.empty(local_shape)
    values = torch.arange(full_shape[0] * full_shape[1], dtype=torch.float32).view(full_shape)
    _init_partition(weight, full_shape, dim, stride, lambda t: t.copy_(values), rows)
    return weight


def test_strided_indices():
    assert strided_partition_indices(3, tp=2, rank=1) == [3, 4, 5]
    # stride 2, t = 2: 4 blocks of 2; rank 0 keeps blocks 0 and 2, rank 1 blocks 1 and 3
    assert strided_partition_indices(4, tp=2, rank=0, stride=2) == [0, 1, 4, 5]
    assert strided_partition_indices(4, tp=2, rank=1, stride=2) == [2, 3, 6, 7]
    with pytest.raises(ValueError):
        strided_partition_indices(3, tp=2, rank=0, stride=2)


@pytest.mark.parametrize("dim, stride, tp", [(0, 1, 2), (1, 1, 4), (0, 2, 2), (0, 2, 4), (0, 3, 2)],
                         ids=["column", "row", "swiglu-t2", "swiglu-t4", "stride3"])
def test_layer_shards_merge_into_the_whole_and_back(monkeypatch, dim, stride, tp):
    full_shape = (24, 6) if dim == 0 else (6, 24)
    full = torch.arange(144, dtype=torch.float32).view(full_shape)
    attrs = _attrs(dim, stride)
    shards = [_drawn_shard(monkeypatch, full_shape, dim, stride, tp, r) for r in range(tp)]
    assert torch.equal(merge_shards(shards, [attrs] * tp), full)
    for rank in range(tp):
        assert torch.equal(shard_for_rank(full, attrs, tp, rank), shards[rank])


def test_swiglu_shard_is_this_ranks_gate_then_up():
    ffn, tp = 8, 2
    full = torch.arange(2 * ffn, dtype=torch.float32)  # [gate (8) ; up (8)], a fc1 bias
    gate_1, up_1 = torch.chunk(shard_for_rank(full, _attrs(0, 2), tp, 1), 2)
    assert gate_1.tolist() == list(range(4, 8)) and up_1.tolist() == list(range(12, 16))


@pytest.mark.parametrize("heads, groups, tp", [(8, 1, 2), (8, 2, 4), (8, 1, 8), (8, 4, 2)],
                         ids=["mqa-t2", "gqa2-t4", "mqa-t8", "gqa4-t2-contiguous"])
def test_qkv_rows_merge_with_replicas(monkeypatch, heads, groups, tp):
    hn, hidden = 2, 3
    full_rows = (heads + 2 * groups) * hn
    full = torch.arange(full_rows * hidden, dtype=torch.float32).view(full_rows, hidden)
    attrs = [_attrs(0, rows=qkv_partition_rows(heads, groups, hn, tp, r)) for r in range(tp)]
    shards = [_drawn_shard(monkeypatch, (full_rows, hidden), 0, 1, tp, r, attrs[r]["partition_rows"])
              for r in range(tp)]
    for rank in range(tp):
        assert torch.equal(shard_for_rank(full, attrs[rank], tp, rank), shards[rank])
    assert torch.equal(merge_shards(shards, attrs), full)
    if groups % tp == 0:  # whole groups per rank: the rows are the contiguous layout's
        assert all(partition_indices(_attrs(0), len(a["partition_rows"]), tp, r) == a["partition_rows"]
                   for r, a in enumerate(attrs))


def test_replicas_must_agree_and_every_row_must_be_held():
    heads, groups, hn, tp = 4, 1, 1, 2
    attrs = [_attrs(0, rows=qkv_partition_rows(heads, groups, hn, tp, r)) for r in range(tp)]
    full = torch.arange(6.0).view(6, 1)
    shards = [shard_for_rank(full, a, tp, r) for r, a in enumerate(attrs)]
    shards[1] = shards[1].clone()
    shards[1][-1] += 1.0  # rank 1's copy of the value row differs
    with pytest.raises(ValueError, match="replicated indices"):
        merge_shards(shards, attrs)
    with pytest.raises(ValueError, match="no rank holds"):
        merge_shards([full[:2], full[4:]], [_attrs(0, rows=[0, 1]), _attrs(0, rows=[4, 5])])


def test_replicated_tensors_pass_through():
    full = torch.ones(3, 2)
    assert shard_for_rank(full, {"tensor_model_parallel": False}, 2, 1) is full
    assert merge_shards([full, full], [{}, {}]) is full


def test_without_duplicate_rows():
    grad = torch.arange(12.0).view(6, 2)
    assert without_duplicate_rows({}, grad) is grad
    kept = without_duplicate_rows({"tensor_parallel_duplicate_rows": (2, 4)}, grad)
    assert kept[:, 0].tolist() == [0.0, 2.0, 8.0, 10.0]
