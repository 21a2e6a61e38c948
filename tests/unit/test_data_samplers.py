"""Pretraining samplers: global micro-batches sliced per data-parallel rank, resumed at consumed samples."""
import itertools

import pytest
import torch

from megatron.data.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)


def test_single_sampler_slices_ranks_and_resumes():
    ranks = [list(MegatronPretrainingSampler(20, 0, 2, rank, 2)) for rank in range(2)]
    assert ranks[0][:2] == [[0, 1], [4, 5]] and ranks[1][:2] == [[2, 3], [6, 7]]
    assert len(ranks[0]) == 5  # 20 samples, 4 per global micro-batch, the last partial one dropped
    resumed = list(MegatronPretrainingSampler(20, 8, 2, 0, 2))
    assert resumed == ranks[0][2:]
    assert list(MegatronPretrainingSampler(10, 8, 4, 0, 1, drop_last=False)) == [[8, 9]]


def test_single_sampler_rejects_exhausted_or_bad_input():
    with pytest.raises(ValueError, match="already consumed"):
        MegatronPretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(ValueError, match="empty"):
        MegatronPretrainingSampler(0, 0, 2, 0, 1)
    with pytest.raises(ValueError, match="data-parallel rank 2/2"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)


def test_random_sampler_resumes_in_the_same_epoch_order_and_reshuffles_per_epoch():
    fresh = list(MegatronPretrainingRandomSampler(24, 0, 2, 0, 1, seed=7))
    assert sorted(i for batch in fresh for i in batch) == list(range(24)) and fresh != sorted(fresh)
    assert list(MegatronPretrainingRandomSampler(24, 6, 2, 0, 1, seed=7)) == fresh[3:]
    next_epoch = list(MegatronPretrainingRandomSampler(24, 24, 2, 0, 1, seed=7))
    assert sorted(i for b in next_epoch for i in b) == list(range(24)) and next_epoch != fresh
    per_rank = [set(itertools.chain(*MegatronPretrainingRandomSampler(24, 0, 3, r, 2, seed=7))) for r in range(2)]
    assert per_rank[0].isdisjoint(per_rank[1]) and per_rank[0] | per_rank[1] == set(range(24))


def test_loader_leaves_the_global_rng_alone():
    """Building and iterating a loader must not shift the dropout RNG of a resumed run."""
    loader = build_pretraining_data_loader(list(range(16)), 4, micro_batch_size=2, data_parallel_rank=0,
                                           data_parallel_size=1, num_workers=0)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    batches = [b.tolist() for b in loader]
    assert torch.equal(torch.get_rng_state(), state)
    assert batches[0] == [4, 5] and len(batches) == 6
    assert build_pretraining_data_loader(None, 0, micro_batch_size=2, data_parallel_rank=0,
                                         data_parallel_size=1) is None
    with pytest.raises(ValueError, match="--dataloader-type 'external'"):
        build_pretraining_data_loader(list(range(4)), 0, micro_batch_size=2, data_parallel_rank=0,
                                      data_parallel_size=1, dataloader_type="external")
