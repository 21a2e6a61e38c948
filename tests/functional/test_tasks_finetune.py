"""BERT fine-tuning end to end (tasks/glue, tasks/race through tasks/finetune_utils.finetune), in
this process at world size 1, on files in the real formats that tools/make_task_fixtures.py writes
from the shared corpus, with the real bert-base-uncased vocabulary and a tiny BERT (2 layers,
hidden 64) that pretrain_bert.py's model provider builds and saves (random weights, torch_dist).

Measured (seed 1234): MNLI reaches 97-99% on dev-matched + dev-mismatched after one epoch of 16
steps (chance 33%); QQP 97-100% after 2 epochs of 16 steps (chance 50%); RACE 100% after one
epoch of 16 steps (chance 25%). The thresholds below leave room for other platforms' arithmetic.
"""
import json
import os
import re

import pytest
import torch

from tests.helpers.finetune_launcher import run_task
from tools.make_task_fixtures import make_fixtures

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--max-position-embeddings", "64",
        "--seq-length", "32", "--micro-batch-size", "16", "--global-batch-size", "16", "--lr", "5e-3",
        "--lr-warmup-fraction", "0.1", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
        "--cpu-threads", "1", "--eval-iters", "1", "--seed", "1234", "--log-interval", "4"]
OVERALL = re.compile(r"^ >> \|epoch: (-?\d+)\| overall: correct / total = (\d+) / (\d+) = (\S+) %$", re.M)


@pytest.fixture(scope="module")
def data(tmp_path_factory, corpus_path):
    return make_fixtures(str(corpus_path), str(tmp_path_factory.mktemp("tasks")), train=256, dev=64)


@pytest.fixture(scope="module")
def vocab(bert_vocab_file):
    return ["--vocab-file", str(bert_vocab_file)]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, vocab):
    """A pretrain_bert.py model (LM head, pooler, binary head: its provider) saved at iteration 1."""
    import pretrain_bert
    from megatron.training.checkpointing import save_checkpoint
    from megatron.core.enums import ModelType
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    path = str(tmp_path_factory.mktemp("bert-pretrained"))
    args = initialize_megatron(argv=[*TINY, *vocab, "--mock-data", "--train-iters", "1", "--save", path,
                                     "--save-interval", "1"],
                               args_defaults={"tokenizer_type": "BertWordPieceLowerCase"})
    model, optimizer, scheduler = setup_model_and_optimizer(pretrain_bert.model_provider, ModelType.encoder_or_decoder)
    save_checkpoint(1, model, optimizer, scheduler, args=args)
    keys = set(model[0].module.state_dict())
    assert {"lm_head.dense.weight", "binary_head.weight", "pooler.dense.weight"} <= keys
    return path, model[0].module.state_dict()["encoder.layers.0.self_attention.linear_qkv.weight"].clone()


def _glue(data, task, *files):
    return [os.path.join(data, task, name) for name in files]


def _race(data, split):
    return [os.path.join(data, "RACE", split, level) for level in ("high", "middle")]


def _overall(out):
    return [(int(e), int(c), int(t)) for e, c, t, _ in OVERALL.findall(out)]


def test_mnli_learns_from_a_pretrain_bert_checkpoint(data, vocab, pretrained, capsys):
    path, qkv = pretrained
    result = run_task([*TINY, *vocab, "--task", "MNLI", "--epochs", "2", "--pretrained-checkpoint", path,
                       "--train-data", *_glue(data, "MNLI", "train.tsv"),
                       "--valid-data", *_glue(data, "MNLI", "dev_matched.tsv", "dev_mismatched.tsv")])
    out = capsys.readouterr().out
    assert "***WARNING*** could not find classification_head in the checkpoint, initializing to random" in out
    assert "could not find pooler" not in out  # the pretrained BERT has one
    assert re.search(r"iteration +16/ +32 \| .*\| lm loss: \S+ \|", out)  # Megatron's log line, 16 steps/epoch
    assert re.search(r"^ > \|epoch: 0\| metrics for dev-matched: correct / total = \d+ / 64 = \S+ %, elapsed time "
                     r"\(sec\): \S+$", out, re.M)
    assert re.search(r"^ > \|epoch: 1\| metrics for dev-mismatched: ", out, re.M)
    overall = _overall(out)
    assert [(e, t) for e, _, t in overall] == [(0, 128), (1, 128)]
    assert overall[-1][1] / 128 > 0.8, overall  # chance: 1/3
    assert [r[1] for r in result.accuracy if r[0] == 1] == ["dev-matched", "dev-mismatched", "overall"]
    losses = [r.losses["lm loss"] for r in result.history]
    assert len(losses) == 32 and 0.9 < losses[0] < 1.3 and sum(losses[-4:]) / 4 < 0.8  # log 3 = 1.1 at the start


def test_qqp_learns_and_reads_the_test_file(data, vocab, pretrained, tmp_path, capsys):
    path, _ = pretrained
    ckpt = str(tmp_path / "qqp")
    run_task([*TINY, *vocab, "--task", "QQP", "--epochs", "3", "--pretrained-checkpoint", path, "--save", ckpt,
              "--train-data", *_glue(data, "QQP", "train.tsv"), "--valid-data", *_glue(data, "QQP", "dev.tsv")])
    out = capsys.readouterr().out
    overall = _overall(out)
    assert len(overall) == 3 and overall[-1][1] / overall[-1][2] > 0.85, overall  # chance: 1/2
    # the best epoch's checkpoint is named (the first of the best, on a tie); every epoch's is kept
    best = json.loads(open(os.path.join(ckpt, "best_checkpoint.json")).read())
    accuracies = [c / t for _, c, t in overall]
    epoch = accuracies.index(max(accuracies))
    steps = int(re.search(r"iteration +\d+/ +(\d+) \|", out)[1]) // 3
    assert best == {"iteration": (epoch + 1) * steps, "epoch": epoch, "overall_accuracy": max(accuracies)}
    assert os.path.isdir(os.path.join(ckpt, f"iter_{best['iteration']:07d}"))
    assert f" >> best checkpoint: iteration {best['iteration']} (epoch {epoch})" in out
    # --epochs 0: evaluation only, the test file's 3 columns read with the placeholder label 0
    result = run_task([*TINY, *vocab, "--task", "QQP", "--epochs", "0", "--load", ckpt,
                       "--valid-data", *_glue(data, "QQP", "test.tsv")])
    out = capsys.readouterr().out
    assert "evaluation only mode, setting epoch to -1" in out
    assert "reading id, question1, and question2 columns and setting labels to 0" in out
    assert result.accuracy[-1][0] == -1 and result.accuracy[-1][3] == 64
    name = result.accuracy[0][1]
    predictions = torch.load(os.path.join(ckpt, f"predictions_{name}.pt"), weights_only=False)
    softmaxes, labels, ids = predictions[0][1]
    assert len(softmaxes) == 64 and sorted(ids) == list(range(64)) and set(labels) == {0}


def test_race_learns(data, vocab, pretrained, capsys):
    path, _ = pretrained
    result = run_task([*TINY, *vocab, "--task", "RACE", "--epochs", "1", "--pretrained-checkpoint", path,
                       "--seq-length", "64", "--micro-batch-size", "8", "--global-batch-size", "8",
                       "--train-data", *_race(data, "train"), "--valid-data", *_race(data, "dev")])
    out = capsys.readouterr().out
    assert "***WARNING*** could not find multichoice_head in the checkpoint, initializing to random" in out
    assert re.search(r"global batch size: +32 \|", out)  # 8 questions x 4 choices (Megatron's sample_multiplier)
    assert re.search(r"^ > \|epoch: 0\| metrics for dev-high: correct / total = \d+ / 16 ", out, re.M)
    correct, total = result.accuracy[-1][2:]
    assert total == 32 and correct / total > 0.75, result.accuracy  # chance: 1/4


def test_a_stopped_and_resumed_run_repeats_the_uninterrupted_one(data, vocab, pretrained, tmp_path):
    """MNLI with dropout on, 2 epochs of 16 steps; the second run stops at step 21 (--exit-interval,
    in the second epoch, after the first epoch's checkpoint and accuracy) and a third resumes it from
    --load: the same losses, and the second epoch's accuracy as the uninterrupted run's."""
    path, _ = pretrained
    common = [*TINY, *vocab, "--task", "MNLI", "--epochs", "2", "--pretrained-checkpoint", path, "--hidden-dropout",
              "0.1", "--attention-dropout", "0.1", "--train-data", *_glue(data, "MNLI", "train.tsv"),
              "--valid-data", *_glue(data, "MNLI", "dev_matched.tsv")]
    whole = run_task(common)
    ckpt = str(tmp_path / "ckpt")
    stopped = run_task([*common, "--save", ckpt, "--exit-interval", "21"])
    assert stopped.exit_reason == "interval" and [r.iteration for r in stopped.history] == list(range(1, 22))
    resumed = run_task([*common, "--save", ckpt, "--load", ckpt])
    assert [r.iteration for r in resumed.history] == list(range(22, 33))
    assert [r.losses for r in stopped.history + resumed.history] == [r.losses for r in whole.history]
    assert stopped.accuracy + resumed.accuracy == whole.accuracy
    assert whole.accuracy[-1][2] / whole.accuracy[-1][3] > 0.45, whole.accuracy  # above chance (1/3): 56% measured


def test_a_malformed_row_is_one_line_naming_file_and_line(data, vocab, tmp_path, capsys):
    from megatron.training.cli import run_cli

    bad = tmp_path / "MNLI" / "train.tsv"
    bad.parent.mkdir()
    lines = open(_glue(data, "MNLI", "train.tsv")[0]).read().splitlines()
    lines[3] = lines[3].replace("\tentailment\tentailment", "\tentailment").replace("\tneutral\tneutral", "\tneutral") \
        .replace("\tcontradiction\tcontradiction", "\tcontradiction")
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: run_task([*TINY, *vocab, "--task", "MNLI", "--epochs", "1", "--train-data", str(bad),
                                  "--valid-data", *_glue(data, "MNLI", "dev_matched.tsv")]), "main.py")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"main.py: error: {bad}:4: 11 columns, the header has 12"]


def test_the_example_script_fine_tunes_the_pretrained_bert(data, vocab, pretrained, tmp_path):
    """examples/finetune_mnli.sh as a user runs it (bash, torchrun, tasks/main.py), on the fixture
    files and the tiny pretrained BERT (EXTRA_ARGS shrink the example's model flags to it)."""
    import subprocess
    import sys

    from tests.helpers.paths import ROOT

    if not os.path.isfile(os.path.join(ROOT, "tasks", "main.py")):
        pytest.skip("tasks/main.py (helper evalzs's) is not in this checkout yet")
    path, _ = pretrained
    extra = ("--num-layers 2 --hidden-size 64 --max-position-embeddings 64 --seq-length 32 --micro-batch-size 16 "
             "--lr 5e-3 --hidden-dropout 0 --attention-dropout 0 --cpu-threads 1")
    env = dict(os.environ, PYTHON=sys.executable, EPOCHS="1", EXTRA_ARGS=extra,
               MASTER_PORT=str(29600 + os.getpid() % 300))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "finetune_mnli.sh"), path, vocab[1], data,
                           str(tmp_path / "ckpt")], env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    overall = _overall(out)
    assert [(e, t) for e, _, t in overall] == [(0, 128)], out[-3000:]
    assert re.search(r"successfully saved checkpoint from iteration +16 to ", out)
