"""torchrun --nproc-per-node N pretrain_gpt.py with no TP/PP: data-parallel size N on the default corpus.

With the global batch fixed at 8 (micro-batch 2), DP=2 and DP=4 must log the single-process
run's losses, grad norms and validation losses: the sampler deals each global batch to the DP
ranks by consumed samples, and gradients and losses are averaged over the replicas. Five
launches cover it:

    serial        1..10   one process, 4 micro-batches per step
    dp2           1..10   --overlap-grad-reduce --ddp-bucket-size 2000 (several buckets), weight-hash
                          check every iteration, --log-communication-stats
    dp4           1..5    --ddp-average-in-collective, saves at 5 (--exit-interval 5)
    dp2 resumed   6..10   loads dp4's checkpoint: another DP size continues the same sample order
    serial resumed 6..10  loads it too, in one process
    dp4 dist-opt  1..5    --use-distributed-optimizer --overlap-param-gather, saves at 5 (model file +
                          distrib_optim.pt)
    dp2 dist-opt  6..10   loads it at DP=2: the optimizer shards are re-cut for 2 ranks; with
                          --calculate-per-token-loss (full loss masks: the same numbers, but
                          gradients summed over the replicas, divided by the global token count)

Only data-parallel rank 0 writes, so the checkpoint holds one file, mp_rank_00, whatever DP is.
"""

import re

import pytest

from megatron.training.checkpoint_safety import load_file
from tests.helpers.launch import run_cli, torchrun
from tests.helpers.training import COMMON, COUNT, TOTAL, VALIDATION, log_lines, logged_grad_norms, logged_losses

BATCH = ["--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", "10"]
OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "2000", "--check-weight-hash-across-dp-replicas-interval",
           "1", "--log-communication-stats"]
PARAMS = 46976  # the TINY model with the vocabulary of 600 padded to 640 rows (fp32: 4 bytes each)
STATS = " communication per iteration: "
DP_SIZE = {"serial": 1, "dp2": 2, "dp4": 4, "dp2_resumed": 2, "serial_resumed": 1, "dp4_distopt": 4,
           "dp2_distopt_resumed": 2}


@pytest.fixture(scope="module")
def runs(default_pipeline, tmp_path_factory):
    root, _, _, tokenizer_flags = default_pipeline
    data = ["--data-path", str(root / "python_text_document"), "--data-cache-path", str(root / "cache"),
            *tokenizer_flags]
    ckpt = tmp_path_factory.mktemp("dp") / "ckpt"
    ckpt_distopt = tmp_path_factory.mktemp("dp-distopt") / "ckpt"
    flags = [*COMMON, *BATCH, *data]
    procs = {
        "serial": run_cli(["pretrain_gpt.py", *flags]),
        "dp2": torchrun(2, [*flags, *OVERLAP]),
        "dp4": torchrun(4, [*flags, "--ddp-average-in-collective", "--exit-interval", "5", "--save", str(ckpt),
                            "--save-interval", "1000"]),
        "dp2_resumed": torchrun(2, [*flags, "--load", str(ckpt)]),
        "serial_resumed": run_cli(["pretrain_gpt.py", *flags, "--load", str(ckpt)]),
        "dp4_distopt": torchrun(4, [*flags, "--use-distributed-optimizer", "--overlap-grad-reduce",
                                    "--overlap-param-gather",
                                    "--exit-interval", "5", "--save", str(ckpt_distopt), "--save-interval", "1000"]),
        "dp2_distopt_resumed": torchrun(2, [*flags, "--use-distributed-optimizer", "--load", str(ckpt_distopt),
                                            "--calculate-per-token-loss"]),
    }
    for name, proc in procs.items():
        worker_lines = [line for line in proc.stderr.splitlines()  # without progress and torchrun's log lines
                        if not line.startswith("progress:") and not re.match(r"[EWI]\d{4} ", line)]
        assert proc.returncode == 0, f"{name} run failed:\n" + "\n".join(worker_lines)[-6000:]
    return {**procs, "ckpt": ckpt, "ckpt_distopt": ckpt_distopt}


def _assert_close_to_serial(runs, names, iterations):
    """The runs' logged losses and grad norms (merged, in order) equal the serial run's at `iterations`."""
    serial, serial_norms = logged_losses(runs["serial"].stdout), logged_grad_norms(runs["serial"].stdout)
    losses, norms = {}, {}
    for name in names:
        losses.update(logged_losses(runs[name].stdout))
        norms.update(logged_grad_norms(runs[name].stdout))
    assert list(losses) == list(iterations)
    for iteration in iterations:
        assert losses[iteration] == pytest.approx(serial[iteration], rel=1e-4), iteration
        assert norms[iteration] == pytest.approx(serial_norms[iteration], rel=1e-4), iteration


def _validation(runs, *names):
    return [(int(i), float(v)) for i, v in VALIDATION.findall("".join(runs[name].stdout for name in names))]


def test_dp2_and_dp4_log_the_serial_losses_grad_norms_and_validation(runs):
    serial = logged_losses(runs["serial"].stdout)
    assert list(serial) == list(range(1, 11)) and serial[10] < serial[1]
    assert sum(norm > 1.0 for norm in logged_grad_norms(runs["serial"].stdout).values()) >= 1  # clipping acted
    _assert_close_to_serial(runs, ["dp2"], range(1, 11))
    _assert_close_to_serial(runs, ["dp4"], range(1, 6))
    expected = _validation(runs, "serial")
    assert [i for i, _ in expected] == [5, 10]
    for name, iterations in (("dp2", [5, 10]), ("dp4", [5])):
        validation = _validation(runs, name)
        assert [i for i, _ in validation] == iterations, name
        for (_, value), (_, reference) in zip(validation, expected):
            assert value == pytest.approx(reference, rel=1e-4), name


@pytest.mark.parametrize("name", ["dp2_resumed", "serial_resumed"])
def test_resuming_a_dp4_checkpoint_at_another_dp_size_continues_the_serial_run(runs, name):
    _assert_close_to_serial(runs, ["dp4", name], range(1, 11))
    assert "successfully loaded checkpoint from" in runs[name].stdout
    assert "[ t 1/1, p 1/1 ] at iteration 5" in runs[name].stdout
    assert [row["consumed"] for row in log_lines(runs[name].stdout)] == [8 * i for i in range(6, 11)]
    (iteration, value), = _validation(runs, name)
    assert iteration == 10 and value == pytest.approx(dict(_validation(runs, "serial"))[10], rel=1e-4)


def test_only_data_parallel_rank_0_writes_the_checkpoint(runs):
    ckpt = runs["ckpt"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"
    files = sorted(str(p.relative_to(ckpt / "iter_0000005")) for p in (ckpt / "iter_0000005").rglob("*"))
    assert files == ["checksums.json", "mp_rank_00", "mp_rank_00/model_optim_rng.pt"]
    state = load_file(str(ckpt / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"))
    assert state["iteration"] == 5 and state["args"].data_parallel_size == 4
    assert state["args"].consumed_train_samples == 40 and state["args"].global_batch_size == 8
    assert isinstance(state["rng_state"], list) and len(state["rng_state"]) == 1  # Megatron's list, one entry
    assert sum(t.numel() for t in state["model"].values()) == PARAMS


@pytest.mark.parametrize("name", list(DP_SIZE))
def test_log_lines_are_megatron_s_whatever_the_data_parallel_size(runs, name):
    out, dp = runs[name].stdout, DP_SIZE[name]
    rows = log_lines(out)
    assert rows and all(row["gbs"] == 8 for row in rows)
    assert [row["consumed"] for row in rows] == [8 * row["iteration"] for row in rows]
    setup = (f"using world size: {dp}, data-parallel size: {dp}, context-parallel size: 1, "
             "tensor-model-parallel size: 1, pipeline-model-parallel size: 1 ")
    # substring counts: another rank's line may land inside one (PYTHONUNBUFFERED writes text and newline apart)
    assert out.count(setup) == 1  # rank 0 only
    assert out.count("-------------------- end of arguments ---------------------") == 1
    assert out.count(f"setting number of micro-batches to constant {8 // (2 * dp)}") == 1
    # one parameter-count line per (tensor, pipeline) rank, printed by its data-parallel rank 0
    assert COUNT.findall(out) == [("0", "0", str(PARAMS))]
    assert TOTAL.findall(out) == [str(PARAMS)]


def test_overlapped_bucketed_reduction_moves_the_gradient_once_and_replicas_stay_equal(runs):
    proc = runs["dp2"]
    combined = proc.stdout + proc.stderr
    assert "differ across data-parallel replicas" not in combined and "Traceback" not in combined
    stats = [line for line in proc.stdout.splitlines() if line.startswith(STATS)]
    assert len(stats) == 10
    grad_bytes = 4 * PARAMS
    # iteration 1 also counts start-up: data-parallel rank 0's weights broadcast to the other replica
    broadcast = re.search(r"broadcast dp-cp: (\d+) calls, (\d+) bytes", stats[0])
    assert broadcast and int(broadcast[2]) == grad_bytes
    assert not any("broadcast" in line for line in stats[1:])
    for line in stats:
        reduced = re.search(r"all_reduce dp-cp: (\d+) calls, (\d+) bytes", line)
        assert reduced, line
        # --ddp-bucket-size 2000 splits the 46976-element grad buffer into several buckets; the
        # loss reduction over the replicas adds a call of [sum, count] in fp32 (8 bytes), and the
        # line after a validation also counts the validation loss's
        assert int(reduced[1]) > 2 and int(reduced[2]) - grad_bytes in (8, 16), line


@pytest.mark.parametrize("name", ["dp2", "dp4"])
def test_initializing_torch_distributed_is_printed_once(runs, name):
    assert runs[name].stdout.count("> initializing torch distributed ...") == 1


def test_distributed_optimizer_saved_at_dp4_resumes_at_dp2_on_the_serial_run(runs):
    _assert_close_to_serial(runs, ["dp4_distopt", "dp2_distopt_resumed"], range(1, 11))
    files = sorted(p.name for p in (runs["ckpt_distopt"] / "iter_0000005" / "mp_rank_00").iterdir())
    assert files == ["distrib_optim.pt", "model_optim_rng.pt"]
