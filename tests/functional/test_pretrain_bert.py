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
           f"--save-interval {ITERS} --split 90,5,5 --num-workers 0 --cpu-threads 1")
BERT_LOG = re.compile(r"iteration +(\d+)/ +\d+ \|.*\| lm loss: (\S+) \| (?:sop loss: (\S+) \| )?loss scale")


def run_script(tmp_path, nltk_data_dir, *, binary_head: bool):
    pytest.importorskip("tokenizers", reason="the script trains a WordPiece vocabulary")
    pytest.importorskip("nltk", reason="--split-sentences uses NLTK punkt")
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        make_default_corpus.build_corpus(str(corpus), max_documents=40)
    data, vocab = tmp_path / "bert_text_sentence", tmp_path / "tokenizer" / "vocab.txt"
    env = dict(os.environ, PYTHON=sys.executable, CORPUS=str(corpus), VOCAB_SIZE="1000", TRAIN_ITERS=str(ITERS),
               WORKERS="1", EXTRA_ARGS=SMALLER, MASTER_PORT=str(29300 + os.getpid() % 300),
               NLTK_DATA=str(nltk_data_dir), BINARY_HEAD="1" if binary_head else "0")
    env.pop("PYTHONPATH", None)
    checkpoints = tmp_path / ("checkpoints" if binary_head else "checkpoints-no-head")
    proc = subprocess.run(["bash", SCRIPT, str(data), str(vocab), str(checkpoints)], env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    rows = [(int(m[1]), float(m[2]), m[3] and float(m[3])) for m in map(BERT_LOG.search, out.splitlines()) if m]
    return out, rows


def test_pretrain_bert_script_builds_sentence_data_and_learns(tmp_path, nltk_data_dir):
    out, rows = run_script(tmp_path, nltk_data_dir, binary_head=True)
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
    assert [r[0] for r in rows] == list(range(1, ITERS + 1))
    assert all(r[2] is None for r in rows) and "sop loss" not in out  # the lm loss alone
