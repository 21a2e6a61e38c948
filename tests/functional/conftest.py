"""Fixtures shared by the functional tests.

`default_pipeline`: the built-in default data (what `make run` does) made small: 60 documents of the
corpus from Python itself, a GPT-2 BPE tokenizer of 600 ids trained on them, and the preprocessed
dataset. Module-scoped: each test module that asks for it builds its own.
"""
import pytest


@pytest.fixture(scope="module")
def default_pipeline(tmp_path_factory):
    pytest.importorskip("tokenizers", reason="tools/train_tokenizer.py needs the tokenizers extra")
    from tools import make_default_corpus, preprocess_data, train_tokenizer

    root = tmp_path_factory.mktemp("default")
    corpus = root / "corpus.jsonl"
    count = make_default_corpus.build_corpus(str(corpus), max_documents=60)
    train_tokenizer.main(["--input", str(corpus), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-size", "600",
                          "--output-dir", str(root / "tokenizer")])
    tokenizer_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(root / "tokenizer" / "vocab.json"),
                       "--merge-file", str(root / "tokenizer" / "merges.txt")]
    preprocess_data.main(["--input", str(corpus), "--output-prefix", str(root / "python"), "--append-eod",
                          "--workers", "2", *tokenizer_flags])
    return root, corpus, count, tokenizer_flags
