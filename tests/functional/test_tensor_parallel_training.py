"""torchrun --nproc-per-node 2 pretrain_gpt.py --tensor-model-parallel-size 2 on the default corpus.

The TP=2 run must log the single-process run's losses (the vocabulary of 600 ids is padded to
640 rows for TP=1 and to 768 for TP=2, which must not matter), save one file per TP rank, resume
from them exactly, and refuse to load them at another TP size with a message saying why.
"""

import pytest

from tests.helpers.launch import run_cli, torchrun
from tests.helpers.training import COMMON, COUNT, TINY, TOTAL, VALIDATION, logged_grad_norms, logged_losses


@pytest.fixture(scope="module")
def runs(default_pipeline, tmp_path_factory):
    root, _, _, tokenizer_flags = default_pipeline
    data = ["--data-path", str(root / "python_text_document"), "--data-cache-path", str(root / "cache"),
            *tokenizer_flags]
    ckpt = tmp_path_factory.mktemp("tp2") / "ckpt"
    serial = run_cli(["pretrain_gpt.py", *COMMON, *data, "--train-iters", "10"])
    first = torchrun(2, [*COMMON, *data, "--tensor-model-parallel-size", "2", "--train-iters", "10",
                         "--exit-interval", "5", "--save", str(ckpt), "--save-interval", "1000"])
    resumed = torchrun(2, [*COMMON, *data, "--tensor-model-parallel-size", "2", "--train-iters", "10",
                           "--load", str(ckpt)])
    sequence_parallel = torchrun(2, [*COMMON, *data, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--train-iters", "10", "--log-communication-stats"])
    wrong_tp = run_cli(["pretrain_gpt.py", *COMMON, *data, "--train-iters", "10", "--load", str(ckpt)])
    for name, proc in (("serial", serial), ("tp2", first), ("tp2 resumed", resumed), ("tp2+sp", sequence_parallel)):
        assert proc.returncode == 0, f"{name} run failed:\n{proc.stderr[-4000:]}"
    return {"serial": serial, "first": first, "resumed": resumed, "sp": sequence_parallel, "wrong_tp": wrong_tp,
            "ckpt": ckpt}


def test_tp2_logs_the_serial_losses_and_resumes_exactly(runs):
    serial = logged_losses(runs["serial"].stdout)
    first, resumed = logged_losses(runs["first"].stdout), logged_losses(runs["resumed"].stdout)
    assert list(serial) == list(range(1, 11)) and list(first) == list(range(1, 6))
    assert list(resumed) == list(range(6, 11))  # picked up at iteration 5
    tp2 = {**first, **resumed}
    for iteration, loss in serial.items():
        assert tp2[iteration] == pytest.approx(loss, rel=1e-4), iteration
    assert serial[10] < serial[1]
    # the clipped global norm counts every parameter once: shards summed over TP, replicas once
    serial_norms = logged_grad_norms(runs["serial"].stdout)
    tp2_norms = {**logged_grad_norms(runs["first"].stdout), **logged_grad_norms(runs["resumed"].stdout)}
    assert sum(norm > 1.0 for norm in serial_norms.values()) >= 3  # above --clip-grad 1.0: clipping acted
    for iteration, norm in serial_norms.items():
        assert tp2_norms[iteration] == pytest.approx(norm, rel=1e-4), iteration
    serial_validation = VALIDATION.findall(runs["serial"].stdout)
    tp2_validation = VALIDATION.findall(runs["first"].stdout + runs["resumed"].stdout)
    assert [v[0] for v in serial_validation] == ["5", "10"] == [v[0] for v in tp2_validation]
    for (_, expected), (_, value) in zip(serial_validation, tp2_validation):
        assert float(value) == pytest.approx(float(expected), rel=1e-4)


def test_tp2_checkpoint_has_one_file_per_tensor_rank_and_loads_back(runs):
    iteration = runs["ckpt"] / "iter_0000005"
    assert sorted(p.name for p in iteration.iterdir()) == ["checksums.json", "mp_rank_00", "mp_rank_01"]
    assert all((iteration / d / "model_optim_rng.pt").is_file() for d in ("mp_rank_00", "mp_rank_01"))
    assert "successfully loaded checkpoint from" in runs["resumed"].stdout
    assert "[ t 1/2, p 1/1 ] at iteration 5" in runs["resumed"].stdout


def test_loading_at_another_tensor_parallel_size_is_refused(runs):
    proc = runs["wrong_tp"]
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("pretrain_gpt.py: error: ")
    assert "--tensor-model-parallel-size 2 but this run has --tensor-model-parallel-size 1" in message


def test_sequence_parallel_logs_the_serial_losses_and_counts_communication(runs):
    serial, sequence_parallel = logged_losses(runs["serial"].stdout), logged_losses(runs["sp"].stdout)
    for iteration, loss in serial.items():
        assert sequence_parallel[iteration] == pytest.approx(loss, rel=1e-4), iteration
    for iteration, norm in logged_grad_norms(runs["serial"].stdout).items():
        assert logged_grad_norms(runs["sp"].stdout)[iteration] == pytest.approx(norm, rel=1e-4), iteration
    stats = [line for line in runs["sp"].stdout.splitlines() if line.startswith(" communication per iteration:")]
    assert len(stats) == 10
    # 2 layers x 2 micro-batches: forward and backward of each layer gather and scatter the sequence
    assert "all_gather tp: " in stats[-1] and "reduce_scatter tp: " in stats[-1]
    assert "all_reduce tp" in stats[-1]  # the embedding's vocab-parallel sum and the loss's reductions


def test_parameter_counts_are_logged_per_rank_and_in_total(runs):
    serial_counts = COUNT.findall(runs["serial"].stdout)
    tp2_counts = COUNT.findall(runs["first"].stdout)
    assert [(r, p) for r, p, _ in serial_counts] == [("0", "0")]
    assert sorted((r, p) for r, p, _ in tp2_counts) == [("0", "0"), ("1", "0")]
    serial_total = int(TOTAL.findall(runs["serial"].stdout)[0])
    tp2_total = int(TOTAL.findall(runs["first"].stdout)[0])
    assert serial_total == int(serial_counts[0][2])
    hidden, layers, seq = 32, 2, 32
    padding = (768 - 640) * hidden  # vocab 600 padded to 128 x 1 = 640 rows, and to 128 x 2 = 768
    assert tp2_total == serial_total + padding
    # replicated on both TP ranks: position embeddings, the layer norms, the row-parallel biases
    replicated = seq * hidden + layers * (4 * hidden + 2 * hidden) + 2 * hidden
    assert sum(int(n) for _, _, n in tp2_counts) == tp2_total + replicated


def test_cli_without_torchrun_world_refuses_tensor_parallelism():
    proc = run_cli(["pretrain_gpt.py", *TINY, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                    "255", "--train-iters", "2", "--tensor-model-parallel-size", "2"])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "world size (1) is not divisible by --tensor-model-parallel-size (2)" in proc.stderr
