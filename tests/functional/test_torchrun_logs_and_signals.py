"""torchrun end to end: whole log lines in merged output, and --exit-signal-handler under SIGTERM.

Two runs serve every test, both read as a user reads them (`PYTHONUNBUFFERED=1 torchrun ... 2>&1`,
stdout and stderr in one pipe):
- a 2-rank pipeline-parallel run (PP=2, --num-workers 2) stopped by SIGTERM sent to every process
  of the job, DataLoader workers included, as a scheduler sends it;
- its resume on 4 ranks (PP=2 x DP=2).
In both layouts several ranks are data-parallel rank 0 while only the last prints the log line.
torchrun starts tests/functional/record_exit_status.py, which runs pretrain_gpt.py and records
each training process's exit status (torchrun, signalled itself, reports none).
"""

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers.launch import free_port
from tests.helpers.paths import ROOT
from tests.helpers.training import LOG_LINE, MOCK, TINY, log_lines

LOG_INTERVAL = 2
FLAGS = [*TINY, *MOCK, "--ckpt-format", "torch", "--pipeline-model-parallel-size", "2", "--log-interval", str(LOG_INTERVAL),
         "--eval-interval", "2", "--eval-iters", "1"]
PROGRESS = re.compile(r"^progress: (\d+)/\d+ iterations \(\d+\.\d%\) \| elapsed \d+:\d\d:\d\d \| "
                      r"ETA (?:\d+:\d\d:\d\d|\?) \| \d+\.\d\d it/s$")
VALIDATION = re.compile(r"^ validation loss at iteration (\d+)(?: on (?:validation|test) set)? \| "
                        r"lm loss value: \S+ \| lm loss PPL: \S+ \| $")
# A line holding one of these must be that kind of line, whole, from its first to its last character.
WHOLE = {"| consumed samples:": LOG_LINE, "progress:": PROGRESS, "validation loss at": VALIDATION}
SIGNAL_AFTER = 4  # SIGTERM once the log line of this iteration is out


def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def _torchrun(nproc):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(free_port())]


def _process_tree(pid):
    """{pid: parent pid} for pid and all its descendants (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the name
    tree, todo = {pid: parents.get(pid)}, [pid]
    while todo:
        parent = todo.pop()
        for child, its_parent in parents.items():
            if its_parent == parent:
                tree[child] = parent
                todo.append(child)
    return tree


def _run_until_sigterm(ckpt, status_dir):
    """The 2-rank run, SIGTERM to every process once iteration SIGNAL_AFTER is logged."""
    command = [*_torchrun(2), "tests/functional/record_exit_status.py", "pretrain_gpt.py", *FLAGS,
               "--num-workers", "2", "--train-iters", "200", "--exit-signal-handler", "--save", str(ckpt),
               "--save-interval", "100000"]
    # torchrun's grace period before it kills the ranks (30 s by default): ample on a loaded machine
    env = _env(EXIT_STATUS_DIR=str(status_dir), TORCH_ELASTIC_SHUTDOWN_TIMEOUT="120")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines, logged = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if f" iteration {SIGNAL_AFTER:8d}/" in line:
                logged.set()
        logged.set()  # the run ended before that

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    tree = {}
    try:
        logged.wait(timeout=240)
        tree = _process_tree(proc.pid)
        for pid in tree:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        proc.wait(timeout=180)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            for pid in _process_tree(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
    return proc.returncode, "".join(lines), tree


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("torchrun-signals")
    ckpt, status_dir = base / "ckpt", base / "status"
    status_dir.mkdir()
    returncode, out, tree = _run_until_sigterm(ckpt, status_dir)
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    saved = int(tracker.read_text()) if tracker.is_file() else None
    resumed = None
    if saved is not None:  # 4 more iterations, on the schedule of the checkpoint (--train-iters changes)
        resumed = subprocess.run([*_torchrun(4), "pretrain_gpt.py", *FLAGS, "--num-workers", "0", "--load",
                                  str(ckpt), "--train-iters", str(saved + 4),
                                  "--use-checkpoint-opt_param-scheduler"],
                                 cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 timeout=300)
    return {"returncode": returncode, "out": out, "tree": tree, "ckpt": ckpt, "saved": saved,
            "status": {p.name: p.read_text() for p in status_dir.iterdir()}, "resumed": resumed}


def test_sigterm_to_every_process_of_a_torchrun_job_saves_and_every_rank_exits_0(runs):
    out, tree = runs["out"], runs["tree"]
    # the signal reached torchrun, the 2 launchers, the 2 training processes and their loaders' workers
    torchrun = next(iter(tree))
    launchers = [pid for pid, parent in tree.items() if parent == torchrun]
    training = [pid for pid, parent in tree.items() if parent in launchers]
    workers = [pid for pid, parent in tree.items() if parent in training]
    assert len(launchers) == 2 and len(training) == 2, tree
    assert len(workers) >= 4, tree  # 2 per training process for its train loader alone
    assert "DataLoader worker" not in out, out[-4000:]
    assert runs["status"] == {"rank0": "0", "rank1": "0"}, out[-4000:]  # every training process exited 0
    assert "exiting program after receiving SIGTERM." in out
    saved = runs["saved"]
    assert saved is not None and saved >= SIGNAL_AFTER, out[-4000:]
    assert f"successfully saved checkpoint from iteration {saved:7d}" in out
    assert max(row["iteration"] for row in log_lines(out)) <= saved  # nothing trained after the save
    folder = runs["ckpt"] / f"iter_{saved:07d}"
    assert sorted(p.name for p in folder.iterdir()) == ["checksums.json", "mp_rank_00_000", "mp_rank_00_001"]
    assert all((folder / d / "model_optim_rng.pt").is_file() for d in ("mp_rank_00_000", "mp_rank_00_001"))
    # torchrun itself: its agent turns the signal into SignalException, signals each worker's process
    # group, waits for them (up to --shutdown-timeout, 30 s) and re-raises: status 1, whatever theirs.
    assert runs["returncode"] == 1 and "SignalException: Process" in out and "got signal: 15" in out


def test_the_4_rank_resume_continues_at_the_saved_iteration(runs):
    proc, saved = runs["resumed"], runs["saved"]
    assert proc is not None and proc.returncode == 0, (proc.stdout if proc else runs["out"])[-4000:]
    assert f"at iteration {saved}" in proc.stdout and "successfully loaded checkpoint from" in proc.stdout
    rows = log_lines(proc.stdout)
    assert [row["iteration"] for row in rows] == [i for i in range(saved + 1, saved + 5) if i % LOG_INTERVAL == 0]
    assert all(row["consumed"] == 4 * row["iteration"] for row in rows)  # the data continues where it stopped


@pytest.mark.parametrize("name", ["signalled_2_ranks", "resumed_4_ranks"])
def test_merged_output_has_whole_log_lines_and_one_progress_line_after_each_log_line(runs, name):
    out = runs["out"] if name == "signalled_2_ranks" else runs["resumed"].stdout
    events, validations = [], []
    for line in out.splitlines():
        for marker, pattern in WHOLE.items():
            if marker in line:
                match = pattern.match(line)
                assert match and line.count(marker) == 1, f"{marker!r} not on a line of its own: {line!r}"
                if pattern is VALIDATION:
                    validations.append(int(match[1]))
                else:
                    events.append(("log" if pattern is LOG_LINE else "progress", int(match[1])))
    logged = [row["iteration"] for row in log_lines(out)]
    assert logged and all(i % LOG_INTERVAL == 0 for i in logged)
    # each log line, then its progress line (same rank, right after it), and no other progress line
    assert events == [event for i in logged for event in (("log", i), ("progress", i))]
    if name == "signalled_2_ranks":
        assert validations[:2] == [2, 4]
    else:
        # Where the signal landed decides the checkpoint's iteration (4, or 5 on a loaded machine), so
        # the expected validations come from what was saved: every --eval-interval iterations after
        # it, then the final validation and test at the resumed run's last iteration.
        saved, eval_interval = runs["saved"], 2
        last = saved + 4
        assert validations == [*(i for i in range(saved + 1, last + 1) if i % eval_interval == 0), last, last]
