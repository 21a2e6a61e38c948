"""The hang watchdog end to end: torchrun pretrain_gpt.py with one rank stalled (MEGATRON_TEST_STALL)
in a tensor-parallel all-reduce, a pipeline exchange, the data-parallel gradient all-reduce and a
context-parallel ring exchange.

Each job must end soon after --watchdog-seconds (not at the stall's 600 s or the 10-minute process
group timeout) with a non-zero exit, and the rank left waiting must print one line naming the
operation, the group and its ranks, the peer, the micro-batch and the iteration. The jobs run at
once (2 processes each) to keep the wall time near one job's.
"""

import os
import re
import subprocess
import sys
import time

import pytest

from megatron.core import watchdog
from tests.helpers.launch import free_port
from tests.helpers.paths import ROOT
from tests.helpers.training import MOCK

SECONDS = 5
MARGIN = 90  # start-up of three two-rank jobs on a shared CPU (34 s with every core busy), the SIGTERM
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
         "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0", "--seed", "1234", "--train-iters", "3",
         "--cpu-threads", "1", "--watchdog-seconds", str(SECONDS), *MOCK]
JOBS = {
    "tp": (["--tensor-model-parallel-size", "2"], "rank=1,op=all_reduce,group=tp,after=3"),
    "pp": (["--pipeline-model-parallel-size", "2"], "rank=1,op=p2p,after=3"),
    "dp": ([], "rank=0,op=all_reduce,group=dp-cp,after=1"),
    # 2 layers at CP 2: forward shifts #1, #2, backward #3, #4; rank 1 stops before waiting on #3
    "cp": (["--context-parallel-size", "2"], "rank=1,op=cp_ring,group=cp,after=3"),
}
STUCK = re.compile(r"^rank (\d+): stuck for (\d+) s in (\S+) on group (\S+) \[([\d, ]+)\] \(([^)]*)\); "
                   r"waiting for (.+) \(--watchdog-seconds 5\)$", re.M)


@pytest.fixture(scope="module")
def jobs():
    started = {}
    for name, (layout, stall) in JOBS.items():
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{watchdog.STALL_ENV: stall})
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(free_port()), "pretrain_gpt.py", *FLAGS, *layout]
        started[name] = (subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True), time.monotonic())
    results = {}
    for name, (proc, start) in started.items():
        try:
            out, err = proc.communicate(timeout=SECONDS + MARGIN + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[name] = (proc.returncode, out, err, time.monotonic() - start)
    return results


def _stuck_lines(err):
    return [match.groups() for match in STUCK.finditer(err)]


def _check_ended_by_watchdog(result):
    returncode, _, err, elapsed = result
    assert returncode != 0, err[-3000:]
    assert f"(exitcode: {watchdog.EXIT_CODE})" in err  # torchrun names the worker that the watchdog ended
    assert elapsed < SECONDS + MARGIN, f"took {elapsed:.0f} s"
    lines = _stuck_lines(err)
    assert lines, err[-3000:]
    for line in lines:
        assert SECONDS <= int(line[1]) <= SECONDS + 1  # reported at the deadline, not later
    return lines


def test_tensor_parallel_stall(jobs):
    lines = _check_ended_by_watchdog(jobs["tp"])
    assert "rank 1: MEGATRON_TEST_STALL: sleeping 600 s before all_reduce #3 on group tp" in jobs["tp"][2]
    rank, _, op, group, ranks, where, waiting = lines[0]
    assert (rank, op, group, ranks) == ("0", "all_reduce", "tp", "0, 1")
    assert re.fullmatch(r"micro-batch \d of 4, iteration 1", where)
    assert waiting == "ranks [1] of the group"


def test_pipeline_stall(jobs):
    lines = _check_ended_by_watchdog(jobs["pp"])
    rank, _, op, group, ranks, where, waiting = lines[0]
    assert (rank, group, ranks) == ("0", "pp", "0, 1")
    assert op in watchdog.P2P_OPS
    assert re.fullmatch(r"micro-batch \d of 4, iteration 1", where)
    assert "from rank 1 (stage 1)" in waiting


def test_data_parallel_stall(jobs):
    lines = _check_ended_by_watchdog(jobs["dp"])
    rank, _, op, group, ranks, where, waiting = lines[0]
    assert (rank, op, group, ranks) == ("1", "all_reduce", "dp-cp", "0, 1")
    assert where == "after the micro-batches, iteration 1"  # the gradient all-reduce
    assert waiting == "ranks [0] of the group"


def test_context_parallel_stall(jobs):
    lines = _check_ended_by_watchdog(jobs["cp"])
    assert "rank 1: MEGATRON_TEST_STALL: sleeping 600 s before cp_ring #3 on group cp" in jobs["cp"][2]
    rank, _, op, group, ranks, where, waiting = lines[0]
    assert (rank, op, group, ranks) == ("0", "cp_ring", "cp", "0, 1")  # the ring's next exchange, #4
    assert re.fullmatch(r"micro-batch \d of 4, iteration 1", where)
    assert waiting == "rank 1 to send, rank 1 to receive"
