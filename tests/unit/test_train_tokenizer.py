"""tools/train_tokenizer.py: train on a slice of the real corpus, load back, compare with HF."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
# tools/ is a folder of scripts, not a package: load the script as a module by its path.
_spec = importlib.util.spec_from_file_location("train_tokenizer", ROOT / "tools" / "train_tokenizer.py")
train_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_tokenizer)
InputError, main, sentencepiece_lines = (train_tokenizer.InputError, train_tokenizer.main,
                                         train_tokenizer.sentencepiece_lines)


@pytest.fixture(scope="module")
def docs(corpus_path):
    """The first 50 documents (KJV chapters) of the corpus."""
    with open(corpus_path, encoding="utf-8") as f:
        return [json.loads(next(f))["text"] for _ in range(50)]


@pytest.fixture(scope="module")
def small_corpus(docs, tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc, "other": doc.upper()}) + "\n")
    return path


def build(tokenizer_type, **files):
    args = argparse.Namespace(tokenizer_type=tokenizer_type, rank=1, vocab_extra_ids=0,
                              make_vocab_size_divisible_by=128, **files)
    return build_tokenizer(args)


def run(corpus, out, tokenizer_type, vocab_size, *extra):
    return main(["--input", str(corpus), "--tokenizer-type", tokenizer_type, "--vocab-size",
                 str(vocab_size), "--output-dir", str(out), *extra])


def test_gpt2_bpe_trained_files_load_and_match_hf(small_corpus, docs, tmp_path, capsys):
    out = tmp_path / "bpe"
    paths = run(small_corpus, out, "GPT2BPETokenizer", 600, "--special-tokens", "<|pad|>")
    assert sorted(os.listdir(out)) == ["merges.txt", "vocab.json"] and len(paths) == 2
    assert "vocab size 600" in capsys.readouterr().out
    (tmp_path / "plain").mkdir()
    assert os.stat(out).st_mode == os.stat(tmp_path / "plain").st_mode  # not mkdtemp's 0700
    assert (out / "merges.txt").read_text(encoding="utf-8").startswith("#version: 0.2\n")
    ours = build("GPT2BPETokenizer", vocab_file=str(out / "vocab.json"),
                 merge_file=str(out / "merges.txt"))
    assert ours.vocab_size == 600 and "<|pad|>" in ours.vocab
    assert ours.inv_vocab[ours.eod] == "<|endoftext|>"
    from transformers import GPT2TokenizerFast

    hf = GPT2TokenizerFast.from_pretrained(str(out), local_files_only=True)
    texts = docs + ["Unseen text: naïve café 😀, 1234   spaces\n\nnewlines"]
    for text in texts:
        ids = ours.tokenize(text)
        assert ids == hf(text)["input_ids"]
        assert ours.detokenize(ids) == text
    # The merges were learned: far fewer tokens than bytes.
    assert len(ours.tokenize(docs[0])) < len(docs[0].encode()) / 2


@pytest.mark.parametrize("tokenizer_type, lower", [("BertWordPieceLowerCase", True),
                                                    ("BertWordPieceCase", False)])
def test_bert_wordpiece_trained_vocab_matches_hf(small_corpus, docs, tmp_path, tokenizer_type, lower):
    out = tmp_path / "wp"
    run(small_corpus, out, tokenizer_type, 800, "--json-keys", "text", "other")
    lines = (out / "vocab.txt").read_text(encoding="utf-8").split("\n")
    assert lines[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert any(line.isupper() for line in lines[5:]) != lower  # "other" holds upper-case text
    ours = build(tokenizer_type, vocab_file=str(out / "vocab.txt"))
    assert ours.vocab_size == 800 + 2  # [BOS] and [EOS] appended, as in Megatron
    from transformers import BertTokenizer

    hf = BertTokenizer(vocab=str(out / "vocab.txt"), do_lower_case=lower)
    texts = docs[:10] + ["Unseen: Café, naïve! 北京 ÅNGSTRÖM xylophone"]
    for text in texts:
        assert ours.tokenize(text) == hf(text, add_special_tokens=False)["input_ids"]
    sample = "And God said, Let there be light"
    assert ours.decode(ours.tokenize(sample)) == (sample.lower() if lower else sample).replace(",", " ,")


def test_sentencepiece_trained_model_matches_library(small_corpus, docs, tmp_path):
    import sentencepiece

    out = tmp_path / "sp"
    run(small_corpus, out, "SentencePieceTokenizer", 700, "--special-tokens", "<sep2>")
    assert {"tokenizer.model", "tokenizer.vocab"} == set(os.listdir(out))
    model = str(out / "tokenizer.model")
    reference = sentencepiece.SentencePieceProcessor(model_file=model)
    assert reference.get_piece_size() == 700 and reference.piece_to_id("<sep2>") != reference.unk_id()
    ours = build("SentencePieceTokenizer", tokenizer_model=model)
    gpt = build("GPTSentencePieceTokenizer", tokenizer_model=model)
    assert ours.vocab_size == 700 + 5  # <CLS> <SEP> <EOD> <MASK> <PAD>; bos/eos are the model's
    for doc in docs[:10]:
        assert ours.tokenize(doc) == gpt.tokenize(doc) == reference.encode(doc)
    line = "In the beginning God created the heaven and the earth."
    assert gpt.detokenize(gpt.tokenize(line)) == line


def test_sentencepiece_lines_are_short_and_complete():
    text = "short line\n\n" + " ".join(["word"] * 3000) + "\n" + "x" * 9000
    lines = list(sentencepiece_lines([text]))
    assert lines[0] == "short line"
    assert all(0 < len(line.encode()) <= train_tokenizer.SP_MAX_LINE_BYTES for line in lines)
    assert "".join("".join(lines).split()) == "".join(text.split())  # nothing lost
    assert lines[1] == " ".join(["word"] * (len(lines[1]) // 5 + 1))  # cut at a space


def test_plain_text_input(docs, tmp_path):
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("\n".join(docs[:20]), encoding="utf-8")
    run(text_file, tmp_path / "out", "BertWordPieceLowerCase", 500)
    vocab = (tmp_path / "out" / "vocab.txt").read_text(encoding="utf-8").split("\n")
    assert "god" in vocab and "the" in vocab


def test_bad_json_line_names_file_and_line_and_writes_nothing(small_corpus, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine line"}\n\n{"text": broken\n', encoding="utf-8")
    out = tmp_path / "out"
    for tokenizer_type in ("GPT2BPETokenizer", "SentencePieceTokenizer"):
        with pytest.raises(InputError, match=f"{bad}:3: bad JSON line"):
            main(["--input", str(small_corpus), str(bad), "--tokenizer-type", tokenizer_type,
                  "--vocab-size", "400", "--output-dir", str(out)])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no out, no temp dir
    missing_key = tmp_path / "nokey.jsonl"
    missing_key.write_text('{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(InputError, match=f"{missing_key}:1: no string under JSON key 'text'"):
        run(missing_key, out, "BertWordPieceCase", 300)
    assert not out.exists()


def test_missing_input_file_is_named(tmp_path):
    with pytest.raises(InputError, match="--input /no/such.jsonl"):
        run("/no/such.jsonl", tmp_path / "out", "GPT2BPETokenizer", 300)
    assert not (tmp_path / "out").exists()


def test_existing_output_dir_files_are_replaced(small_corpus, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "vocab.txt").write_text("old\n", encoding="utf-8")
    (out / "keep.me").write_text("mine", encoding="utf-8")
    run(small_corpus, out, "BertWordPieceCase", 300)
    assert (out / "vocab.txt").read_text(encoding="utf-8").startswith("[PAD]\n")
    assert (out / "keep.me").read_text(encoding="utf-8") == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_missing_tokenizers_library_gives_pip_command(small_corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match=r"pip install -e \.\[tokenizers\]"):
        run(small_corpus, tmp_path / "out", "GPT2BPETokenizer", 300)
    assert not (tmp_path / "out").exists()


def test_script_runs_from_repo_root():
    result = subprocess.run([sys.executable, "tools/train_tokenizer.py", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--tokenizer-type" in result.stdout and "--min-frequency" in result.stdout
