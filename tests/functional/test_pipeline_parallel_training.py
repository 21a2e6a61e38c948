"""torchrun pretrain_gpt.py with --pipeline-model-parallel-size 2 (plain 1F1B with TP=2, and interleaved).

Both layouts must log the single-process run's losses, grad norms and validation losses, save one
file per (tensor, pipeline) rank in Megatron's layout (one model per chunk when interleaved), resume
from them exactly, and refuse to load them at another pipeline layout with a message naming the flag.

Layer placement (4 layers, PP=2): plain 1F1B puts global layers 0-1 on stage 0 and 2-3 on stage 1;
interleaved with one layer per virtual stage puts layer v*2 + p in chunk v of rank p. Each file
numbers its layers locally (decoder.layers.0, .1), as Megatron's --ckpt-format torch does.
"""

import hashlib
import json
import re

import pytest
import torch

from megatron.training.checkpoint_safety import load_file
from tests.helpers.launch import run_cli, torchrun
from tests.helpers.training import COMMON, VALIDATION, logged_grad_norms, logged_losses

LAYERS = ["--num-layers", "4", "--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", "10"]
PP2_TP2 = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
VOCAB = 600  # the tokenizer's; padded to 640 rows at TP=1 and 768 at TP=2
LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.")
# Tensor-parallel split dimension of each sharded weight; everything else is replicated on TP ranks.
SPLIT_DIM = {"linear_qkv.weight": 0, "linear_qkv.bias": 0, "linear_fc1.weight": 0, "linear_fc1.bias": 0,
             "linear_proj.weight": 1, "linear_fc2.weight": 1, "word_embeddings.weight": 0,
             "output_layer.weight": 0}


def _load(path):
    return load_file(str(path))


def _snapshot(directory):
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(default_pipeline, tmp_path_factory):
    root, _, _, tokenizer_flags = default_pipeline
    data = ["--data-path", str(root / "python_text_document"), "--data-cache-path", str(root / "cache"),
            *tokenizer_flags]
    base = tmp_path_factory.mktemp("pp2")
    serial_ckpt, pp_ckpt, vp_ckpt = base / "serial", base / "pp2_tp2", base / "interleaved"
    flags = [*COMMON, *LAYERS, *data]
    first_half = ["--exit-interval", "5", "--save-interval", "1000", "--save"]
    procs = {
        "serial": run_cli(["pretrain_gpt.py", *flags, "--save", str(serial_ckpt), "--save-interval", "5"]),
        "pp_first": torchrun(4, [*flags, *PP2_TP2, *first_half, str(pp_ckpt)]),
        "pp_resumed": torchrun(4, [*flags, *PP2_TP2, "--load", str(pp_ckpt)]),
        "vp_first": torchrun(2, [*flags, *INTERLEAVED, *first_half, str(vp_ckpt)]),
        # the same layout given by the other flag: 2 chunks per rank
        "vp_resumed": torchrun(2, [*flags, "--pipeline-model-parallel-size", "2",
                                   "--num-virtual-stages-per-pipeline-rank", "2", "--load", str(vp_ckpt)]),
    }
    for name, proc in procs.items():
        worker_lines = [line for line in proc.stderr.splitlines()  # without progress and torchrun's log lines
                        if not line.startswith("progress:") and not re.match(r"[EWI]\d{4} ", line)]
        assert proc.returncode == 0, f"{name} run failed:\n" + "\n".join(worker_lines)[-6000:]
    before = _snapshot(vp_ckpt)
    overwrite = ["--load", str(vp_ckpt), "--save", str(vp_ckpt), "--save-interval", "1"]
    procs["wrong_pp"] = run_cli(["pretrain_gpt.py", *flags, *overwrite])
    procs["wrong_vp"] = torchrun(2, [*flags, "--pipeline-model-parallel-size", "2", *overwrite])
    return {**procs, "serial_ckpt": serial_ckpt, "pp_ckpt": pp_ckpt, "vp_ckpt": vp_ckpt,
            "vp_before": before, "vp_after": _snapshot(vp_ckpt)}


def _assert_matches_serial(runs, first, resumed):
    serial = logged_losses(runs["serial"].stdout)
    assert list(serial) == list(range(1, 11)) and serial[10] < serial[1]
    assert list(logged_losses(runs[first].stdout)) == list(range(1, 6))
    assert list(logged_losses(runs[resumed].stdout)) == list(range(6, 11))  # picked up at iteration 5
    losses = {**logged_losses(runs[first].stdout), **logged_losses(runs[resumed].stdout)}
    norms = {**logged_grad_norms(runs[first].stdout), **logged_grad_norms(runs[resumed].stdout)}
    for iteration, loss in serial.items():
        assert losses[iteration] == pytest.approx(loss, rel=1e-4), iteration
    for iteration, norm in logged_grad_norms(runs["serial"].stdout).items():
        assert norms[iteration] == pytest.approx(norm, rel=1e-4), iteration
    serial_validation = VALIDATION.findall(runs["serial"].stdout)
    validation = VALIDATION.findall(runs[first].stdout + runs[resumed].stdout)
    assert [v[0] for v in serial_validation] == ["5", "10"] == [v[0] for v in validation]
    for (_, expected), (_, value) in zip(serial_validation, validation):
        assert float(value) == pytest.approx(float(expected), rel=1e-4)


def _merge_tp(name, shards):
    """One full tensor from its TP shards (vocabulary rows cut to the real vocabulary)."""
    dim = next((d for suffix, d in SPLIT_DIM.items() if name.endswith(suffix)), None)
    if dim is None:  # replicated: every TP rank must hold the same copy
        assert all(torch.equal(shard, shards[0]) for shard in shards[1:]), name
        return shards[0]
    full = torch.cat(shards, dim)
    return full[:VOCAB] if name.endswith(("word_embeddings.weight", "output_layer.weight")) else full


def _assert_stage_holds_serial_weights(stage_models, first_layer, serial_model):
    """stage_models: one state dict per TP rank; local layer i is global layer first_layer + i."""
    for name in stage_models[0]:
        tensor = _merge_tp(name, [model[name] for model in stage_models])
        match = LAYER_KEY.match(name)
        if match:
            name = f"decoder.layers.{first_layer + int(match[1])}.{name[match.end():]}"
        if name == "output_layer.weight":  # the last stage's copy of the tied embedding
            name = "embedding.word_embeddings.weight"
        expected = serial_model[name]
        if name == "embedding.word_embeddings.weight":
            expected = expected[:VOCAB]
        # the attention key bias has a zero true gradient: after 5 Adam steps it is ~1e-6 of
        # layout-dependent rounding noise, hence its looser absolute tolerance
        atol = 1e-5 if name.endswith("linear_qkv.bias") else 1e-6
        torch.testing.assert_close(tensor, expected, rtol=1e-4, atol=atol, msg=name)


def _layer_indices(model):
    return sorted({int(m[1]) for m in map(LAYER_KEY.match, model) if m})


def _non_layer_keys(model):
    return sorted(key for key in model if not LAYER_KEY.match(key))


def test_pp2_tp2_logs_the_serial_losses_and_resumes_exactly(runs):
    _assert_matches_serial(runs, "pp_first", "pp_resumed")
    assert "[ t 1/2, p 1/2 ] at iteration 5" in runs["pp_resumed"].stdout


def test_pp2_tp2_checkpoint_has_one_file_per_tensor_and_pipeline_rank(runs):
    ckpt = runs["pp_ckpt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
    iteration = ckpt / "iter_0000005"
    assert sorted(p.name for p in iteration.iterdir()) == ["checksums.json", "mp_rank_00_000", "mp_rank_00_001",
                                                           "mp_rank_01_000", "mp_rank_01_001"]
    manifest = json.loads((iteration / "checksums.json").read_text())  # rank 0 lists every rank's file
    assert sorted(manifest["files"]) == [f"mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt"
                                         for tp in (0, 1) for pp in (0, 1)]
    files = {(tp, pp): _load(iteration / f"mp_rank_{tp:02d}_{pp:03d}" / "model_optim_rng.pt")
             for tp in (0, 1) for pp in (0, 1)}
    for (tp, pp), state in files.items():
        assert sorted(state) == ["args", "checkpoint_version", "iteration", "model",
                                 "num_floating_point_operations_so_far", "opt_param_scheduler", "optimizer",
                                 "rng_state"], (tp, pp)
        assert state["iteration"] == 5 and state["checkpoint_version"] == 3.0
        args = state["args"]
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
        assert args.virtual_pipeline_model_parallel_size is None and args.consumed_train_samples == 40
        assert _layer_indices(state["model"]) == [0, 1]  # numbered locally on each stage
    first, last = files[0, 0]["model"], files[0, 1]["model"]
    assert _non_layer_keys(first) == ["embedding.position_embeddings.weight", "embedding.word_embeddings.weight"]
    assert _non_layer_keys(last) == ["decoder.final_layernorm.bias", "decoder.final_layernorm.weight",
                                     "output_layer.weight"]
    for tp in (0, 1):  # tied: the last stage's output layer is a copy kept equal to the embedding shard
        assert files[tp, 1]["model"]["output_layer.weight"].shape == (384, 32)  # 768 padded rows / 2
        torch.testing.assert_close(files[tp, 1]["model"]["output_layer.weight"],
                                   files[tp, 0]["model"]["embedding.word_embeddings.weight"], rtol=0, atol=0)
    serial = _load(runs["serial_ckpt"] / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt")["model"]
    for pp in (0, 1):
        _assert_stage_holds_serial_weights([files[0, pp]["model"], files[1, pp]["model"]], 2 * pp, serial)


def test_interleaved_logs_the_serial_losses_and_resumes_exactly(runs):
    _assert_matches_serial(runs, "vp_first", "vp_resumed")
    assert "[ t 1/1, p 1/2 ] at iteration 5" in runs["vp_resumed"].stdout


def test_interleaved_checkpoint_holds_one_model_per_chunk(runs):
    iteration = runs["vp_ckpt"] / "iter_0000005"
    assert sorted(p.name for p in iteration.iterdir()) == ["checksums.json", "mp_rank_00_000", "mp_rank_00_001"]
    serial = _load(runs["serial_ckpt"] / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt")["model"]
    for pp in (0, 1):
        state = _load(iteration / f"mp_rank_00_{pp:03d}" / "model_optim_rng.pt")
        assert "model" not in state and {"model0", "model1"} <= set(state)
        assert state["args"].virtual_pipeline_model_parallel_size == 2
        for chunk in (0, 1):
            model = state[f"model{chunk}"]
            assert _layer_indices(model) == [0]
            _assert_stage_holds_serial_weights([model], chunk * 2 + pp, serial)  # layer v*(L/vp) + p*(L/pp/vp)
        assert _non_layer_keys(state["model1" if pp == 0 else "model0"]) == []
    assert _non_layer_keys(_load(iteration / "mp_rank_00_000" / "model_optim_rng.pt")["model0"]) == [
        "embedding.position_embeddings.weight", "embedding.word_embeddings.weight"]
    assert _non_layer_keys(_load(iteration / "mp_rank_00_001" / "model_optim_rng.pt")["model1"]) == [
        "decoder.final_layernorm.bias", "decoder.final_layernorm.weight", "output_layer.weight"]


@pytest.mark.parametrize("run, expected", [
    ("wrong_pp", "was saved with --pipeline-model-parallel-size 2 but this run has "
                 "--pipeline-model-parallel-size 1"),
    ("wrong_vp", "was saved with --num-virtual-stages-per-pipeline-rank 2 but this run has no "
                 "--num-virtual-stages-per-pipeline-rank"),
])
def test_loading_at_another_pipeline_layout_is_refused_before_training(runs, run, expected):
    proc = runs[run]
    assert proc.returncode != 0
    assert not re.search(r'File ".*(pretrain_gpt|megatron)', proc.stderr)  # a message, not a traceback
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert errors and all(expected in line for line in errors), proc.stderr[-3000:]
    assert "resharding is the checkpoint converter's job" in errors[0]
    assert logged_losses(proc.stdout) == {}  # refused before the first iteration
    assert runs["vp_after"] == runs["vp_before"]  # --save to the same directory wrote nothing
