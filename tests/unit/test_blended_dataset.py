"""Blending: the interleaving indices, BlendedDataset items and cache, and the builder's blends."""

import math
import os

import numpy as np
import pytest
import torch

from megatron.data import blending_indices
from megatron.data.blended_dataset import BlendedDataset
from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
from megatron.data.dataset_config import GPTDatasetConfig
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDatasetBuilder
from megatron.data.utils import normalize


class Tok:
    eod = 0
    vocab_size = 5000


def write_corpus(prefix, num_docs, doc_length, first_token):
    """Documents whose tokens all equal first_token + document number (so a sample tells its source)."""
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
        for d in range(num_docs):
            builder.add_item(np.full(doc_length, first_token + d))
            builder.end_document()
        builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture
def corpora(tmp_path):
    """Three datasets of 2000, 1000 and 500 tokens."""
    return [write_corpus(str(tmp_path / f"c{i}"), n, 10, 1000 * (i + 1)) for i, n in enumerate([200, 100, 50])]


def config_for(tmp_path, **fields):
    base = dict(random_seed=3, sequence_length=4, path_to_cache=str(tmp_path / "cache"), tokenizer=Tok())
    base.update(fields)
    return GPTDatasetConfig(**base)


def max_prefix_error(dataset_index, weights):
    n = np.arange(1, len(dataset_index) + 1)
    return max(np.abs(np.cumsum(dataset_index == d) - w * n).max() for d, w in enumerate(weights))


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [0.7, 0.2, 0.1], [1, 1], [0.9, 0.05, 0.05],
                                     [0.333, 0.333, 0.334], [3, 1]])
def test_blending_indices_follow_the_weights(weights):
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    dataset_index, dataset_sample_index = blending_indices.build_blending_indices(normalize(weights), 10_000)
    assert dataset_index.dtype == np.int16 and dataset_sample_index.dtype == np.int64
    assert len(dataset_index) == 10_000
    shares = np.bincount(dataset_index, minlength=len(w)) / 10_000
    assert np.all(np.abs(shares - w) <= 0.01 * w)
    assert max_prefix_error(dataset_index, w) <= 1.5  # Megatron's greedy: 1.2 at [0.9, 0.05, 0.05]
    for d in range(len(w)):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert np.array_equal(dataset_sample_index[dataset_index == d], np.arange(np.sum(dataset_index == d)))


def test_blending_indices_stay_close_for_many_datasets():
    rng = np.random.default_rng(0)
    for _ in range(20):
        weights = rng.random(8) ** 2 + 1e-3
        dataset_index, _ = blending_indices.build_blending_indices(normalize(weights), 5000)
        assert max_prefix_error(dataset_index, weights / weights.sum()) < 8 / 2 + 1


def test_weighted_blend_through_the_builder(tmp_path, corpora, capsys):
    weights = [0.5, 0.3, 0.2]
    config = config_for(tmp_path, blend=(corpora, weights), split="8,2,0")
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [300, 40, 0], None, config).build()
    assert isinstance(train, BlendedDataset) and len(train) == 300 and len(valid) == 40 and test is None
    for part, w in zip(train.datasets, weights):  # mid-level sizes carry Megatron's 0.5% margin
        assert part.num_samples == math.ceil(math.ceil(300 * w) * 1.005) and len(part) >= part.num_samples
    for i in range(0, 300, 7):
        item = train[i]
        source = train.datasets[train.dataset_index[i]][train.dataset_sample_index[i]]
        assert item["dataset_id"] == train.dataset_index[i]
        assert all(torch.equal(item[k], source[k]) for k in source)
        assert 1000 * (item["dataset_id"] + 1) <= int(item["tokens"][0]) < 1000 * (item["dataset_id"] + 2)
    counts = np.bincount(train.dataset_index, minlength=3)
    assert np.all(np.abs(counts - 300 * np.array(weights)) <= 1)
    cache = os.listdir(tmp_path / "cache")
    assert sum(n.endswith("BlendedDataset-train-description.txt") for n in cache) == 1
    assert sum("BlendedDataset-valid-" in n for n in cache) == 3
    mtimes = {n: os.stat(tmp_path / "cache" / n).st_mtime_ns for n in cache}
    capsys.readouterr()
    again = BlendedMegatronDatasetBuilder(GPTDataset, [300, 40, 0], None, config).build()[0]
    assert "Build" not in capsys.readouterr().out
    assert mtimes == {n: os.stat(tmp_path / "cache" / n).st_mtime_ns for n in os.listdir(tmp_path / "cache")}
    np.testing.assert_array_equal(again.dataset_index, train.dataset_index)
    BlendedMegatronDatasetBuilder(GPTDataset, [301, 40, 0], None, config).build()
    assert sum(n.endswith("BlendedDataset-train-description.txt") for n in os.listdir(tmp_path / "cache")) == 2


def test_blend_without_cache_path_is_built_in_memory(tmp_path, corpora):
    config = config_for(tmp_path, blend=(corpora, [1, 1, 1]), split="1", path_to_cache=None)
    train = BlendedMegatronDatasetBuilder(GPTDataset, [60, 0, 0], None, config).build()[0]
    assert len(train) == 60 and not isinstance(train.dataset_index, np.memmap)
    names = os.listdir(tmp_path / "cache" / "GPTDataset_indices")  # the GPT indices use the default directory
    assert names and not any("BlendedDataset" in n for n in names)


def test_weights_inferred_from_dataset_sizes(tmp_path, corpora):
    config = config_for(tmp_path, blend=(corpora, None), split="1")
    train = BlendedMegatronDatasetBuilder(GPTDataset, [None, 0, 0], None, config).build()[0]
    lengths = [len(d) for d in train.datasets]  # one epoch each: 499, 249, 124 samples
    assert lengths == [(n - 1) // 4 for n in (2000, 1000, 500)]
    assert len(train) == sum(lengths) and train.size is None
    assert train.weights == lengths  # Megatron's exhaustive blend: the counts themselves
    for d, n in enumerate(lengths):  # every sample of every dataset exactly once
        assert sorted(train.dataset_sample_index[train.dataset_index == d]) == list(range(n))
    capped = BlendedMegatronDatasetBuilder(GPTDataset, [100, 0, 0], None, config).build()[0]
    assert len(capped) == 100 and np.bincount(capped.dataset_index).tolist() == pytest.approx(
        [100 * n / sum(lengths) for n in lengths], abs=1)


def test_blend_per_split(tmp_path, corpora):
    per_split = [(corpora[:2], [0.75, 0.25]), ([corpora[2]], None), None]
    config = config_for(tmp_path, blend_per_split=per_split)
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [80, 20, 10], None, config).build()
    assert isinstance(train, BlendedDataset) and len(train) == 80 and test is None
    assert np.bincount(train.dataset_index).tolist() == [60, 20]
    assert isinstance(valid, GPTDataset) and len(valid) >= 20
    assert sorted(np.unique(valid.document_index)) == list(range(50))  # the whole third corpus
    assert all(int(valid[i]["tokens"][0]) >= 3000 for i in range(len(valid)))
    for part in train.datasets:  # and the whole of the first two
        assert part.index_split.name == "train" and len(np.unique(part.document_index)) == len(part.dataset)


def test_blended_dataset_rejects_oversampling(tmp_path, corpora):
    config = config_for(tmp_path, blend=(corpora, None), split="1")
    train = BlendedMegatronDatasetBuilder(GPTDataset, [None, 0, 0], None, config).build()[0]
    with pytest.raises(IndexError, match="oversamples dataset 2 .*mid_level_dataset_surplus"):
        BlendedDataset(train.datasets, [1, 1, 1], 10_000, config)
    with pytest.raises(ValueError, match="3 datasets but 2 weights"):
        BlendedDataset(train.datasets, [1, 1], 10, config)


def sequential_greedy(weights, size, caps=None):
    """Megatron-Core's C++ loops (build_blending_indices / the exhaustive variant), step by step."""
    counts, index, sample = [0] * len(weights), [], []
    for n in range(size):
        t = float(max(n, 1))
        best, best_error = -1, -math.inf
        for d, w in enumerate(weights):
            error = w * t - counts[d]
            if (caps is None or counts[d] < caps[d]) and error > best_error:
                best, best_error = d, error
        index.append(best)
        sample.append(counts[best])
        counts[best] += 1
    return np.array(index, dtype=np.int16), np.array(sample, dtype=np.int64)


def test_block_greedy_equals_the_sequential_loop(monkeypatch):
    """Stretches of the blend run together from guessed starts; disagreeing ones are run again."""
    runs = []
    real_run = blending_indices._Blocks._run
    monkeypatch.setattr(blending_indices._Blocks, "_run", lambda self, blocks, counts: (
        runs.append(int(blocks[0])), real_run(self, blocks, counts))[1])
    rng = np.random.default_rng(1)
    for case in range(24):
        w = rng.random(int(rng.integers(1, 11))) ** (1 + case % 5) + 1e-3
        if case % 6 == 0:
            w = np.round(w * 3) + 1  # equal weights: exact ties between errors
        w = (w / w.sum()).tolist()
        size = int(rng.integers(1, 2500))
        block = int(rng.integers(8, 120))
        expected = sequential_greedy(w, size)
        for got in (blending_indices.build_blending_indices(w, size),
                    blending_indices.build_blending_indices(w, size, block=block, warmup=int(rng.integers(1, block)))):
            np.testing.assert_array_equal(got[0], expected[0])
            np.testing.assert_array_equal(got[1], expected[1])
        sizes = rng.integers(1, 300, size=len(w))
        total = int(sizes.sum())
        expected = sequential_greedy((sizes / float(total)).tolist(), total, caps=sizes.tolist())
        got = blending_indices.build_exhaustive_blending_indices(sizes.tolist(), block=block, warmup=4)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
        assert np.bincount(got[0], minlength=len(w)).tolist() == sizes.tolist()  # every sample exactly once
    assert any(first > 0 for first in runs)  # some blocks started wrong and were run again from their predecessor
