"""Training-loop features end to end: schedules with ramp-up, exits, checkpoints, TensorBoard, CLI."""
import math
import os
import signal
import subprocess
import sys

import pytest

import pretrain_gpt
from megatron.training import checkpointing
from megatron.training.checkpointing import CheckpointError, get_checkpoint_tracker_filename
from tests.helpers.launch import run_cli
from tests.helpers.paths import ROOT
from tests.helpers.training import MOCK, TINY, log_lines, losses

QUIET = ["--eval-iters", "0"]


def cosine_lr(samples, max_lr, min_lr, warmup, decay):
    if samples <= warmup:
        return max_lr * samples / warmup
    ratio = (samples - warmup) / (decay - warmup)
    return min_lr + (max_lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def test_rampup_batch_sizes_and_lr_follow_the_consumed_samples(capsys):
    """--rampup-batch-size 2 2 16 to a global batch of 6 over 64 samples; LR warmup+cosine in samples."""
    result = pretrain_gpt.main(
        [*TINY, *MOCK, *QUIET, "--global-batch-size", "6", "--rampup-batch-size", "2", "2", "16",
         "--train-samples", "64", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine",
         "--lr-warmup-samples", "8", "--lr-decay-samples", "64"], record_history=True)
    # 8 samples per increment of 2: batches of 2 until 8 samples, 4 until 16, then 6
    expected_gbs = [2, 2, 2, 2, 4, 4] + [6] * 8
    assert [r.global_batch_size for r in result.history] == expected_gbs
    consumed = [sum(expected_gbs[:i + 1]) for i in range(len(expected_gbs))]
    expected_lr = [cosine_lr(c, 1e-2, 1e-3, 8, 64) for c in consumed]
    assert [r.learning_rate for r in result.history] == pytest.approx(expected_lr, rel=1e-12, abs=1e-15)
    rows = log_lines(capsys.readouterr().out)
    assert [r["gbs"] for r in rows] == expected_gbs and [r["consumed"] for r in rows] == consumed
    assert all(r["train_iters"] == 14 for r in rows)
    assert [r["lr"] for r in rows] == pytest.approx(expected_lr, rel=1e-6)


def closed_form_lr(style, n, max_lr=1e-2, min_lr=1e-3, warmup=8, decay=40, wsd=16):
    """Megatron's schedule at n consumed samples (warmup/decay/WSD lengths in samples)."""
    if n <= warmup:
        return max_lr * n / warmup
    if style == "constant":
        return max_lr
    if n > decay:  # past the decay, every style but constant holds min_lr (inverse-sqrt too)
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(n))
    if style == "WSD":
        ratio = max(0.0, (n - (decay - wsd)) / wsd)
        return min_lr + (max_lr - min_lr) * (1.0 - ratio)
    ratio = (n - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + (max_lr - min_lr) * coeff


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root", "WSD"])
def test_every_lr_style_in_iterations_follows_the_closed_form_in_samples(style):
    """--lr-warmup-iters 2 / --lr-decay-iters 10 / --lr-wsd-decay-iters 4 at a global batch of 4."""
    extra = ["--lr-wsd-decay-style", "linear", "--lr-wsd-decay-iters", "4"] if style == "WSD" else []
    result = pretrain_gpt.main(
        [*TINY, *MOCK, *QUIET, "--train-iters", "12", "--lr", "1e-2", "--min-lr", "1e-3",
         "--lr-decay-style", style, "--lr-warmup-iters", "2", "--lr-decay-iters", "10", *extra],
        record_history=True)
    expected = [closed_form_lr(style, 4 * i) for i in range(1, 13)]
    assert [r.learning_rate for r in result.history] == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_exit_duration_saves_and_exits(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    result = pretrain_gpt.main([*TINY, *MOCK, *QUIET, "--train-iters", "50", "--exit-duration-in-mins", "1e-9",
                                "--save", ckpt, "--save-interval", "50"])
    assert result.exit_reason == "duration" and result.iteration == 1
    assert open(get_checkpoint_tracker_filename(ckpt)).read() == "1"
    assert "exiting program after" in capsys.readouterr().out


def test_crash_during_save_leaves_the_previous_checkpoint_to_resume_from(tmp_path, monkeypatch):
    common = [*TINY, *MOCK, *QUIET, "--train-iters", "6", "--ckpt-format", "torch"]  # one torch.save per file
    straight = pretrain_gpt.main(common, record_history=True)
    ckpt = str(tmp_path / "ckpt")
    real_save, calls = checkpointing.torch.save, {"n": 0}

    def crashing_save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the save at iteration 4 dies half-way through writing
            f.write(b"partial")
            raise OSError("disk full")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpointing.torch, "save", crashing_save)
    with pytest.raises(CheckpointError, match="iteration 4 was not saved: .*disk full.*still names iteration 2"):
        pretrain_gpt.main([*common, "--save", ckpt, "--save-interval", "2"])
    monkeypatch.setattr(checkpointing.torch, "save", real_save)
    assert open(get_checkpoint_tracker_filename(ckpt)).read() == "2"
    resumed = pretrain_gpt.main([*common, "--load", ckpt], record_history=True)
    assert losses(resumed) == losses(straight)[2:]


def test_checkpoint_shape_mismatch_use_checkpoint_args_and_finetune(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pretrain_gpt.main([*TINY, *MOCK, *QUIET, "--train-iters", "2", "--save", ckpt, "--save-interval", "2"])
    wider = [*TINY, *MOCK, *QUIET, "--train-iters", "4", "--hidden-size", "64", "--load", ckpt]
    with pytest.raises(CheckpointError, match="--hidden-size"):
        pretrain_gpt.main(wider)
    # --train-iters changed, so the LR schedule changed too: say which one wins, as in Megatron
    resumed = pretrain_gpt.main([*wider, "--use-checkpoint-args", "--override-opt_param-scheduler"],
                                record_history=True)
    assert [r.iteration for r in resumed.history] == [3, 4]
    finetuned = pretrain_gpt.main([*TINY, *MOCK, *QUIET, "--train-iters", "2", "--load", ckpt, "--finetune"],
                                  record_history=True)
    assert [r.iteration for r in finetuned.history] == [1, 2]
    assert [r.global_batch_size for r in finetuned.history] == [4, 4]


def test_tensorboard_scalars(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    logdir = tmp_path / "tb"
    pretrain_gpt.main([*TINY, *MOCK, "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
                       "--tensorboard-dir", str(logdir)])
    events = event_accumulator.EventAccumulator(str(logdir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("lm loss", "learning-rate", "batch-size", "grad-norm", "loss-scale", "throughput",
                "iteration-time", "lm loss validation", "lm loss validation ppl", "lm loss vs samples"):
        assert tag in tags, tag
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("batch-size")] == [4.0] * 4


def test_torchrun_one_process_trains_and_saves_megatron_layout(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run_cli(["-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29641",
                    "pretrain_gpt.py", *TINY, *MOCK, *QUIET, "--train-iters", "3", "--save", str(ckpt),
                    "--save-interval", "3"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["iteration"] for r in log_lines(proc.stdout)] == [1, 2, 3]
    # the default --ckpt-format torch_dist, as Megatron's: metadata.json, common.pt and the rank's DCP file
    assert all((ckpt / "iter_0000003" / name).is_file() for name in ("metadata.json", "common.pt", "__0_0.distcp"))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert "progress: 3/3 iterations (100.0%)" in proc.stderr


def test_bad_flags_fail_fast_on_the_command_line():
    proc = run_cli(["pretrain_gpt.py", *TINY, *MOCK, "--train-iters", "3", "--fp16", "--bf16"])
    assert proc.returncode != 0
    assert "--fp16" in proc.stderr and "--bf16" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sigterm_with_exit_signal_handler_saves_and_exits(tmp_path):
    """SIGTERM to the whole process group, DataLoader workers included (as a scheduler sends it)."""
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "pretrain_gpt.py", *TINY, *MOCK, *QUIET, "--train-iters", "100000",
                             "--exit-signal-handler", "--save", str(ckpt), "--save-interval", "100000",
                             "--num-workers", "2"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if " iteration        3/" in line:
                os.killpg(proc.pid, signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "exiting program after receiving SIGTERM." in out
    iteration = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert iteration >= 3
    assert (ckpt / f"iter_{iteration:07d}" / "__0_0.distcp").is_file()  # the default torch_dist format


class FakeWandb:
    """Stands in for the wandb package: records init/log/finish."""

    def __init__(self):
        self.inits, self.logs, self.finished = [], [], False

    def init(self, **kwargs):
        self.inits.append(kwargs)

    def log(self, values, step):
        self.logs.append((step, dict(values)))

    def finish(self):
        self.finished = True


def test_wandb_logs_the_same_scalars(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    pretrain_gpt.main([*TINY, *MOCK, *QUIET, "--train-iters", "2", "--wandb-project", "proj",
                       "--wandb-exp-name", "run1", "--wandb-save-dir", str(tmp_path)])
    assert fake.inits[0]["project"] == "proj" and fake.inits[0]["name"] == "run1"
    assert fake.inits[0]["config"]["hidden_size"] == 32
    steps = {step for step, values in fake.logs if "lm loss" in values}
    assert steps == {1, 2}


def test_sgd_timers_and_log_interval_averaging(capsys):
    """--optimizer sgd trains; --timing-log-level 1 prints the timers; a line averages its interval."""
    result = pretrain_gpt.main([*TINY, *MOCK, *QUIET, "--train-iters", "4", "--optimizer", "sgd",
                                "--log-interval", "2", "--timing-log-level", "1"], record_history=True)
    out = capsys.readouterr().out
    rows = log_lines(out)
    assert [r["iteration"] for r in rows] == [2, 4]
    values = [r.losses["lm loss"] for r in result.history]
    assert rows[0]["loss"] == pytest.approx((values[0] + values[1]) / 2, rel=1e-6)
    assert rows[1]["loss"] == pytest.approx((values[2] + values[3]) / 2, rel=1e-6)
    assert out.count("(min, max) time across ranks (ms):") == 2
    assert "    forward-backward ...." in out and "    optimizer ...." in out


def test_skip_train_only_evaluates_the_loaded_checkpoint(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    pretrain_gpt.main([*TINY, *MOCK, *QUIET, "--train-iters", "2", "--save", ckpt, "--save-interval", "2"])
    capsys.readouterr()
    result = pretrain_gpt.main([*TINY, *MOCK, "--train-iters", "2", "--eval-iters", "1", "--load", ckpt,
                                "--skip-train"], record_history=True)
    out = capsys.readouterr().out
    assert result.history == [] and log_lines(out) == []
    assert [label for label, _ in result.validation] == ["iteration 2 on validation set", "iteration 2 on test set"]
    assert " validation loss at iteration 2 on validation set | lm loss value: " in out
