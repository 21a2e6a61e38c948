"""GPTDataset: index arrays against Megatron's loop and a brute-force token stream, splits,
masks, caching and mock data."""

import os

import numpy as np
import pytest
import torch

from megatron.data import gpt_dataset, index_helpers
from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
from megatron.data.dataset_config import GPTDatasetConfig
from megatron.data.gpt_dataset import GPTDataset, MockGPTDataset, get_ltor_masks_and_position_ids
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.data.utils import Split, get_split_indices, parse_and_normalize_split, parse_data_path

EOD = 0


class Tok:
    """Stand-in tokenizer: ids 1..99 are text, 0 ends a document."""

    eod = EOD
    vocab_size = 100


def write_corpus(prefix, lengths, seed=0):
    """One sequence per document (empty ones included); the last token of a document is eod."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
        for n in lengths:
            tokens = rng.integers(1, 100, size=n)
            if n:
                tokens[-1] = EOD
            builder.add_item(tokens)
            builder.end_document()
        builder.finalize(prefix + ".idx")
    return prefix


def random_lengths(seed, count=60):
    """Lengths with many empty and one-token documents."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 25, size=count)
    lengths[rng.random(count) < 0.2] = 0
    lengths[rng.random(count) < 0.15] = 1
    return lengths


def make_config(tmp_path, prefix, **overrides):
    fields = dict(random_seed=1234, sequence_length=8, blend=([prefix], None), split="1",
                  path_to_cache=str(tmp_path / "cache"), tokenizer=Tok())
    fields.update(overrides)
    return GPTDatasetConfig(**fields)


def make_dataset(tmp_path, prefix, num_samples=None, index_split=Split.train, indices=None, **overrides):
    config = make_config(tmp_path, prefix, **overrides)
    indexed = IndexedDataset(prefix)
    ids = np.arange(len(indexed), dtype=np.int32) if indices is None else indices
    return GPTDataset(indexed, prefix, ids, num_samples, index_split, config)


def megatron_sample_index(sizes, document_index, seq_length, add_extra):
    """Reference: Megatron's build_sample_idx loop (drop the last partial sequence)."""
    total = int(sum(int(sizes[d]) for d in document_index))
    num_samples = (total - add_extra) // seq_length
    rows = [(0, 0)]
    pos, offset = 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + add_extra
        while remaining != 0:
            doc_length = int(sizes[document_index[pos]]) - offset
            remaining -= doc_length
            if remaining <= 0:
                offset += remaining + doc_length - add_extra
                remaining = 0
            else:
                if pos == len(document_index) - 1:
                    assert len(rows) == num_samples
                    offset = int(sizes[document_index[pos]]) - add_extra
                    break
                pos += 1
                offset = 0
        rows.append((pos, offset))
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("seq_length", [1, 3, 8, 37])
@pytest.mark.parametrize("add_extra", [0, 1])
def test_sample_index_matches_megatron_loop(seed, seq_length, add_extra):
    sizes = random_lengths(seed).astype(np.int32)
    rng = np.random.RandomState(seed)
    document_index = index_helpers.build_document_index(np.arange(len(sizes), dtype=np.int32), 1 + seed % 3, rng,
                                                        seed % 2 == 1)
    ours = index_helpers.build_sample_index(sizes, document_index, seq_length, add_extra)
    np.testing.assert_array_equal(ours, megatron_sample_index(sizes, document_index, seq_length, add_extra))


def test_start_on_last_token_and_empty_documents():
    sizes = np.array([0, 5, 0, 0, 4, 1], dtype=np.int32)
    ours = index_helpers.build_sample_index(sizes, np.arange(6, dtype=np.int32), 4, 1)
    # starts 4 (last token of doc 1), 8 (last token of doc 4); empty docs 2, 3 never start a sample
    np.testing.assert_array_equal(ours, [[0, 0], [1, 4], [4, 3]])


@pytest.mark.parametrize("case", [
    dict(seed=0, num_samples=None, seq_length=8),
    dict(seed=1, num_samples=40, seq_length=5),  # several epochs, final epoch shuffled separately
    dict(seed=2, num_samples=150, seq_length=4),  # several epochs, final epoch nearly full
    dict(seed=3, num_samples=None, seq_length=6, add_extra_token_to_sequence=False),
])
def test_samples_are_consecutive_windows_of_the_stream(tmp_path, case):
    case = dict(case)
    seed, num_samples, seq_length = case.pop("seed"), case.pop("num_samples"), case.pop("seq_length")
    prefix = write_corpus(str(tmp_path / "corpus"), random_lengths(seed, 50), seed=seed)
    ds = make_dataset(tmp_path, prefix, num_samples, sequence_length=seq_length, **case)
    indexed = IndexedDataset(prefix)
    stream = np.concatenate([indexed.get(int(d)) for d in ds.document_index]).astype(np.int64)
    extra = int(ds.config.add_extra_token_to_sequence)
    assert len(ds) == (len(stream) - extra) // seq_length
    if num_samples is not None:
        assert len(ds) >= num_samples
    for i in range(len(ds)):
        k = int(ds.shuffle_index[i])
        window = stream[k * seq_length:k * seq_length + seq_length + extra]
        item = ds[i]
        np.testing.assert_array_equal(item["tokens"].numpy(), window[:seq_length])
        if extra:
            np.testing.assert_array_equal(item["labels"].numpy(), window[1:])
        else:
            np.testing.assert_array_equal(item["labels"].numpy()[:-1], window[1:])
            assert item["loss_mask"][-1] == 0
        assert item["tokens"].dtype == torch.int64 and item["loss_mask"].dtype == torch.float32


@pytest.mark.parametrize("num_samples,separate", [(None, False), (50, True), (75, False)])
def test_document_and_shuffle_index(tmp_path, num_samples, separate):
    prefix = write_corpus(str(tmp_path / "corpus"), np.full(40, 10))  # 400 tokens, 39 samples of 10 an epoch
    ds = make_dataset(tmp_path, prefix, num_samples, sequence_length=10)
    tokens = 400
    epochs = index_helpers.get_num_epochs(tokens, 10, num_samples, 1)
    assert index_helpers.use_separate_final_epoch(tokens, 10, num_samples, epochs, 1) == separate
    assert np.array_equal(np.bincount(ds.document_index, minlength=40), np.full(40, epochs))
    assert ds.document_index.dtype == np.int32
    assert np.array_equal(np.sort(ds.shuffle_index), np.arange(len(ds)))
    if separate:  # the final epoch is its own permutation, and so are its samples
        assert sorted(ds.document_index[-40:]) == list(range(40))
        first = ((epochs - 1) * tokens - 1) // 10
        assert np.array_equal(np.sort(ds.shuffle_index[:first]), np.arange(first))


def test_indices_follow_megatrons_random_draws(tmp_path):
    prefix = write_corpus(str(tmp_path / "corpus"), np.full(30, 7))
    ds = make_dataset(tmp_path, prefix, 75, sequence_length=5, random_seed=77)  # 2 epochs, not separate
    rng = np.random.RandomState(77)
    expected_doc = np.mgrid[0:2, 0:30][1].reshape(-1).astype(np.int32)
    rng.shuffle(expected_doc)
    expected_shuffle = np.arange(len(ds), dtype=np.uint32)
    rng.shuffle(expected_shuffle)
    np.testing.assert_array_equal(ds.document_index, expected_doc)
    np.testing.assert_array_equal(ds.shuffle_index, expected_shuffle)
    assert ds.shuffle_index.dtype == np.uint32


def test_num_epochs_is_the_smallest_sufficient():
    for tokens, seq, n in [(100, 10, 9), (100, 10, 10), (100, 10, 50), (7, 3, 11), (1000, 7, 1)]:
        e = index_helpers.get_num_epochs(tokens, seq, n, 1)
        assert (e * tokens - 1) // seq >= n and (e == 1 or ((e - 1) * tokens - 1) // seq < n)


def test_split_ranges_are_disjoint(tmp_path):
    prefix = write_corpus(str(tmp_path / "corpus"), np.full(100, 12))
    config = make_config(tmp_path, prefix, split="6,3,1")
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config).build()
    ranges = [set(np.unique(d.document_index).tolist()) for d in (train, valid, test)]
    assert ranges == [set(range(0, 60)), set(range(60, 90)), set(range(90, 100))]
    config = make_config(tmp_path, prefix, split="9,1,0")
    assert BlendedMegatronDatasetBuilder(GPTDataset, [10, 5, 5], None, config).build()[2] is None
    assert BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 5], None, config).build()[1] is None


def test_split_parsing():
    assert parse_and_normalize_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_and_normalize_split("949/50/1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_and_normalize_split("3") == [1.0, 0.0, 0.0]
    assert get_split_indices([0.949, 0.05, 0.001], 1000) == [0, 949, 999, 1000]
    assert get_split_indices([0.5, 0.5, 0.0], 3) == [0, 2, 3, 3]  # the running sum 1.5 rounds to 2 (half to even)
    assert get_split_indices([0.98, 0.01, 0.01], 275) == [0, 270, 272, 275]  # 269.5 -> 270, not 269
    for bad in ["", "a,b", "1,2,3,4", "-1,2"]:
        with pytest.raises(ValueError, match="split"):
            parse_and_normalize_split(bad)


def test_parse_data_path():
    assert parse_data_path(["data/a"]) == (["data/a"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path(["0.3 a 0.7 b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path(["a", "b", "c"]) == (["a", "b", "c"], None)
    with pytest.raises(ValueError, match="odd number"):
        parse_data_path(["0.3", "a", "0.7"])
    with pytest.raises(ValueError, match="'x' is not a number"):
        parse_data_path(["0.3", "a", "x", "b"])
    with pytest.raises(ValueError, match="mixes weights"):
        parse_data_path(["a", "0.5", "b"])


def test_config_validation():
    blend = (["a", "b"], [1.0, 2.0])
    with pytest.raises(ValueError, match="mutually exclusive"):
        GPTDatasetConfig(1, 8, blend=blend, blend_per_split=[blend, None, None], split="1")
    with pytest.raises(ValueError, match="split .* must be given"):
        GPTDatasetConfig(1, 8, blend=blend)
    with pytest.raises(ValueError, match="2 dataset prefixes but 1 weights"):
        GPTDatasetConfig(1, 8, blend=(["a", "b"], [1.0]), split="1")
    with pytest.raises(ValueError, match="positive number"):
        GPTDatasetConfig(1, 8, blend=(["a", "b"], [1.0, -1.0]), split="1")
    with pytest.raises(ValueError, match="cannot be used with blend_per_split"):
        GPTDatasetConfig(1, 8, blend_per_split=[blend, None, None], split="1")
    with pytest.raises(ValueError, match="no data"):
        GPTDatasetConfig(1, 8)
    with pytest.raises(ValueError, match="eod"):
        GPTDatasetConfig(1, 8, blend=blend, split="1", eod_mask_loss=True)
    assert GPTDatasetConfig(1, 8, blend=blend, split="98,2").split_vector == pytest.approx([0.98, 0.02, 0.0])


def test_masks_and_position_ids():
    tokens = torch.tensor([5, 0, 7, 8, 0, 9])
    mask, loss, pos = get_ltor_masks_and_position_ids(tokens, 0, True, True, True, True)
    assert pos.tolist() == [0, 1, 0, 1, 2, 0]
    assert loss.tolist() == [1, 0, 1, 1, 0, 1]
    allowed = ~mask[0]  # True where attention is allowed
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for segment in ([0, 1], [2, 3, 4], [5]):
        for i in segment:
            for j in segment:
                expected[i, j] = j <= i
    assert torch.equal(allowed, expected)
    mask, loss, pos = get_ltor_masks_and_position_ids(tokens, 0, False, False, False, True)
    assert torch.equal(mask[0], torch.ones(6, 6, dtype=torch.bool).triu(1)) and mask.shape == (1, 6, 6)
    assert pos.tolist() == list(range(6)) and loss.tolist() == [1.0] * 6
    mask, _, pos = get_ltor_masks_and_position_ids(tokens, 0, True, False, False, False)
    assert mask is None and pos.tolist() == [0, 1, 0, 1, 2, 0]


def test_dataset_items_apply_the_flags(tmp_path):
    prefix = write_corpus(str(tmp_path / "corpus"), [3, 4, 5, 6])
    ds = make_dataset(tmp_path, prefix, sequence_length=8, eod_mask_loss=True, reset_position_ids=True,
                      create_attention_mask=False)
    for i in range(len(ds)):
        item = ds[i]
        assert "attention_mask" not in item
        assert torch.equal(item["loss_mask"] == 0, item["tokens"] == EOD)
        expected, position = [], 0
        for token in item["tokens"].tolist():  # positions restart after each eod
            expected.append(position)
            position = 0 if token == EOD else position + 1
        assert item["position_ids"].tolist() == expected
    with pytest.raises(IndexError):
        ds[len(ds)]


def cache_files(tmp_path):
    return {name: os.stat(tmp_path / "cache" / name).st_mtime_ns for name in os.listdir(tmp_path / "cache")}


def test_cache_is_reused_and_keyed_by_config(tmp_path, capsys):
    prefix = write_corpus(str(tmp_path / "corpus"), random_lengths(0, 80))
    first = make_dataset(tmp_path, prefix, 20)
    assert "Build and save the document index" in capsys.readouterr().out
    files = cache_files(tmp_path)
    assert len(files) == 5 and all(n.endswith(("description.txt", ".npy", "token_range.json")) for n in files)
    again = make_dataset(tmp_path, prefix, 20)
    assert "Build" not in capsys.readouterr().out and cache_files(tmp_path) == files
    assert not again.built_anew_on_cache_miss and isinstance(again.sample_index, np.memmap)
    np.testing.assert_array_equal(first.sample_index, again.sample_index)
    hashes = {next(iter(files)).split("-")[0]}
    for changes in (dict(random_seed=1), dict(sequence_length=9), dict(split="1,1"), dict(num_samples=21)):
        num_samples = changes.pop("num_samples", 20)
        make_dataset(tmp_path, prefix, num_samples, **changes)
        new = set(cache_files(tmp_path)) - set(files)
        assert len(new) == 5 and "Build and save" in capsys.readouterr().out
        hashes.add(next(iter(new)).split("-")[0])
        files = cache_files(tmp_path)
    assert len(hashes) == 5


def test_interrupted_cache_write_is_rebuilt(tmp_path, monkeypatch, capsys):
    prefix = write_corpus(str(tmp_path / "corpus"), random_lengths(1, 80))
    real_save = np.save

    def failing_save(file, array, *args, **kwargs):
        if array.ndim == 2:  # the sample index
            raise KeyboardInterrupt("simulated interruption")
        real_save(file, array, *args, **kwargs)

    monkeypatch.setattr(np, "save", failing_save)
    with pytest.raises(KeyboardInterrupt):
        make_dataset(tmp_path, prefix, 20)
    names = os.listdir(tmp_path / "cache")
    assert not any(n.endswith("description.txt") or n.endswith(".tmp") for n in names)
    monkeypatch.setattr(np, "save", real_save)
    capsys.readouterr()
    make_dataset(tmp_path, prefix, 20)
    assert "Build and save the sample index" in capsys.readouterr().out
    assert sum(n.endswith("description.txt") for n in os.listdir(tmp_path / "cache")) == 1


def test_default_cache_directory_and_unwritable_fallback(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    prefix = write_corpus(str(data / "corpus"), random_lengths(2, 80))
    ds = make_dataset(tmp_path, prefix, 20, path_to_cache=None)
    cached = os.listdir(data / "cache" / "GPTDataset_indices")
    assert sorted(n.split("-", 1)[1] for n in cached) == [
        "GPTDataset-train-description.txt", "GPTDataset-train-document_index.npy",
        "GPTDataset-train-sample_index.npy", "GPTDataset-train-shuffle_index.npy", "GPTDataset-train-token_range.json"]
    with monkeypatch.context() as patch:  # a complete cache in a read-only directory is still used
        patch.setattr(gpt_dataset, "writable_directory", lambda directory: PermissionError("read-only"))
        capsys.readouterr()
        assert isinstance(make_dataset(tmp_path, prefix, 20, path_to_cache=None).sample_index, np.memmap)
        assert "WARNING" not in capsys.readouterr().out
    other = tmp_path / "other"
    other.mkdir()
    (other / "cache").write_text("a file where the cache directory should go")
    prefix2 = write_corpus(str(other / "corpus"), random_lengths(2, 80))
    capsys.readouterr()
    in_memory = make_dataset(tmp_path, prefix2, 20, path_to_cache=None)
    out = capsys.readouterr().out
    assert "WARNING" in out and str(other / "cache" / "GPTDataset_indices") in out
    np.testing.assert_array_equal(in_memory.sample_index, ds.sample_index)


def test_too_small_split_fails_clearly(tmp_path):
    prefix = write_corpus(str(tmp_path / "corpus"), [3, 2])
    with pytest.raises(ValueError, match="too few for one sample"):
        make_dataset(tmp_path, prefix, 4, sequence_length=8)


def test_mock_dataset_shapes_and_determinism():
    config = GPTDatasetConfig(random_seed=5, sequence_length=16, mock=True, tokenizer=Tok())
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [100, 10, 0], None, config).build()
    assert isinstance(train, MockGPTDataset) and test is None and len(train) >= 100 and len(valid) >= 10
    item = train[3]
    assert item["tokens"].shape == (16,) and item["attention_mask"].shape == (1, 16, 16)
    assert int(item["tokens"].max()) < Tok.vocab_size and int(item["tokens"].min()) >= 0
    again = BlendedMegatronDatasetBuilder(GPTDataset, [100, 10, 0], None, config).build()[0]
    for i in (0, 3, 99):
        assert all(torch.equal(train[i][k], again[i][k]) for k in item)
    other = BlendedMegatronDatasetBuilder(GPTDataset, [100, 10, 0], None, config.replace(random_seed=6)).build()[0]
    assert not torch.equal(other[3]["tokens"], item["tokens"])
    doc = train.dataset.get(7)
    assert doc[-1] == EOD and not np.any(doc[:-1] == EOD)
