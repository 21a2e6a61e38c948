"""Bad input ends as one line `PROG: error: ...` and exit status 1, without a traceback (megatron/training/cli.py).

Each case runs an entry point's main() in-process through run_cli, as its `__main__` does; the
subprocess and torchrun runs are in tests/functional/test_cli_exit_status.py.
"""

import json
import re

import pytest

import pretrain_gpt
from megatron.training import cli
from megatron.training.arguments_validation import ArgsError
from tests.helpers.training import MOCK, TINY
from tools import inspect_dataset, make_default_corpus, merge_datasets, preprocess_data, train_tokenizer

MODEL = [*TINY, "--num-layers", "1", "--hidden-size", "16", "--seq-length", "16", "--max-position-embeddings", "16",
         "--eval-iters", "0"]
SMALL = [*MODEL, *MOCK]


def run_entry_point(capsys, main, prog, errors=()):
    """run_cli(main) as a program does: (exit status, stderr lines)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.run_cli(main, prog, errors=errors)
    err = capsys.readouterr().err
    return exit_info.value.code, [line for line in err.splitlines() if line.strip()]


def assert_one_error_line(status, lines, prog, *words):
    assert status == 1
    assert not any("Traceback" in line for line in lines), lines
    errors = [line for line in lines if line.startswith(f"{prog}: error: ")]
    assert len(errors) == 1, lines
    for word in words:
        assert word in errors[0], (word, errors[0])
    return errors[0]


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", cli.DEBUG_ENV):
        monkeypatch.delenv(name, raising=False)


# (flags, words the message must contain)
BAD_FLAGS = [
    (["--seed", "-1"], ["--seed", "-1"]),
    (["--seed", "0"], ["--seed must be an integer in [1, "]),
    (["--lr", "nan"], ["--lr must be a finite number, got nan"]),
    (["--lr", "inf"], ["--lr must be a finite number, got inf"]),
    (["--lr", "-1"], ["--lr must be >= 0"]),
    (["--min-lr", "nan"], ["--min-lr must be a finite number"]),
    (["--adam-beta1", "1.5"], ["--adam-beta1 must be in [0, 1), got 1.5"]),
    (["--adam-beta2", "1.0"], ["--adam-beta2 must be in [0, 1), got 1.0"]),
    (["--adam-beta2", "nan"], ["--adam-beta2 must be in [0, 1)"]),
    (["--adam-eps", "-1"], ["--adam-eps must be > 0, got -1.0"]),
    (["--adam-eps", "0"], ["--adam-eps must be > 0"]),
    (["--weight-decay", "-0.1"], ["--weight-decay must be >= 0"]),
    (["--clip-grad", "-1"], ["--clip-grad must be >= 0"]),
    (["--clip-grad", "inf"], ["--clip-grad must be a finite number"]),
    (["--init-method-std", "0"], ["--init-method-std must be > 0"]),
    (["--init-method-std", "nan"], ["--init-method-std must be a finite number"]),
    (["--attention-dropout", "-0.1"], ["--attention-dropout must be in [0, 1)"]),
    (["--hidden-dropout", "nan"], ["--hidden-dropout must be in [0, 1)"]),
    (["--sgd-momentum", "1.5", "--optimizer", "sgd"], ["--sgd-momentum must be in [0, 1)"]),
    (["--initial-loss-scale", "nan", "--fp16"], ["--initial-loss-scale must be a finite number"]),
    (["--attention-backend", "local", "--use-flash-attn"], ["--attention-backend local", "--use-flash-attn"]),
]


@pytest.mark.parametrize("flags, words", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_and_exit_1(capsys, flags, words):
    status, lines = run_entry_point(capsys, lambda: pretrain_gpt.main([*SMALL, "--train-iters", "1", *flags]),
                                    "pretrain_gpt.py")
    assert_one_error_line(status, lines, "pretrain_gpt.py", *words)


def test_megatron_debug_shows_the_traceback(capsys, monkeypatch):
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(ArgsError, match="--adam-beta1 must be in"):
        cli.run_cli(lambda: pretrain_gpt.main([*SMALL, "--train-iters", "1", "--adam-beta1", "1.5"]), "pretrain_gpt.py")
    monkeypatch.setenv(cli.DEBUG_ENV, "0")  # 0 is off
    status, lines = run_entry_point(capsys, lambda: pretrain_gpt.main([*SMALL, "--train-iters", "1", "--adam-beta1",
                                                                       "1.5"]), "p")
    assert status == 1


def test_a_bug_keeps_its_traceback(capsys):
    def broken():
        raise RuntimeError("an internal error")

    with pytest.raises(RuntimeError, match="an internal error"):
        cli.run_cli(broken, "x.py")


def test_success_and_usage_errors_keep_their_status(capsys):
    with pytest.raises(SystemExit) as ok:
        cli.run_cli(lambda: None, "x.py")
    assert ok.value.code == 0
    with pytest.raises(SystemExit) as usage:  # an unknown flag still fails as argparse does
        cli.run_cli(lambda: pretrain_gpt.main([*SMALL, "--no-such-flag"]), "pretrain_gpt.py")
    assert usage.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_ctrl_c_exits_130(capsys):
    def interrupted():
        raise KeyboardInterrupt

    status, lines = run_entry_point(capsys, interrupted, "x.py")
    assert status == 130 and lines == ["x.py: interrupted"]


def test_os_errors_name_the_path(capsys, tmp_path):
    status, lines = run_entry_point(capsys, lambda: open(tmp_path / "missing.txt"), "x.py")
    assert_one_error_line(status, lines, "x.py", f"{tmp_path / 'missing.txt'}: No such file or directory")


# ----------------------------------------------------------------------------- GPT-2 files swapped


@pytest.fixture
def gpt2_files(tmp_path):
    vocab = {"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    return tmp_path / "vocab.json", tmp_path / "merges.txt"


@pytest.mark.parametrize("swap", ["both", "vocab", "merges"])
def test_swapped_vocab_and_merge_files_are_named(capsys, gpt2_files, swap):
    vocab, merges = gpt2_files
    given = {"both": (merges, vocab), "vocab": (merges, merges), "merges": (vocab, vocab)}[swap]
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(given[0]), "--merge-file", str(given[1])]
    argv = [*MODEL, "--mock-data", *tokenizer, "--train-iters", "1"]
    status, lines = run_entry_point(capsys, lambda: pretrain_gpt.main(argv), "pretrain_gpt.py")
    if swap == "merges":
        line = assert_one_error_line(status, lines, "pretrain_gpt.py", f"--merge-file {vocab}",
                                     "looks like a JSON vocabulary (vocab.json)")
    else:
        line = assert_one_error_line(status, lines, "pretrain_gpt.py", f"--vocab-file {merges}",
                                     "looks like a BPE merges file")
    assert "are --vocab-file and --merge-file swapped?" in line


def test_gpt2_files_that_are_neither_are_named(tmp_path, gpt2_files):
    from megatron.training.tokenizer.gpt2_bpe import read_merges, read_vocab
    from megatron.training.tokenizer.tokenizer import TokenizerConfigError

    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(TokenizerConfigError, match="list.json is JSON but not GPT-2's vocab.json"):
        read_vocab(str(tmp_path / "list.json"))
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TokenizerConfigError, match="binary is not a text file"):
        read_vocab(str(tmp_path / "binary"))
    (tmp_path / "bad_merges.txt").write_text("#version: 0.2\na b\nc d e\n")
    with pytest.raises(TokenizerConfigError, match=r"bad_merges.txt:3: expected a merge 'left right'"):
        read_merges(str(tmp_path / "bad_merges.txt"))
    assert read_merges(str(gpt2_files[1])) == [("a", "b")]


# ----------------------------------------------------------------------------- resuming with a longer run


def test_resuming_with_a_longer_train_iters_says_which_flag_to_pass(capsys, tmp_path):
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    pretrain_gpt.main([*SMALL, *ckpt, "--train-iters", "1"])
    capsys.readouterr()
    longer = [*SMALL, *ckpt, "--load", str(tmp_path / "ckpt"), "--train-iters", "2"]
    status, lines = run_entry_point(capsys, lambda: pretrain_gpt.main(longer), "pretrain_gpt.py")
    line = assert_one_error_line(status, lines, "pretrain_gpt.py", "total number of iterations",
                                 "1 iterations (4 samples) in the checkpoint, 2 iterations (8 samples) in this run",
                                 "--lr-decay-iters 1", "--use-checkpoint-opt_param-scheduler",
                                 "--override-opt_param-scheduler")
    assert re.search(r"--lr-decay-iters, which defaults to --train-iters", line)
    # The suggested flag resumes, continuing the old schedule (--override-opt_param-scheduler:
    # tests/unit/test_lr_schedule.py).
    result = pretrain_gpt.main([*longer, "--lr-decay-iters", "1"])
    assert result.iteration == 2


# ----------------------------------------------------------------------------- the tools


def test_tools_report_bad_input_as_one_line(capsys, tmp_path):
    status, lines = run_entry_point(capsys, lambda: merge_datasets.main(["--input", str(tmp_path), "--output-prefix",
                                                                         str(tmp_path / "m")]), "merge_datasets.py")
    assert_one_error_line(status, lines, "merge_datasets.py", f"--input {tmp_path} holds no .bin/.idx datasets")
    status, lines = run_entry_point(capsys, lambda: inspect_dataset.main(["--data-path", str(tmp_path / "none")]),
                                    "inspect_dataset.py")
    assert_one_error_line(status, lines, "inspect_dataset.py", str(tmp_path / "none"))
    (tmp_path / "in.txt").write_bytes(b"fine\nstill fine\nnot \xff fine\n")
    argv = ["--input", str(tmp_path / "in.txt"), "--tokenizer-type", "BertWordPieceCase", "--vocab-size", "30",
            "--output-dir", str(tmp_path / "tok")]
    status, lines = run_entry_point(capsys, lambda: train_tokenizer.main(argv), "train_tokenizer.py",
                                    errors=(train_tokenizer.InputError, train_tokenizer.MissingPackageError))
    assert_one_error_line(status, lines, "train_tokenizer.py", f"{tmp_path / 'in.txt'}:3: not valid UTF-8 (byte 0xff")
    assert not (tmp_path / "tok").exists()
    (tmp_path / "empty.jsonl").write_text("")
    argv = ["--input", str(tmp_path / "empty.jsonl"), "--output-prefix", str(tmp_path / "x"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--workers", "1"]
    status, lines = run_entry_point(capsys, lambda: preprocess_data.main(argv), "preprocess_data.py",
                                    errors=(preprocess_data.PreprocessError,))
    assert_one_error_line(status, lines, "preprocess_data.py", "no documents to write")
    status, lines = run_entry_point(capsys, lambda: make_default_corpus.main(["--output", str(tmp_path)]),
                                    "make_default_corpus.py")
    assert_one_error_line(status, lines, "make_default_corpus.py", f"{tmp_path}: is a folder; give --output the path")


# ----------------------------------------------------------------------------- once under torchrun


class FakeStore:
    """The set/get/wait of torch.distributed.Store, over a dict; wait raises when the key is missing."""

    def __init__(self, values=None):
        self.values = dict(values or {})

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]

    def wait(self, keys, timeout):
        if not all(key in self.values for key in keys):
            raise RuntimeError("Socket Timeout")


def _as_rank(monkeypatch, rank, world_size=2):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")


def test_ranks_that_agree_with_rank_0_stay_quiet(capsys, monkeypatch):
    store = FakeStore()
    _as_rank(monkeypatch, 0)
    cli.report_error("p.py", "--seed must be ...", store)
    _as_rank(monkeypatch, 1)
    cli.report_error("p.py", "--seed must be ...", store)
    assert capsys.readouterr().err == "p.py: error: --seed must be ...\n"
    cli.report_error("p.py", "mp_rank_01 is missing", store)  # rank 1 disagrees: said, with its rank
    assert capsys.readouterr().err == "[rank 1] p.py: error: mp_rank_01 is missing\n"


def test_without_rank_0_or_a_store_each_rank_reports(capsys, monkeypatch):
    monkeypatch.setattr(cli, "REPORT_WAIT_S", 0.01)
    _as_rank(monkeypatch, 3, world_size=4)
    cli.report_error("p.py", "only here", FakeStore())  # rank 0 reported nothing
    cli.report_error("p.py", "no store", None)  # not under torchrun: no agent store
    assert capsys.readouterr().err == "[rank 3] p.py: error: only here\n[rank 3] p.py: error: no store\n"
