"""--ckpt-format torch_dist: a checkpoint saved by 8 gloo ranks at TP=2 x PP=2 x DP=2 with the
distributed optimizer (and --async-save) loads at TP=1 x DP=4 with and without the distributed
optimizer and at TP=4 (4 ranks) with no conversion step, and the next iterations' losses equal
the uninterrupted run's. The model is Llama-style (RMSNorm, SwiGLU: fc1 in two boxes per rank;
GQA with 2 groups: at TP=4 each group's K/V rows are replicated on 2 ranks and written once),
trained with Adam so that the optimizer state matters. Each rank runs pretrain_gpt.main in its
pool worker (8 spawned for this module, the shared 4-rank pool for the loads).

Also here: the box geometry (flat_boxes, index_runs), --auto-detect-ckpt-format, and that a
damaged piece or a malicious .metadata is refused in one line.
"""

import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron.training.checkpoint_safety import CheckpointError
from megatron.core.atomic_io import atomic_write
from megatron.dist_checkpointing import HOLD_ENV, flat_boxes, index_runs, read_dcp_metadata, split_runs
from tests.helpers.checkpoints import pretrain, pretrain_error
from tests.parallel.harness import DistributedPool

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--lr", "1e-2", "--lr-decay-style", "constant", "--seed", "1234", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--make-vocab-size-divisible-by", "32",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--eval-iters", "0",
         "--log-interval", "1", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear"]


@pytest.fixture(scope="module")
def pool8():
    pool = DistributedPool(8)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def saved(pool8, tmp_path_factory):
    """The uninterrupted TP=2 PP=2 DP=2 run (4 iterations, async saves at 2 and 4); the tracker is
    then pointed back at iteration 2."""
    ckpt = tmp_path_factory.mktemp("torch_dist") / "ckpt"
    losses = pool8.run(pretrain, [*FLAGS, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                  "2", "--use-distributed-optimizer", "--train-iters", "4", "--save", str(ckpt),
                                  "--save-interval", "2", "--async-save"])[-1]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    atomic_write(str(ckpt / "latest_checkpointed_iteration.txt"), lambda f: f.write(b"2"))
    return ckpt, losses


def test_the_saved_folder_is_megatrons_layout(saved):
    ckpt, losses = saved
    assert sorted(losses) == [1, 2, 3, 4]
    folder = ckpt / "iter_0000002"
    names = sorted(os.listdir(folder))
    assert names == sorted([".metadata", "checksums.json", "common.pt", "metadata.json"]
                           + [f"__{rank}_0.distcp" for rank in range(8)])
    assert (folder / "metadata.json").read_text() == ('{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
                                                      '"common_backend": "torch", "common_backend_version": 1}')
    assert not any(name.startswith(".iter_") for name in os.listdir(ckpt))  # no staging folder left
    metadata = read_dcp_metadata(str(folder / ".metadata"))
    tensors = metadata.state_dict_metadata
    # global TP=1 shapes, layers numbered globally; fc1 [2 ffn, h] in its own rows
    assert list(tensors["decoder.layers.3.mlp.linear_fc1.weight"].size) == [128, 32]  # 2 x ffn 64
    assert list(tensors["decoder.layers.0.self_attention.linear_qkv.weight"].size) == [64, 32]
    assert list(tensors["optimizer.state.exp_avg.embedding.word_embeddings.weight"].size) == [256, 32]
    fc1_chunks = tensors["decoder.layers.0.mlp.linear_fc1.weight"].chunks
    assert sorted(tuple(c.offsets) for c in fc1_chunks) == [(0, 0), (32, 0), (64, 0), (96, 0)]  # gate, up x TP
    assert sum(1 for key in tensors if key.startswith("rng_state.")) == 8


@pytest.mark.parametrize("layout", [
    ("--tensor-model-parallel-size", "1", "--use-distributed-optimizer"),
    ("--tensor-model-parallel-size", "1"),
    ("--tensor-model-parallel-size", "4", "--use-distributed-optimizer"),
], ids=["tp1-dp4-distopt", "tp1-dp4", "tp4-kv-replicated"])
def test_loads_at_another_layout_and_continues_like_the_uninterrupted_run(dist_pool, saved, layout):
    ckpt, losses = saved
    resumed = dist_pool.run(pretrain, [*FLAGS, *layout, "--train-iters", "4", "--load", str(ckpt)])[-1]
    assert sorted(resumed) == [3, 4]
    for iteration in (3, 4):  # 3 follows from the weights, 4 also from Adam's moments
        assert resumed[iteration] == pytest.approx(losses[iteration], rel=1e-6), (iteration, resumed[iteration], losses[iteration])


# GPT-2 style: LayerNorm, biases, learned positions, embeddings tied (the last stage's copy is not written)
GPT2 = FLAGS[:FLAGS.index("--swiglu")]


def test_tied_embeddings_and_virtual_stages_reshard_to_one_stage(pool8, dist_pool, tmp_path):
    ckpt = tmp_path / "gpt2"
    losses = pool8.run(pretrain, [*GPT2, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                  "--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer",
                                  "--train-iters", "3", "--save", str(ckpt), "--save-interval", "2"])[-1]
    atomic_write(str(ckpt / "latest_checkpointed_iteration.txt"), lambda f: f.write(b"2"))
    tensors = read_dcp_metadata(str(ckpt / "iter_0000002" / ".metadata")).state_dict_metadata
    assert "output_layer.weight" not in tensors and "embedding.position_embeddings.weight" in tensors
    resumed = dist_pool.run(pretrain, [*GPT2, "--train-iters", "3", "--load", str(ckpt)])[-1]
    assert sorted(resumed) == [3] and resumed[3] == pytest.approx(losses[3], rel=1e-6)


def test_auto_detect_reads_either_format(dist_pool, saved, tmp_path):
    ckpt, losses = saved
    legacy = tmp_path / "legacy"
    dist_pool.run(pretrain, [*FLAGS, "--train-iters", "4", "--exit-interval", "2", "--ckpt-format", "torch",
                             "--save", str(legacy), "--save-interval", "2"])
    assert (legacy / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    refused = dist_pool.run(pretrain_error, [*FLAGS, "--train-iters", "4", "--load", str(legacy)])
    assert refused[0] == (f"{legacy / 'iter_0000002'} is a torch checkpoint but this run has --ckpt-format "
                          "torch_dist; pass --auto-detect-ckpt-format to load either format (or --ckpt-format torch)")
    assert len(set(refused)) == 1 and "\n" not in refused[0]
    from_legacy = dist_pool.run(pretrain, [*FLAGS, "--train-iters", "4", "--load", str(legacy),
                                           "--auto-detect-ckpt-format"])[-1]
    from_dist = dist_pool.run(pretrain, [*FLAGS, "--train-iters", "4", "--load", str(ckpt), "--ckpt-format",
                                         "torch", "--auto-detect-ckpt-format"])[-1]
    assert sorted(from_legacy) == [3, 4]
    assert from_dist[3] == pytest.approx(losses[3], rel=1e-6) and from_dist[4] == pytest.approx(losses[4], rel=1e-6)


def test_a_damaged_piece_is_refused_in_one_line(dist_pool, saved, tmp_path):
    ckpt, _ = saved
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    piece = damaged / "iter_0000002" / "__5_0.distcp"
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 0xFF
    piece.write_bytes(bytes(data))
    messages = dist_pool.run(pretrain_error, [*FLAGS, "--train-iters", "4", "--load", str(damaged)])
    assert len(set(messages)) == 1 and "\n" not in messages[0]
    assert messages[0].startswith(f"checkpoint file {piece} does not match its checksum")


def test_kill_9_during_an_async_save_leaves_the_previous_checkpoint_latest(dist_pool, tmp_path):
    """One process saves asynchronously at 2 and 4; the writer of 4 stops after its files (the test
    hook) and the process is killed there: iteration 2 stays the latest and resumes at 4 ranks."""
    ckpt, marker, log = tmp_path / "ckpt", tmp_path / "writing-4", tmp_path / "stdout"
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", **{HOLD_ENV: f"4:{marker}"})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    with open(log, "w") as out:
        run = subprocess.Popen([sys.executable, "pretrain_gpt.py", *FLAGS, "--train-iters", "6", "--save", str(ckpt),
                                "--save-interval", "2", "--async-save"], cwd=root, env=env, stdout=out,
                               stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while not marker.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        held = marker.exists()
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
    output = log.read_text()
    assert held, output[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (ckpt / "iter_0000004").exists() and (ckpt / ".iter_0000004.partial").is_dir()
    logged = {int(i): float(v) for i, v in re.findall(r"iteration +(\d+)/ +6 \|.*?lm loss: (\S+) \|", output)}
    resumed = dist_pool.run(pretrain, [*FLAGS, "--train-iters", "6", "--load", str(ckpt), "--exit-interval", "3",
                                       "--save", str(ckpt), "--save-interval", "100"])[-1]
    assert sorted(resumed) == [3] and resumed[3] == pytest.approx(logged[3], rel=2e-6)  # logged to 7 digits
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"  # the exit save
    assert not (ckpt / ".iter_0000004.partial").exists()  # the next save removed the killed one's pieces


def test_the_converter_reads_torch_dist(saved, tmp_path, capsys):
    """tools/checkpoint/convert.py --loader megatron reads the TP=2 PP=2 DP=2 torch_dist checkpoint's
    global tensors (verified by logits) and writes it at TP=1 in the torch format: one process loads
    it and logs the uninterrupted run's loss of iteration 3 (it follows from the weights of 2)."""
    import pretrain_gpt
    from megatron.training.initialize import reset_megatron
    from tools.checkpoint import convert, saver_megatron

    ckpt, losses = saved
    convert.main(["--model-type", "GPT", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "tp1"),
                  "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"])
    assert "-> OK" in capsys.readouterr().out
    args, tensors = saver_megatron.read_back(str(tmp_path / "tp1"))
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
    assert "decoder.layers.3.mlp.linear_fc1.weight" in dict(tensors)
    try:
        result = pretrain_gpt.main([*FLAGS, "--train-iters", "3", "--load", str(tmp_path / "tp1"), "--ckpt-format",
                                    "torch", "--no-load-optim", "--no-load-rng"], record_history=True)
    finally:
        reset_megatron()
    assert [r.iteration for r in result.history] == [3]
    assert result.history[0].losses["lm loss"] == pytest.approx(losses[3], rel=1e-6)
    with pytest.raises(SystemExit):  # Megatron-LM's classic reader is not for it
        convert.cli(["--model-type", "GPT", "--loader", "legacy", "--load-dir", str(ckpt), "--save-dir",
                     str(tmp_path / "legacy")])
    assert "is a torch_dist checkpoint (metadata.json): read it with --loader megatron" in capsys.readouterr().err


def test_the_bench_helper_saves_and_loads_either_format_in_one_process(tmp_path):
    """benchmark_save_load (for bench/checkpoint_io.py) times a real round trip: a fresh model and
    Adam loaded from what it wrote hold the saved weights and moments."""
    from megatron.training.checkpointing import benchmark_save_load, load_checkpoint
    from tests.helpers.checkpoints import TinyGPT, make_args

    def model_and_adam(seed):
        torch.manual_seed(seed)
        model = TinyGPT(make_args(tmp_path))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        optimizer.step()
        return model, optimizer

    model, optimizer = model_and_adam(0)
    for fmt, asynchronous in (("torch", False), ("torch_dist", False), ("torch_dist", True)):
        directory = tmp_path / f"{fmt}-{asynchronous}"
        times = benchmark_save_load([model], optimizer, None, make_args(directory), str(directory), fmt, asynchronous)
        assert set(times) == {"save", "finalize", "load", "bytes"} and times["bytes"] > 0
        assert times["finalize"] >= times["save"] > 0 and times["load"] > 0
        fresh, fresh_optimizer = model_and_adam(1)
        load_checkpoint([fresh], fresh_optimizer, None, args=make_args(directory, ckpt_format=fmt))
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
        for new, old in zip(fresh.parameters(), model.parameters()):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(fresh_optimizer.state[new][key], optimizer.state[old][key]), (fmt, key)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_malicious_dcp_metadata_is_refused_before_it_runs(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(CheckpointError) as error:
        read_dcp_metadata(str(path))
    message = str(error.value)
    assert "\n" not in message and "refers to posix.system" in message and "nothing from the file was run" in message


def test_flat_ranges_become_row_major_boxes():
    assert flat_boxes((4, 3), 0, 12) == [((0, 0), (4, 3))]
    assert flat_boxes((4, 3), 2, 10) == [((0, 2), (1, 1)), ((1, 0), (2, 3)), ((3, 0), (1, 1))]
    assert flat_boxes((4, 3), 4, 5) == [((1, 1), (1, 1))]
    assert flat_boxes((2, 2, 2), 1, 7) == [((0, 0, 1), (1, 1, 1)), ((0, 1, 0), (1, 1, 2)), ((1, 0, 0), (1, 1, 2)),
                                           ((1, 1, 0), (1, 1, 1))]
    for shape, start, end in (((5, 4), 3, 17), ((3, 2, 4), 5, 23), ((7,), 2, 6)):
        covered = torch.zeros(shape, dtype=torch.long)
        for offsets, sizes in flat_boxes(shape, start, end):
            view = covered
            for dim, (o, s) in enumerate(zip(offsets, sizes)):
                view = view.narrow(dim, o, s)
            view += 1
        expected = torch.zeros(covered.numel(), dtype=torch.long)
        expected[start:end] = 1
        assert torch.equal(covered.flatten(), expected), (shape, start, end)


def test_index_runs_cut_swiglu_and_replicated_kv_rows():
    from megatron.core.tensor_parallel.layout import strided_partition_indices
    from megatron.model.attention import qkv_partition_rows

    assert index_runs(strided_partition_indices(4, 2, 1, stride=2)) == [(0, 2, 2), (2, 6, 2)]  # [gate_1; up_1]
    # 4 heads, 2 groups, hn 8, TP 4: rank 0 holds head 0 of group 0, then group 0's K and V (rows
    # 16-31); rank 1 holds head 1, which the K/V rows follow: one run, cut where the replicas start
    assert index_runs(qkv_partition_rows(4, 2, 8, 4, 0)) == [(0, 0, 8), (8, 16, 16)]
    assert index_runs(qkv_partition_rows(4, 2, 8, 4, 1)) == [(0, 8, 24)]
    assert split_runs(index_runs(qkv_partition_rows(4, 2, 8, 4, 1)), (8, 24)) == [(0, 8, 8), (8, 16, 16)]
