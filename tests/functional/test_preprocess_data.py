"""tools/preprocess_data.py and tools/merge_datasets.py end to end."""
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetError
from tests.helpers.data import files_bytes, null_args, read_documents, write_jsonl
from tests.helpers.paths import ROOT
from tools import merge_datasets, preprocess_data
from tools.preprocess_data import PreprocessError


def gpt2_args(input_path, prefix, vocab_dir, *extra, workers=1):
    return ["--input", str(input_path), "--output-prefix", str(prefix), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(vocab_dir / "vocab.json"), "--merge-file", str(vocab_dir / "merges.txt"),
            "--workers", str(workers), *extra]


@pytest.fixture(scope="module")
def corpus_docs(corpus_path):
    with open(corpus_path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="module")
def corpus_slice(tmp_path_factory, corpus_path):
    """The first 150 documents of the real corpus."""
    path = tmp_path_factory.mktemp("slice") / "slice.jsonl"
    with open(corpus_path, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        for _, line in zip(range(150), f):
            out.write(line)
    return path


def test_round_trip_reproduces_every_document_of_the_real_corpus(tmp_path, corpus_path, corpus_docs, gpt2_vocab_dir):
    from megatron.training.tokenizer import build_tokenizer

    prefix = tmp_path / "kjv"
    result = preprocess_data.main(gpt2_args(corpus_path, prefix, gpt2_vocab_dir, "--append-eod", workers=2))
    args = preprocess_data.get_args(gpt2_args(corpus_path, prefix, gpt2_vocab_dir))
    tokenizer = build_tokenizer(args)
    ds = IndexedDataset(str(prefix) + "_text_document")
    assert ds.dtype == np.uint16  # GPT-2's 50257 ids fit uint16, as in Megatron
    assert ds.num_documents == len(corpus_docs) == result.documents
    assert int(ds.sequence_lengths.sum()) == result.tokens
    for d, text in enumerate(corpus_docs):
        ids = ds[d].tolist()
        assert ids[-1] == tokenizer.eod
        assert tokenizer.detokenize(ids[:-1]) == text, f"document {d} does not round-trip"


def test_workers_and_partitions_give_byte_identical_output(tmp_path, corpus_slice, gpt2_vocab_dir):
    outputs = {}
    for workers, partitions in [(1, 1), (2, 1), (2, 2)]:
        prefix = tmp_path / f"w{workers}p{partitions}"
        preprocess_data.main(gpt2_args(corpus_slice, prefix, gpt2_vocab_dir, "--append-eod",
                                       "--partitions", str(partitions), workers=workers))
        outputs[(workers, partitions)] = files_bytes(str(prefix) + "_text_document")
    assert outputs[(2, 1)] == outputs[(1, 1)]
    assert outputs[(2, 2)] == outputs[(1, 1)]
    # partition work files are gone
    assert sorted(os.listdir(tmp_path)) == sorted(
        f"w{w}p{p}_text_document{ext}" for w, p in outputs for ext in (".bin", ".idx"))


def test_documents_sentences_and_keys(tmp_path):
    input_path = tmp_path / "in.jsonl"
    with open(input_path, "w") as f:
        f.write(json.dumps({"text": "1 2 3", "title": "7"}) + "\n")
        f.write("\n")  # blank lines are skipped
        f.write(json.dumps({"text": ["4 5", "6"], "title": "8 9"}) + "\n")  # a pre-split document
        f.write(json.dumps({"text": "", "title": "1"}) + "\n")  # an empty document is kept
    result = preprocess_data.main(null_args(input_path, tmp_path / "out", "--json-keys", "text", "title",
                                            "--append-eod"))
    assert result.blank_lines == 1 and result.documents == 3
    eod = 1000
    assert read_documents(tmp_path / "out_text_document") == [[[1, 2, 3, eod]], [[4, 5], [6, eod]], []]
    assert read_documents(tmp_path / "out_title_document") == [[[7, eod]], [[8, 9, eod]], [[1, eod]]]


def test_gzip_input(tmp_path):
    with gzip.open(tmp_path / "in.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "3 4"}) + "\n")
    preprocess_data.main(null_args(tmp_path / "in.jsonl.gz", tmp_path / "out"))
    assert read_documents(tmp_path / "out_text_document") == [[[3, 4]]]


def test_a_pipe_is_read_as_a_stream_and_gives_the_files_output(tmp_path):
    # `--input <(zstdcat corpus.jsonl.zst)`: the shell hands over a pipe, read once.
    import threading

    lines = "".join(json.dumps({"text": f"{i} {i + 1} {i + 2}"}) + "\n" for i in range(300))
    (tmp_path / "in.jsonl").write_text(lines)
    preprocess_data.main(null_args(tmp_path / "in.jsonl", tmp_path / "from_file", "--append-eod"))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text(lines), daemon=True)
    writer.start()
    preprocess_data.main(null_args(fifo, tmp_path / "from_pipe", "--append-eod", workers=2))
    writer.join(timeout=10)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"from_pipe_text_document{suffix}").read_bytes() == \
            (tmp_path / f"from_file_text_document{suffix}").read_bytes()
    with pytest.raises(PreprocessError, match=r"is a pipe, which can be read once: --partitions 2 needs a file"):
        preprocess_data.main(null_args(fifo, tmp_path / "x", "--partitions", "2", workers=2))


def test_progress_lines_report_rates(tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", ["1 2"] * 10)
    preprocess_data.main(null_args(tmp_path / "in.jsonl", tmp_path / "out", "--log-interval", "5"))
    err = capsys.readouterr().err
    assert err.count("Processed ") == 2
    assert "Processed 10 documents (" in err and "docs/s" in err and "MB/s)." in err
    assert "Done: 10 documents, 20 tokens" in err and "tokens/s" in err


def test_split_sentences_with_punkt(tmp_path, corpus_slice, nltk_data_dir, bert_vocab_file):
    import nltk

    from megatron.training.tokenizer import build_tokenizer

    docs = [json.loads(line)["text"] for line in open(corpus_slice)][:20]
    write_jsonl(tmp_path / "in.jsonl", docs)
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "bert"),
            "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(bert_vocab_file),
            "--split-sentences", "--workers", "2"]
    preprocess_data.main(argv)
    tokenizer = build_tokenizer(preprocess_data.get_args(argv))
    got = read_documents(tmp_path / "bert_text_sentence")
    assert not (tmp_path / "bert_text_document.bin").exists()
    for text, sentences in zip(docs, got):
        expected = [tokenizer.tokenize(s) for s in nltk.sent_tokenize(text)]
        assert sentences == [ids for ids in expected if ids]
    assert sum(len(s) for s in got) > 5 * len(docs)


def test_keep_newlines_sentences_concatenate_to_the_document(tmp_path, nltk_data_dir, gpt2_vocab_dir):
    text = "First line. Second sentence here!\n\nA new paragraph?  Yes.\n"
    write_jsonl(tmp_path / "in.jsonl", [text])
    preprocess_data.main(gpt2_args(tmp_path / "in.jsonl", tmp_path / "nl", gpt2_vocab_dir,
                                   "--split-sentences", "--keep-newlines"))
    from megatron.training.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(preprocess_data.get_args(gpt2_args(tmp_path / "in.jsonl", tmp_path / "x",
                                                                   gpt2_vocab_dir)))
    sentences = read_documents(tmp_path / "nl_text_sentence")[0]
    assert len(sentences) == 4
    assert tokenizer.detokenize(sentences[1]) == "Second sentence here!\n\n"
    assert "".join(tokenizer.detokenize(s) for s in sentences) == text


def test_missing_punkt_is_a_clear_error_before_any_work(tmp_path, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "empty")])
    write_jsonl(tmp_path / "in.jsonl", ["1 2"])
    with pytest.raises(PreprocessError, match=r"punkt_tab.*nltk.download\('punkt_tab'\)"):
        preprocess_data.main(null_args(tmp_path / "in.jsonl", tmp_path / "out" / "x", "--split-sentences"))
    assert not (tmp_path / "out").exists()


BAD_INPUTS = {
    "malformed": ('{"text": "1 2"}\n{"text": "3 \n{"text": "4"}\n', r"in\.jsonl:2: malformed JSON"),
    "missing_key": ('{"text": "1 2"}\n{"text": "3"}\n{"body": "4"}\n', r"in\.jsonl:3: missing key 'text'"),
    "not_text": ('{"text": 5}\n', r"in\.jsonl:1: key 'text' holds int"),
    "not_object": ('[1, 2]\n', r"in\.jsonl:1: expected a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
@pytest.mark.parametrize("workers,partitions", [(1, 1), (2, 2)])
def test_bad_lines_stop_the_run_and_leave_nothing(tmp_path, case, workers, partitions):
    content, message = BAD_INPUTS[case]
    (tmp_path / "in.jsonl").write_text(content)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(PreprocessError, match=message):
        preprocess_data.main(null_args(tmp_path / "in.jsonl", out / "x", "--partitions", str(partitions),
                                       workers=workers))
    assert os.listdir(out) == []


def test_failed_rerun_keeps_the_existing_dataset(tmp_path):
    write_jsonl(tmp_path / "good.jsonl", ["1 2 3", "4"])
    preprocess_data.main(null_args(tmp_path / "good.jsonl", tmp_path / "x"))
    before = files_bytes(tmp_path / "x_text_document")
    (tmp_path / "bad.jsonl").write_text('{"text": "5"}\n{oops\n')
    with pytest.raises(PreprocessError, match="bad.jsonl:2"):
        preprocess_data.main(null_args(tmp_path / "bad.jsonl", tmp_path / "x"))
    assert files_bytes(tmp_path / "x_text_document") == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "good.jsonl", "x_text_document.bin", "x_text_document.idx"]


def test_skip_bad_lines_counts_them(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "1"}\n{broken\n{"text": "2"}\n{"body": "3"}\n')
    result = preprocess_data.main(null_args(tmp_path / "in.jsonl", tmp_path / "x", "--skip-bad-lines"))
    assert result.skipped_lines == 2 and result.documents == 2
    assert read_documents(tmp_path / "x_text_document") == [[[1]], [[2]]]
    err = capsys.readouterr().err
    assert "Skipped 2 bad lines" in err and "in.jsonl:2: malformed JSON" in err


def test_missing_vocab_file_is_named(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", ["hello"])
    missing = tmp_path / "nope" / "vocab.json"
    argv = gpt2_args(tmp_path / "in.jsonl", tmp_path / "out" / "x", tmp_path / "nope")
    with pytest.raises((FileNotFoundError, ValueError), match=str(missing).replace(".", r"\.")):
        preprocess_data.main(argv)
    assert not (tmp_path / "out").exists()


def test_bad_flags_are_named(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", ["1"])
    with pytest.raises(PreprocessError, match="--input .*missing.jsonl"):
        preprocess_data.main(null_args(tmp_path / "missing.jsonl", tmp_path / "x"))
    with pytest.raises(PreprocessError, match=r"--workers \(1\) must be at least --partitions \(2\)"):
        preprocess_data.main(null_args(tmp_path / "in.jsonl", tmp_path / "x", "--partitions", "2"))


def test_merge_datasets_equals_preprocessing_the_concatenation(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    texts = [f"{i} {i + 1} {i + 2}" for i in range(30)]
    write_jsonl(tmp_path / "a.jsonl", texts[:10])
    write_jsonl(tmp_path / "b.jsonl", texts[10:])
    write_jsonl(tmp_path / "all.jsonl", texts)
    preprocess_data.main(null_args(tmp_path / "a.jsonl", shards / "a", "--append-eod"))
    preprocess_data.main(null_args(tmp_path / "b.jsonl", shards / "b", "--append-eod"))
    preprocess_data.main(null_args(tmp_path / "all.jsonl", tmp_path / "all", "--append-eod"))
    merge_datasets.main(["--input", str(shards), "--output-prefix", str(tmp_path / "merged")])
    assert files_bytes(tmp_path / "merged") == files_bytes(tmp_path / "all_text_document")
    idx = (shards / "b_text_document.idx").read_bytes()
    (shards / "b_text_document.idx").write_bytes(idx[:-3])
    with pytest.raises(IndexedDatasetError, match=r"b_text_document\.idx is truncated"):
        merge_datasets.main(["--input", str(shards), "--output-prefix", str(tmp_path / "merged2")])
    os.remove(shards / "b_text_document.idx")
    with pytest.raises(IndexedDatasetError, match="b_text_document has no .idx"):
        merge_datasets.main(["--input", str(shards), "--output-prefix", str(tmp_path / "merged2")])
    assert not [name for name in os.listdir(tmp_path) if "merged2" in name]


def test_command_line_reports_errors_without_traceback(tmp_path):
    (tmp_path / "in.jsonl").write_text("{bad\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), *null_args(tmp_path / "in.jsonl", tmp_path / "x")],
        capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1
    assert "error: " in proc.stderr and "in.jsonl:1: malformed JSON" in proc.stderr
    assert "Traceback" not in proc.stderr


def _feed_forever(fifo, stop):
    """Write documents into a named pipe until the reader is gone: the run cannot finish on its own."""
    try:
        with open(fifo, "w", encoding="utf-8") as f:
            k = 0
            while not stop.is_set():
                f.write("".join(json.dumps({"text": " ".join(str(i % 997) for i in range(j, j + 50))}) + "\n"
                                for j in range(k, k + 500)))
                k += 500
    except (BrokenPipeError, OSError):
        pass


@pytest.mark.parametrize("sig", ["SIGINT", "SIGKILL"])
def test_interrupted_run_leaves_no_output_under_the_final_names(tmp_path, sig):
    # The input is a pipe fed without end, so the signal always lands mid-run, however loaded the
    # machine is (a finite file could be done before the signal arrives).
    import signal
    import threading

    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    stop = threading.Event()
    feeder = threading.Thread(target=_feed_forever, args=(fifo, stop), daemon=True)
    feeder.start()
    out = tmp_path / "out"
    # Ctrl-C as a terminal delivers it: a shell without job control starts background jobs with
    # SIGINT ignored, and a test run started that way (`make test &`) hands that on to the tool.
    default_sigint = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                      "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.Popen(
        [sys.executable, "-c", default_sigint, str(ROOT / "tools" / "preprocess_data.py"),
         *null_args(fifo, out / "x", "--log-interval", "2000", workers=2)],
        stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    for line in proc.stderr:  # interrupt once it is visibly midway
        if line.startswith("Processed"):
            break
    proc.send_signal(getattr(signal, sig))
    try:
        proc.communicate(timeout=60)
    finally:
        stop.set()
    assert proc.returncode != 0
    final_names = {"x_text_document.bin", "x_text_document.idx"}
    assert not final_names & set(os.listdir(out))
    if sig == "SIGINT":  # Ctrl-C cleans up its temporary files too
        assert os.listdir(out) == []
        assert proc.returncode == 130
