"""torchrun pretrain_gpt.py --context-parallel-size N: the serial run's losses, and torch_dist
checkpoints that move between CP sizes.

    serial          1..10  one process
    cp2-tp2         1..5   CP = 2 x TP = 2 + SP, --cp-comm-type p2p (ring attention), saves a
                           torch_dist checkpoint at 5
    cp1 resumed     6..10  loads it in one process (CP 1, TP 1)
    cp4 resumed     6..10  loads it at CP = 4, --cp-comm-type a2a (Ulysses)

(The comm types are checked one by one, gradients included, in tests/parallel/test_context_parallel.py;
each launch here costs seconds.)

Every logged loss equals the serial run's (rel 1e-5): a CP rank's loss covers its share of the
sequence, and the reported loss sums the shares' losses and token counts over the CP group. The
model's parameters are the same at every CP size (CP splits the sequence, not the weights), so a
checkpoint written at one CP size continues exactly at another.
"""

import pytest

from tests.helpers.launch import run_cli, torchrun
from tests.helpers.training import MOCK, TINY, logged_losses

FLAGS = [*TINY, *MOCK, "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "10",
         "--lr-warmup-iters", "2", "--position-embedding-type", "rope", "--no-rope-fusion"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("cp") / "ckpt"
    save = ["--ckpt-format", "torch_dist", "--save", str(ckpt), "--save-interval", "1000", "--exit-interval", "5"]
    procs = {
        "serial": run_cli(["pretrain_gpt.py", *FLAGS]),
        "cp2_tp2": torchrun(4, [*FLAGS, "--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                "--sequence-parallel", "--cp-comm-type", "p2p", *save]),
    }
    load = ["--ckpt-format", "torch_dist", "--load", str(ckpt)]
    procs["cp1_resumed"] = run_cli(["pretrain_gpt.py", *FLAGS, *load])
    procs["cp4_resumed"] = torchrun(4, [*FLAGS, "--context-parallel-size", "4", "--cp-comm-type", "a2a", *load])
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name} run failed:\n{proc.stderr[-4000:]}"
    return procs


def test_context_parallel_runs_log_the_serial_losses_and_resume_at_other_cp_sizes(runs):
    serial = logged_losses(runs["serial"].stdout)
    assert list(serial) == list(range(1, 11)) and serial[10] < serial[1]
    expected = {"cp2_tp2": range(1, 6), "cp1_resumed": range(6, 11), "cp4_resumed": range(6, 11)}
    for name, iterations in expected.items():
        losses = logged_losses(runs[name].stdout)
        assert list(losses) == list(iterations), name
        for iteration, loss in losses.items():
            assert loss == pytest.approx(serial[iteration], rel=1e-5), (name, iteration)
    assert "successfully loaded checkpoint from" in runs["cp4_resumed"].stdout
