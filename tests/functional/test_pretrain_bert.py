"""pretrain_bert.py end to end, through examples/pretrain_bert.sh: corpus -> WordPiece vocab ->
sentence-split dataset -> a tiny BERT trained on CPU, logging Megatron's `lm loss` and `sop loss`.

The script runs as a user runs it (bash, torchrun), on 40 documents of the built-in default
corpus, with a 1,000-token WordPiece vocabulary and a smaller model through EXTRA_ARGS; NLTK's
punkt data (for --split-sentences) comes from the shared test data."""
import os
import re
import subprocess
import sys

import pytest

from tools import make_default_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_bert.sh")
ITERS = 12
SMALLER = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
           "--micro-batch-size 8 --global-batch-size 8 --lr 5e-3 --min-lr 1e-3 --lr-warmup-fraction 0 "
           "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-interval 1000 --eval-iters 1 "
           f"--save-interval {ITERS // 2} --split 90,5,5 --num-workers 0 --cpu-threads 1")
GELU = " --no-bias-gelu-fusion"
BERT_LOG = re.compile(r"iteration +(\d+)/ +\d+ \|.*\| lm loss: (\S+) \| (?:sop loss: (\S+) \| )?loss scale")


def run_script(tmp_path, nltk_data_dir, *, binary_head: bool, checkpoints=None, extra: str = ""):
    pytest.importorskip("tokenizers", reason="the script trains a WordPiece vocabulary")
    pytest.importorskip("nltk", reason="--split-sentences uses NLTK punkt")
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        make_default_corpus.build_corpus(str(corpus), max_documents=40)
    data, vocab = tmp_path / "bert_text_sentence", tmp_path / "tokenizer" / "vocab.txt"
    env = dict(os.environ, PYTHON=sys.executable, CORPUS=str(corpus), VOCAB_SIZE="1000", TRAIN_ITERS=str(ITERS),
               WORKERS="1", EXTRA_ARGS=SMALLER + extra, MASTER_PORT=str(29300 + os.getpid() % 300),
               NLTK_DATA=str(nltk_data_dir), BINARY_HEAD="1" if binary_head else "0")
    env.pop("PYTHONPATH", None)
    checkpoints = checkpoints or tmp_path / ("checkpoints" if binary_head else "checkpoints-no-head")
    proc = subprocess.run(["bash", SCRIPT, str(data), str(vocab), str(checkpoints)], env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    rows = [(int(m[1]), float(m[2]), m[3] and float(m[3])) for m in map(BERT_LOG.search, out.splitlines()) if m]
    return out, rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory, nltk_data_dir):
    """One run of the script: 12 iterations, checkpoints at 6 and 12. The erf GeLU in the MLP
    (--no-bias-gelu-fusion) as in the LM head, so that HF's MegatronBert computes the same function."""
    tmp_path = tmp_path_factory.mktemp("bert")
    out, rows = run_script(tmp_path, nltk_data_dir, binary_head=True, extra=GELU)
    return tmp_path, out, rows


def test_pretrain_bert_script_builds_sentence_data_and_learns(trained):
    tmp_path, out, rows = trained
    assert "> trained BertWordPieceLowerCase tokenizer: vocab size 1000" in out
    assert (tmp_path / "bert_text_sentence.idx").is_file()  # --split-sentences' output name
    assert re.search(r"^  bert_binary_head \.+ True$", out, re.M)
    assert [r[0] for r in rows] == list(range(1, ITERS + 1))
    lm, sop = [r[1] for r in rows], [r[2] for r in rows]
    assert all(value is not None for value in sop)  # Megatron's two log entries
    assert 5.5 < lm[0] < 8.0  # about log(1000) = 6.9 at the start
    assert sum(lm[-3:]) / 3 < lm[0] - 0.5
    assert all(0.3 < value < 1.2 for value in sop)  # the sentence-order cross entropy, about log 2
    assert re.search(r"validation loss at iteration +\d+ on validation set \| lm loss value: \S+ \| lm loss PPL: "
                     r"\S+ \| sop loss value: ", out)
    assert re.search(rf"successfully saved checkpoint from iteration +{ITERS} to ", out)


def test_pretrain_bert_script_without_the_binary_head(tmp_path, nltk_data_dir):
    out, rows = run_script(tmp_path, nltk_data_dir, binary_head=False)
    assert re.search(r"^  bert_binary_head \.+ False$", out, re.M)
    assert "WARNING: these Megatron-LM flags have no effect" not in out  # BERT reads its flags
    assert [r[0] for r in rows] == list(range(1, ITERS + 1))
    assert all(r[2] is None for r in rows) and "sop loss" not in out  # the lm loss alone


def test_pretrain_bert_resumes_exactly_from_its_checkpoint(trained, nltk_data_dir):
    """Point the tracker back at iteration 6 and run the script again: iterations 7..12 log the
    uninterrupted run's losses (the model, optimizer, scheduler, RNG and data position all resume)."""
    from megatron.core.atomic_io import atomic_write

    tmp_path, _, rows = trained
    checkpoints = tmp_path / "checkpoints"
    atomic_write(str(checkpoints / "latest_checkpointed_iteration.txt"), lambda f: f.write(b"6"))
    try:
        out, resumed = run_script(tmp_path, nltk_data_dir, binary_head=True, checkpoints=checkpoints, extra=GELU)
    finally:
        atomic_write(str(checkpoints / "latest_checkpointed_iteration.txt"), lambda f: f.write(str(ITERS).encode()))
    assert re.search(r"successfully loaded checkpoint from .* at iteration 6", out), out[-2000:]
    assert [r[0] for r in resumed] == list(range(7, ITERS + 1))
    assert resumed == rows[6:]  # lm and sop losses to the printed digits


def test_a_pretrain_bert_checkpoint_converts_to_huggingface_with_the_same_logits(trained, tmp_path):
    """The torch_dist checkpoint pretrain_bert.py wrote -> HF MegatronBertForPreTraining through
    tools/checkpoint/convert.py, whose verification compares the MLM and binary-head logits of
    the source model and of the HF model it wrote."""
    pytest.importorskip("transformers")
    source, _, _ = trained
    target = tmp_path / "hf"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"),
                           "--model-type", "BERT", "--loader", "megatron", "--saver", "hf",
                           "--load-dir", str(source / "checkpoints"), "--save-dir", str(target),
                           "--vocab-file", str(source / "tokenizer" / "vocab.txt")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    config = (target / "config.json").read_text()
    assert '"MegatronBertForPreTraining"' in config
    assert re.search(r"verification: .* -> ok", proc.stdout + proc.stderr, re.I), proc.stdout[-2000:]


def test_megatrons_default_bert_gelus_are_refused_by_the_hf_saver_by_name():
    """Megatron's defaults put the tanh GeLU (the fused bias-GeLU) in the MLP and the erf GeLU in the
    LM head; HF's one hidden_act cannot compute both, so the saver says so instead of writing a model
    whose logits differ by about 1e-4."""
    import argparse

    from megatron.convert import huggingface  # noqa: F401 (imports megatron.convert.bert first)
    from megatron.convert.bert import hf_bert_config_from_args

    args = argparse.Namespace(bert_binary_head=True, untie_embeddings_and_output_weights=False, swiglu=False,
                              normalization="LayerNorm", add_bias_linear=True, position_embedding_type="learned_absolute",
                              hidden_size=64, num_attention_heads=4, kv_channels=16, num_layers=2, ffn_hidden_size=256,
                              max_position_embeddings=64, norm_epsilon=1e-5, init_method_std=0.02, hidden_dropout=0.0,
                              attention_dropout=0.0, bias_gelu_fusion=True, openai_gelu=False)
    with pytest.raises(ValueError, match="the tanh GeLU in its MLP .* --no-bias-gelu-fusion for erf in both"):
        hf_bert_config_from_args(args, 1000)
    assert hf_bert_config_from_args(argparse.Namespace(**{**vars(args), "bias_gelu_fusion": False}),
                                    1000)["hidden_act"] == "gelu"
    assert hf_bert_config_from_args(argparse.Namespace(**{**vars(args), "openai_gelu": True}),
                                    1000)["hidden_act"] == "gelu_new"
