"""HuggingFace Accelerate's own Megatron-LM example, unchanged, trains on this project on CPU.

`examples/by_feature/megatron_lm_gpt_pretraining.py` (tests/data/accelerate, byte-for-byte) runs
under `torchrun -m megatron.training.accelerate_launch` with a tiny local GPT-2 config, the real
GPT-2 tokenizer and local text files:

    tp2pp2   4 processes, TP 2 x PP 2, 2 micro-batches, sequence parallel, full recompute,
             the distributed optimizer; 5 steps, evaluation, save_state
    tp1pp1   1 process, the same data and batch (2 micro-batches of 2)

Accelerate's engine drives our arguments, model, optimizer, schedules and checkpointing
underneath; the script's own log line gives the evaluation loss after the 5 steps, which must
agree between the two layouts. transformers 5 removed `send_example_telemetry`, which the example
imports: tests/data/accelerate/run_with_transformers5.py supplies a no-op and runs the script.
"""

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.data import accelerate_fixture
from tests.helpers.launch import free_port
from tests.helpers.paths import ROOT

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

EXAMPLE = ROOT / "tests" / "data" / "accelerate" / "megatron_lm_gpt_pretraining.py"
SHIM = ROOT / "tests" / "data" / "accelerate" / "run_with_transformers5.py"
EXAMPLE_SHA256 = "baf61bfc18c75d952f45fcca707fc2c7678f1335f8a46ba289d5f1f6314db914"
EVAL_LINE = re.compile(r"epoch 0: perplexity: (\S+) eval_loss: (\S+)")
STEPS = 5


def _launch(root, model, name, nproc, tp, pp):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(root / "hf_home"), "HF_DATASETS_CACHE": str(root / f"datasets_{name}"),
           "MEGATRON_LM_TP_DEGREE": str(tp), "MEGATRON_LM_PP_DEGREE": str(pp), "MEGATRON_LM_NUM_MICRO_BATCHES": "2",
           "MEGATRON_LM_SEQUENCE_PARALLELISM": str(tp > 1).lower(), "MEGATRON_LM_RECOMPUTE_ACTIVATIONS": "true",
           "MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER": "true", "OMP_NUM_THREADS": "1"}
    out = root / f"out_{name}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
           "-m", "megatron.training.accelerate_launch", str(SHIM), str(EXAMPLE),
           "--config_name", str(model), "--tokenizer_name", str(model),
           "--train_file", str(root / "train.txt"), "--validation_file", str(root / "validation.txt"),
           "--block_size", "64", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
           "--max_train_steps", str(STEPS), "--num_train_epochs", "1", "--learning_rate", "1e-3",
           "--seed", "1234", "--output_dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env, timeout=900)
    return proc, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_path, gpt2_vocab_dir):
    root = tmp_path_factory.mktemp("accelerate_example")
    model = accelerate_fixture(root, corpus_path, gpt2_vocab_dir)
    results = {}
    for name, nproc, tp, pp in (("tp2pp2", 4, 2, 2), ("tp1pp1", 1, 1, 1)):
        proc, out = _launch(root, model, name, nproc, tp, pp)
        assert proc.returncode == 0, f"{name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        results[name] = (proc.stdout + proc.stderr, out)
    return results


def test_the_example_is_accelerates_file_unchanged():
    assert hashlib.sha256(EXAMPLE.read_bytes()).hexdigest() == EXAMPLE_SHA256


def test_tp2_pp2_with_sp_recompute_and_the_distributed_optimizer_is_the_layout_it_ran(runs):
    log, _ = runs["tp2pp2"]
    for flag, value in (("tensor_model_parallel_size", "2"), ("pipeline_model_parallel_size", "2"),
                        ("sequence_parallel", "True"), ("use_distributed_optimizer", "True"),
                        ("recompute_granularity", "full"), ("global_batch_size", "4"), ("train_iters", str(STEPS))):
        assert re.search(rf"^\s+{flag} \.+ {value}$", log, re.M), flag
    assert "DistributedType.MEGATRON_LM" in log or "Distributed environment: MEGATRON_LM" in log


def test_both_layouts_log_the_same_evaluation_loss_after_five_steps(runs):
    found = {name: EVAL_LINE.findall(log) for name, (log, _) in runs.items()}
    assert all(len(lines) == 1 for lines in found.values()), found
    (ppl_a, loss_a), = found["tp2pp2"]
    (ppl_b, loss_b), = found["tp1pp1"]
    assert float(loss_a) == pytest.approx(float(loss_b), rel=1e-5)
    assert float(ppl_a) == pytest.approx(float(ppl_b), rel=1e-4)
    assert float(loss_a) < 10.9  # ln(50257) = 10.82 at random; it trained


@pytest.mark.parametrize("name, ranks", [("tp2pp2", 4), ("tp1pp1", 1)])
def test_save_state_writes_a_megatron_checkpoint_and_the_random_states(runs, name, ranks):
    _, out = runs[name]
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
    iteration = out / f"iter_{STEPS:07d}"
    assert (iteration / "metadata.json").is_file() and (iteration / "common.pt").is_file()
    assert sorted(p.name for p in out.glob("random_states_*.pkl")) == [f"random_states_{r}.pkl" for r in range(ranks)]
    # every rank writes all_results.json: each must hold the perplexity the last stage logged
    (logged_perplexity, _), = EVAL_LINE.findall(runs[name][0])
    assert json.loads((out / "all_results.json").read_text())["perplexity"] == float(logged_perplexity) > 1


def test_a_save_state_checkpoint_converts_to_huggingface_with_its_logits(runs, tmp_path, gpt2_vocab_dir):
    """tools/checkpoint/convert.py --loader megatron --saver hf on what save_state wrote at TP 2 x
    PP 2 (recompute flags included): the converter's own check compares the HF model's logits."""
    _, out = runs["tp2pp2"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py"), "--model-type", "GPT",
         "--loader", "megatron", "--saver", "hf", "--load-dir", str(out), "--save-dir", str(tmp_path / "hf"),
         "--tokenizer-dir", str(gpt2_vocab_dir), "--true-vocab-size", "50257"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"verification: .* logits over 50257 ids: max \|difference\| \S+, .* -> OK", proc.stdout + proc.stderr)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["hidden_size"] == 64 and config["vocab_size"] >= 50257
