"""The built-in default: corpus from Python itself -> trained tokenizer -> dataset (what `make run` does)."""
import json

import pytest

from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError
from tools import inspect_dataset, make_default_corpus, preprocess_data


def test_default_corpus_is_deterministic_documentation_and_sources(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert make_default_corpus.build_corpus(str(a)) == make_default_corpus.build_corpus(str(b))
    assert a.read_bytes() == b.read_bytes()
    docs = [json.loads(line) for line in a.read_text(encoding="utf-8").splitlines()]
    assert {d["source"] for d in docs} == {"python-docs", "python-stdlib"}
    assert len(docs) > 300 and sum(len(d["text"]) for d in docs) > 5_000_000
    titles = [d["title"] for d in docs]
    assert len(set(titles)) == len(titles)
    assert not any(t.startswith(("test/", "encodings/")) or "/tests/" in t for t in titles)
    assert all(d["text"].strip() for d in docs)


def test_default_pipeline_round_trips(default_pipeline):
    root, corpus, count, tokenizer_flags = default_pipeline
    args = preprocess_data.get_args(["--input", str(corpus), "--output-prefix", "x", "--workers", "1",
                                     *tokenizer_flags])
    from megatron.training.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(args)
    assert tokenizer.vocab_size == 600
    dataset = IndexedDataset(str(root / "python_text_document"))
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    assert dataset.num_documents == count == len(texts)
    for d, text in enumerate(texts):
        ids = dataset[d].tolist()
        assert ids[-1] == tokenizer.eod and tokenizer.detokenize(ids[:-1]) == text


def test_inspect_dataset_reports_and_checks_the_vocabulary(default_pipeline, capsys):
    root, _, count, tokenizer_flags = default_pipeline
    inspect_dataset.main(["--data-path", str(root / "python_text_document"), *tokenizer_flags])
    out = capsys.readouterr().out
    assert f"{count} documents" in out and "fits the GPT2BPETokenizer vocabulary of 600" in out
    assert "document 0 (" in out
    # the same dataset read with a smaller vocabulary: a tokenizer mismatch is caught
    with pytest.raises(IndexedDatasetError, match="outside the tokenizer's vocabulary of 100"):
        inspect_dataset.main(["--data-path", str(root / "python_text_document"),
                              "--tokenizer-type", "NullTokenizer", "--vocab-size", "99"])
