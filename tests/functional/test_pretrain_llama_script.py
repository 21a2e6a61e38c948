"""examples/pretrain_llama.sh end to end: corpus -> SentencePiece tokenizer -> dataset -> a Llama-style model;
then examples/pretrain_mixtral.sh on the same data at EP = 2 on two processes.

The scripts run as a user runs them (bash, torchrun, pretrain_gpt.py), on a corpus of 40 documents
of the built-in default corpus, with a 500-piece tokenizer and a smaller model through EXTRA_ARGS
(later flags override the script's)."""
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.training import log_lines
from tools import make_default_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_llama.sh")
ITERS = 12
SMALLER = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 192 --seq-length 64 --max-position-embeddings 64 "
           "--micro-batch-size 4 --global-batch-size 8 --lr 1e-2 --min-lr 1e-3 --log-interval 1 --eval-interval 1000 "
           f"--eval-iters 1 --save-interval {ITERS} --split 80,10,10 --num-workers 0 --cpu-threads 1")


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """(output, tmp dir, data prefix, tokenizer model) of examples/pretrain_llama.sh."""
    pytest.importorskip("sentencepiece", reason="the script trains a SentencePiece tokenizer")
    tmp_path = tmp_path_factory.mktemp("llama_script")
    corpus = tmp_path / "corpus.jsonl"
    make_default_corpus.build_corpus(str(corpus), max_documents=40)
    data, model = tmp_path / "llama_text_document", tmp_path / "tokenizer" / "tokenizer.model"
    env = dict(os.environ, PYTHON=sys.executable, CORPUS=str(corpus), VOCAB_SIZE="500", TRAIN_ITERS=str(ITERS),
               WORKERS="1", EXTRA_ARGS=SMALLER, MASTER_PORT=str(29600 + os.getpid() % 300))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", SCRIPT, str(data), str(model), str(tmp_path / "checkpoints")], env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out, tmp_path, data, model


def test_pretrain_llama_script_builds_its_data_and_trains(llama_run):
    out, tmp_path, data, model = llama_run
    # the data steps ran once each: a 500-piece SentencePiece model, the corpus preprocessed with it
    assert "> trained SentencePieceTokenizer tokenizer: vocab size 500" in out
    assert model.is_file() and (tmp_path / "llama_text_document.idx").is_file()
    assert "> building Llama2Tokenizer tokenizer ..." in out

    # the Llama architecture, as Megatron's argument dump prints it
    for name, value in (("swiglu", "True"), ("normalization", "RMSNorm"), ("position_embedding_type", "rope"),
                        ("group_query_attention", "True"), ("num_query_groups", "2"),
                        ("untie_embeddings_and_output_weights", "True"), ("add_bias_linear", "False")):
        assert re.search(rf"^  {name} \.+ {value}$", out, re.M), f"{name} is not {value}"

    rows = log_lines(out)
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    losses = [r["loss"] for r in rows]
    assert losses[0] > 5.5  # about log(500) = 6.2 at the start
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5
    assert re.search(rf"successfully saved checkpoint from iteration +{ITERS} to ", out)


MIXTRAL = os.path.join(ROOT, "examples", "pretrain_mixtral.sh")


def test_pretrain_mixtral_script_trains_at_ep2_on_the_llama_data(llama_run):
    _, tmp_path, data, model = llama_run
    env = dict(os.environ, PYTHON=sys.executable, TRAIN_ITERS="6", NPROC="2", EP="2",
               EXTRA_ARGS=SMALLER.replace(f"--save-interval {ITERS}", "--save-interval 6") + " --moe-per-layer-logging",
               MASTER_PORT=str(29300 + os.getpid() % 300))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", MIXTRAL, str(data), str(model), str(tmp_path / "mixtral")], env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "trained SentencePieceTokenizer" not in out  # the llama script's data, reused
    for name, value in (("num_experts", "4"), ("moe_router_topk", "2"), ("expert_model_parallel_size", "2"),
                        ("moe_token_dispatcher_type", "alltoall"), ("moe_grouped_gemm", "True")):
        assert re.search(rf"^  {name} \.+ {value}$", out, re.M), f"{name} is not {value}"
    rows = log_lines(out)
    assert [r["iteration"] for r in rows] == list(range(1, 7))
    assert re.search(r"\| load_balancing_loss: \S+ \|", out)
    assert len(re.findall(r"^ moe layer [12]: load_balancing_loss", out, re.M)) == 12  # 2 layers x 6 iterations
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert re.search(r"successfully saved checkpoint from iteration +6 to ", out)
