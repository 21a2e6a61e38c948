"""Context parallelism's rank arithmetic, without any process group: the load-balanced split of a
sequence (Megatron's 2N chunks, rank r holding chunks r and 2N-1-r), the batch split of
get_batch_on_this_cp_rank, and the CP groups (also the hierarchical a2a x p2p ones) in Megatron's
tp-cp-ep-dp-pp order."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.context_parallel import cp_positions, split_for_cp_rank
from megatron.core.parallel_state import _plan_rank_groups
from megatron.training.arguments import parse_and_validate_args


def test_load_balanced_positions():
    assert cp_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    # every position once over the ranks, and the causal work (sum of positions + 1) equal on each
    for cp in (2, 4, 8):
        parts = [cp_positions(32, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(32))
        assert len({int((p + 1).sum()) for p in parts}) == 1
    with pytest.raises(ValueError, match="not divisible by 2 x --context-parallel-size"):
        cp_positions(12, 4, 0)


def test_split_for_cp_rank_cuts_the_sequence_dim():
    tokens = torch.arange(2 * 8).view(2, 8)  # [b, s]
    assert split_for_cp_rank(tokens, 1, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    mask = torch.ones(1, 1, 8, 8).triu(1).bool()  # [b, 1, s, s]: query rows are cut, all keys kept
    assert split_for_cp_rank(mask, 2, 2, 0).shape == (1, 1, 4, 8)
    assert split_for_cp_rank(tokens, 1, 1, 0) is tokens


def test_cp_groups_in_megatron_order():
    # 8 ranks, TP 2, CP 2 (DP 2): rank = tp + 2 cp + 4 dp
    plan = _plan_rank_groups(8, tp=2, pp=1, cp=2, ep=1, etp=2, order="tp-cp-ep-dp-pp")
    assert plan["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert plan["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # CP 4 as a2a 2 x p2p 2: a2a groups hold consecutive CP ranks, the rings every other one
    plan = _plan_rank_groups(8, tp=2, pp=1, cp=4, ep=1, etp=2, order="tp-cp-ep-dp-pp", hierarchical_cp=[2, 2])
    assert plan["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert plan["cp-a2a"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert plan["cp-p2p"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert "cp-a2a" not in _plan_rank_groups(8, tp=2, pp=1, cp=4, ep=1, etp=2, order="tp-cp-ep-dp-pp")


def test_hierarchical_sizes_must_multiply_to_cp():
    with pytest.raises(ValueError, match="whose product is the context-parallel size"):
        parallel_state._check_hierarchical_sizes([2, 3], 4)


def test_cp_flags_reach_the_model_config(monkeypatch):
    from megatron.training.arguments import core_transformer_config_from_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    args = parse_and_validate_args(argv=[
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--max-position-embeddings", "32",
        "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--context-parallel-size", "4",
        "--cp-comm-type", "p2p", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"])
    assert args.data_parallel_size == 1
    config = core_transformer_config_from_args(args)
    assert config.context_parallel_size == 4 and config.hierarchical_context_parallel_sizes == [2, 2]
    assert [config.cp_comm_type_of(n) for n in (1, 2)] == ["p2p", "a2a+p2p"]
