"""Bad data input ends in one clear error of a user-input class (one line from pretrain_gpt.py):
an empty --data-path, blend weights <= 0, token ids outside the vocabulary, an empty split."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pretrain_gpt
from megatron.training.arguments import ArgsError, parse_and_validate_args
from megatron.training.cli import user_input_errors
from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
from megatron.data.dataset_config import GPTDatasetConfig
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--max-position-embeddings", "8", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--num-workers", "0"]


class Tokenizer:
    eod = 0
    vocab_size = 500


def write_dataset(prefix, num_docs, high=400, doc_length=12, seed=0):
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
        for _ in range(num_docs):
            builder.add_item(rng.integers(1, high, size=doc_length))
            builder.end_document()
        builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture
def prefixes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return [write_dataset(str(tmp_path / name), 20) for name in ("a", "b")]


def validate(*words):
    return parse_and_validate_args(argv=[*MODEL, *words])


@pytest.mark.parametrize("data_path", [[""], ["  "], ["", " "]])
def test_blank_data_path_names_the_flag(prefixes, data_path):
    with pytest.raises(ArgsError, match=r"^--data-path '.*' names no dataset; give a dataset prefix"):
        validate("--data-path", *data_path)
    with pytest.raises(ArgsError, match=r"^--valid-data-path '' names no dataset"):
        validate("--train-data-path", "a", "--valid-data-path", "")


@pytest.mark.parametrize("weight", ["0", "-0.5", "0.0", "-1", "nan", "inf"])
def test_blend_weight_not_positive_is_refused_with_the_flags(prefixes, weight):
    with pytest.raises(ArgsError, match=rf"^--data-path: the weight {weight} of a must be a positive number"):
        validate("--data-path", weight, "a", "1", "b")
    with pytest.raises(ArgsError, match=rf"^--train-data-path: the weight {weight} of b must be a positive number"):
        validate("--train-data-path", "0.3", "a", weight, "b")
    assert validate("--data-path", "0.3", "a", "0.7", "b").data_path == ["0.3", "a", "0.7", "b"]


def config(tmp_path, prefix, split="1", **fields):
    return GPTDatasetConfig(random_seed=1, sequence_length=8, blend=([prefix], None), split=split,
                            path_to_cache=str(tmp_path / "cache"), tokenizer=fields.pop("tokenizer", Tokenizer()),
                            **fields)


def test_token_ids_outside_the_vocabulary_name_prefix_id_and_size(tmp_path, monkeypatch):
    prefix = write_dataset(str(tmp_path / "other_tokenizer"), 30, high=700)
    biggest = int(IndexedDataset(prefix).token_range(0, 30)[1])
    message = (rf"^{prefix}: token id {biggest} in the train split is outside the vocabulary of the tokenizer "
               r"\(500 ids, 0 to 499\); the dataset was made with another tokenizer")
    with pytest.raises(IndexedDatasetError, match=message):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 0], None, config(tmp_path, prefix)).build()
    # the range is cached with the indices: a rerun says the same without reading the data again
    monkeypatch.setattr(IndexedDataset, "token_range", lambda *a: pytest.fail("the token ids were scanned again"))
    with pytest.raises(IndexedDatasetError, match=message):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 0], None, config(tmp_path, prefix)).build()
    monkeypatch.undo()
    good = write_dataset(str(tmp_path / "good"), 30, high=500)
    assert BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 0], None, config(tmp_path, good)).build()[0] is not None
    # mock data is drawn below the vocabulary: nothing is scanned
    monkeypatch.setattr(IndexedDataset, "token_range", lambda *a: pytest.fail("mock data was scanned"))
    mock = GPTDatasetConfig(random_seed=1, sequence_length=8, mock=True, tokenizer=Tokenizer())
    assert BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 0], None, mock).build()[0] is not None


def test_split_leaving_a_needed_dataset_empty_says_which(tmp_path, capsys):
    prefix = write_dataset(str(tmp_path / "small"), 50)
    # 99% of 50 documents ends at 49.5, rounded to 50: the validation split is empty
    with pytest.raises(IndexedDatasetError, match=rf"^{prefix}: --split 99,1,0 leaves the valid split no documents "
                                                  r"\(the dataset has 50\), but 4 samples of valid data are needed"):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 4, 0], None, config(tmp_path, prefix, "99,1,0")).build()
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 0], None,
                                                       config(tmp_path, prefix, "99,1,0")).build()
    assert train is not None and valid is None and test is None  # no validation samples asked: fine
    capsys.readouterr()
    _, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [10, 4, 0], None,
                                                config(tmp_path, prefix, "100,0,0")).build()
    assert valid is None and "--split gives that split no data" in capsys.readouterr().out
    # a split with documents but fewer tokens than one sample
    with pytest.raises(IndexedDatasetError, match=rf"^{prefix}: the valid split \(--split 90,4,6\) holds 2 of the "
                                                  r"dataset's 50 documents, 24 tokens, too few for one sample of 33"):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 4, 0], None,
                                      config(tmp_path, prefix, "90,4,6").replace(sequence_length=32)).build()


def test_pretrain_gpt_reports_bad_data_in_one_line(tmp_path):
    """In process: the error reaches the entry point as a class it prints as one line."""
    prefix = write_dataset(str(tmp_path / "wrong_vocab"), 40, high=300)
    with pytest.raises(user_input_errors()) as caught:
        pretrain_gpt.main([*MODEL, "--data-path", prefix, "--split", "1", "--eval-iters", "0"])
    assert "\n" not in str(caught.value) and "outside the vocabulary of the tokenizer (256 ids" in str(caught.value)


def test_pretrain_gpt_exits_1_with_one_line_for_an_empty_data_path(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *MODEL, "--data-path", ""],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --data-path '' names no dataset; give a dataset prefix (PREFIX for "
        "PREFIX.bin/PREFIX.idx) or 'WEIGHT PREFIX ...'"]
