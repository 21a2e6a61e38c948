"""The builder in a 2-process gloo job: rank 0 builds the index caches, rank 1 only loads them,
and both see the same samples; a rank other than 0 never builds on its own."""

import json
import os

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.data.blended_dataset import BlendedDataset
from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
from megatron.data.dataset_config import GPTDatasetConfig
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.data.utils import Split

WORLD_SIZE = 2


class Tok:
    eod = 0
    vocab_size = 100


def write_corpus(prefix, seed):
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
        for _ in range(120):
            builder.add_item(np.append(rng.integers(1, 100, size=rng.integers(0, 20)), 0))
            builder.end_document()
        builder.finalize(prefix + ".idx")
    return prefix


def _count_builds(cls, counter):
    """Wrap cls._build_indices so that every build (not load) is recorded."""
    original = cls._build_indices

    def counting(self, *args):
        counter.append(f"{type(self).__name__}-{self.split.name if hasattr(self, 'split') else self.index_split.name}")
        return original(self, *args)

    cls._build_indices = counting


def _worker(rank, init_file, prefixes, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    builds = []
    _count_builds(GPTDataset, builds)
    _count_builds(BlendedDataset, builds)
    config = GPTDatasetConfig(random_seed=11, sequence_length=8, blend=(prefixes, [0.6, 0.4]), split="9,1,0",
                              path_to_cache=os.path.join(out_dir, "cache"), tokenizer=Tok(), eod_mask_loss=True)
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [60, 10, 0], lambda: True, config).build()
    samples = {name: [ds[i]["tokens"].tolist() + ds[i]["loss_mask"].tolist() for i in range(len(ds))]
               for name, ds in (("train", train), ("valid", valid))}
    error = None
    if rank == 1:  # alone, on a configuration rank 0 never built
        indexed = IndexedDataset(prefixes[0])
        try:
            GPTDataset(indexed, prefixes[0], np.arange(len(indexed), dtype=np.int32), 10, Split.train,
                       config.replace(random_seed=12))
        except RuntimeError as caught:
            error = str(caught)
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"builds": builds, "samples": samples, "test_is_none": test is None, "error": error}, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("distributed_build")
    prefixes = [write_corpus(str(directory / f"corpus{i}"), seed=i) for i in range(2)]
    mp.spawn(_worker, args=(str(directory / "init"), prefixes, str(directory)), nprocs=WORLD_SIZE, join=True)
    out = []
    for rank in range(WORLD_SIZE):
        with open(directory / f"rank{rank}.json") as f:
            out.append(json.load(f))
    return out


def test_only_rank_0_builds_and_ranks_agree(results):
    rank0, rank1 = results
    # 2 prefixes x (train, valid) GPT datasets, then 2 blends
    assert sorted(rank0["builds"]) == sorted(["GPTDataset-train", "GPTDataset-valid"] * 2
                                             + ["BlendedDataset-train", "BlendedDataset-valid"])
    assert rank1["builds"] == []
    assert rank0["samples"] == rank1["samples"]
    assert len(rank0["samples"]["train"]) == 60 and len(rank0["samples"]["valid"]) == 10
    assert rank0["test_is_none"] and rank1["test_is_none"]


def test_rank_1_alone_without_cache_fails_clearly(results):
    error = results[1]["error"]
    assert error is not None and "rank 1" in error and "only global rank 0 builds" in error
    assert "GPTDataset-train-description.txt" in error and "cache" in error
