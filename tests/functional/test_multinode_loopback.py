"""Two torchrun "nodes" on 127.0.0.1: the c10d rendezvous, TP inside a node, DP across, and back.

Each node is its own `torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:PORT --rdzv-id ID`, started at the same time, as on two machines. TP = 2 inside each
node and DP = 2 across the nodes must log the single-process run's losses, save a torch_dist
checkpoint, and resume from it on one node (one torchrun, 2 processes, TP = 2, DP = 1) with the
uninterrupted run's losses. A TP group put across the two nodes trains, with a WARNING naming it.
PP = 2 across the nodes with TP = 2 inside (4 more processes) runs with MEGATRON_TEST_MULTINODE_PP=1.
"""

import contextlib
import io
import os
import subprocess
import sys

import pytest

import pretrain_gpt
from tests.helpers.launch import free_port
from tests.helpers.paths import ROOT
from tests.helpers.training import TINY, logged_grad_norms, logged_losses

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# --adam-eps 1e-4: the attention key biases' gradients are zero in exact arithmetic and rounding noise
# that differs by layout in fact; Adam's default eps 1e-8 would turn that noise into lr-sized steps
# (tests/functional/test_pretrain_t5.py's layout runs saw this drift on one CI machine)
COMMON = [*TINY, "--hidden-dropout", "0", "--attention-dropout", "0", "--split", "90,10,0", "--eval-iters", "0",
          "--lr-warmup-iters", "2", "--train-iters", "6", "--adam-eps", "1e-4"]  # the default --ckpt-format torch_dist
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
SPANS = "groups span nodes"


def _torchrun(launch, flags):
    command = [sys.executable, "-m", "torch.distributed.run", *launch, "pretrain_gpt.py", *flags]
    return subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _nodes(nproc_per_node, flags, nnodes=2):
    """Start one torchrun per "node" at once on the loopback rendezvous; (stdout of all, [returncode, stderr])."""
    port = free_port()
    procs = [_torchrun(["--nnodes", str(nnodes), "--node-rank", str(node), "--nproc-per-node", str(nproc_per_node),
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"loop{port}"],
                       flags) for node in range(nnodes)]
    outs = [proc.communicate(timeout=240) for proc in procs]
    return "".join(out for out, _ in outs), [(proc.returncode, err) for proc, (_, err) in zip(procs, outs)]


def _one_node(nproc, flags):
    proc = _torchrun(["--nproc-per-node", str(nproc), "--master-port", str(free_port())], flags)
    out, err = proc.communicate(timeout=240)
    return out, [(proc.returncode, err)]


@pytest.fixture(scope="module")
def runs(default_pipeline, tmp_path_factory):
    root, _, _, tokenizer_flags = default_pipeline
    flags = [*COMMON, "--data-path", str(root / "python_text_document"), "--data-cache-path", str(root / "cache"),
             *tokenizer_flags]
    ckpt = tmp_path_factory.mktemp("multinode") / "ckpt"
    serial = io.StringIO()
    with contextlib.redirect_stdout(serial):  # in this process: one start-up fewer
        pretrain_gpt.main(flags)
    runs = {"serial": (serial.getvalue(), [(0, "")]),
            "two nodes": _nodes(2, [*flags, "--tensor-model-parallel-size", "2", "--exit-interval", "3",
                                    "--save", str(ckpt), "--save-interval", "1000"]),
            "one node": _one_node(2, [*flags, "--tensor-model-parallel-size", "2", "--load", str(ckpt)]),
            "tp across": _nodes(1, [*flags, "--tensor-model-parallel-size", "2", "--exit-interval", "2"])}
    for name, (_, results) in runs.items():
        for returncode, stderr in results:
            assert returncode == 0, f"{name} run failed:\n{stderr[-4000:]}"
    return {name: out for name, (out, _) in runs.items()} | {"ckpt": ckpt}


def test_two_nodes_with_tp_inside_and_dp_across_log_the_serial_losses(runs):
    serial, two_nodes = logged_losses(runs["serial"]), logged_losses(runs["two nodes"])
    assert list(serial) == list(range(1, 7)) and list(two_nodes) == [1, 2, 3]
    for iteration, loss in two_nodes.items():
        assert loss == pytest.approx(serial[iteration], rel=1e-5), iteration
    for iteration, norm in logged_grad_norms(runs["two nodes"]).items():
        assert norm == pytest.approx(logged_grad_norms(runs["serial"])[iteration], rel=1e-5), iteration
    out = runs["two nodes"]
    assert "> node topology: 2 nodes x 2 ranks (node 0: ranks 0-1, node 1: ranks 2-3)" in out
    assert ("> groups on nodes: tensor-parallel 2 x 2 ranks, each inside a node | "
            "data-parallel 2 x 2 ranks, across 2 nodes") in out
    assert SPANS not in out
    assert (runs["ckpt"] / "iter_0000003" / "metadata.json").is_file()


def test_resumes_from_the_two_node_checkpoint_on_one_node(runs):
    serial, one_node = logged_losses(runs["serial"]), logged_losses(runs["one node"])
    assert "successfully loaded checkpoint from" in runs["one node"]
    assert list(one_node) == [4, 5, 6]  # picked up after iteration 3, at DP = 1
    for iteration, loss in one_node.items():
        assert loss == pytest.approx(serial[iteration], rel=1e-5), iteration
    for iteration, norm in logged_grad_norms(runs["one node"]).items():
        assert norm == pytest.approx(logged_grad_norms(runs["serial"])[iteration], rel=1e-5), iteration
    assert "> node topology: 1 node x 2 ranks (node 0: ranks 0-1)" in runs["one node"]
    assert SPANS not in runs["one node"]


def test_a_tensor_parallel_group_across_nodes_trains_and_warns(runs):
    out = runs["tp across"]
    assert "> node topology: 2 nodes x 1 rank (node 0: ranks 0, node 1: ranks 1)" in out
    assert "> groups on nodes: tensor-parallel 1 x 2 ranks, across 2 nodes" in out
    assert "WARNING: 1 of 1 tensor-parallel groups span nodes: ranks [0, 1] on nodes [0, 1]." in out
    serial, across = logged_losses(runs["serial"]), logged_losses(out)
    assert list(across) == [1, 2]  # slow on real links, but the same numbers
    for iteration, loss in across.items():
        assert loss == pytest.approx(serial[iteration], rel=1e-5), iteration


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MEGATRON_TEST_MULTINODE_PP") != "1",
                    reason="4 more processes (about 15 s); set MEGATRON_TEST_MULTINODE_PP=1 to run it")
def test_two_nodes_with_tp_inside_and_pp_across_log_the_serial_losses(runs, default_pipeline):
    root, _, _, tokenizer_flags = default_pipeline
    out, results = _nodes(2, [*COMMON, "--data-path", str(root / "python_text_document"), "--data-cache-path",
                              str(root / "cache"), *tokenizer_flags, "--tensor-model-parallel-size", "2",
                              "--pipeline-model-parallel-size", "2", "--exit-interval", "3"])
    assert all(returncode == 0 for returncode, _ in results), results[0][1][-4000:] + results[1][1][-4000:]
    assert ("> groups on nodes: tensor-parallel 2 x 2 ranks, each inside a node | "
            "pipeline-parallel 2 x 2 ranks, across 2 nodes") in out
    serial, two_nodes = logged_losses(runs["serial"]), logged_losses(out)
    assert list(two_nodes) == [1, 2, 3]
    for iteration, loss in two_nodes.items():
        assert loss == pytest.approx(serial[iteration], rel=1e-5), iteration
