"""pretrain_t5.py end to end: examples/pretrain_t5.sh (corpus -> WordPiece vocab -> sentence-split
dataset -> a tiny T5 trained on CPU under torchrun) logs Megatron's lines and learns; in process,
a run stopped at iteration N and resumed from its checkpoint gives the uninterrupted run's losses.

40 documents of the built-in default corpus, a 1,000-token WordPiece vocabulary and a smaller
model through EXTRA_ARGS; NLTK's punkt data (for --split-sentences) comes from the shared test data."""
import os
import re
import subprocess
import sys

import pytest

import pretrain_t5
from megatron.training.checkpointing import get_checkpoint_tracker_filename
from tools import make_default_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_t5.sh")
ITERS = 12
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-channels 16 --ffn-hidden-size 128 "
         "--encoder-seq-length 64 --decoder-seq-length 24 --max-position-embeddings 64 --vocab-extra-ids 100 "
         "--micro-batch-size 8 --global-batch-size 8 --lr 5e-3 --min-lr 1e-3 --lr-warmup-fraction 0 "
         "--log-interval 1 --eval-iters 1 --split 90,5,5 --num-workers 0 --cpu-threads 1")
SMALLER = f"{MODEL} --hidden-dropout 0 --attention-dropout 0 --eval-interval 1000 --save-interval {ITERS}"
# Megatron's training log line (training_log), with T5's one loss entry
LOG_LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/ +\d+ \| consumed samples: +\d+ \| "
    r"elapsed time per iteration \(ms\): [\d.]+ \| throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| "
    r"learning rate: \S+ \| global batch size: +8 \| lm loss: (\S+) \| loss scale: [\d.]+ \| "
    r"grad norm: [\d.]+ \| number of skipped iterations: +0 \| number of nan iterations: +0 \|$", re.M)


@pytest.fixture(scope="module")
def script_run(tmp_path_factory, nltk_data_dir):
    """(output, [(iteration, lm loss)], data prefix, vocab file) of examples/pretrain_t5.sh."""
    pytest.importorskip("tokenizers", reason="the script trains a WordPiece vocabulary")
    pytest.importorskip("nltk", reason="--split-sentences uses NLTK punkt")
    root = tmp_path_factory.mktemp("t5_script")
    corpus = root / "corpus.jsonl"
    make_default_corpus.build_corpus(str(corpus), max_documents=40)
    data, vocab = root / "t5_text_sentence", root / "tokenizer" / "vocab.txt"
    env = dict(os.environ, PYTHON=sys.executable, CORPUS=str(corpus), VOCAB_SIZE="1000", TRAIN_ITERS=str(ITERS),
               WORKERS="1", EXTRA_ARGS=SMALLER, MASTER_PORT=str(29600 + os.getpid() % 300),
               NLTK_DATA=str(nltk_data_dir))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", SCRIPT, str(data), str(vocab), str(root / "checkpoints")], env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    rows = [(int(m[1]), float(m[2])) for m in LOG_LINE.finditer(out)]
    return out, rows, str(data), str(vocab)


def test_pretrain_t5_script_builds_sentence_data_and_learns(script_run):
    out, rows, data, _ = script_run
    assert "> trained BertWordPieceLowerCase tokenizer: vocab size 1000" in out
    assert os.path.isfile(data + ".idx")  # --split-sentences' output name
    assert re.search(r"^  decoder_seq_length \.+ 24$", out, re.M) and re.search(r"^  seq_length \.+ 64$", out, re.M)
    assert "WARNING: these Megatron-LM flags have no effect" not in out  # T5 reads its flags
    assert [r[0] for r in rows] == list(range(1, ITERS + 1))
    lm = [r[1] for r in rows]
    assert 6.0 < lm[0] < 8.5  # about log(1,000 + specials + 100 sentinels) = 7.0 at the start
    assert sum(lm[-3:]) / 3 < lm[0] - 1.0
    assert re.search(r"validation loss at iteration +\d+ on validation set \| lm loss value: \S+ \| "
                     r"lm loss PPL: \S+ \| $", out, re.M)
    assert re.search(rf"successfully saved checkpoint from iteration +{ITERS} to ", out)


def _losses(result):
    return [record.losses["lm loss"] for record in result.history]


@pytest.mark.parametrize("positions", ["learned_absolute", "relative"])
def test_resume_continues_exactly(script_run, tmp_path, positions):
    """8 straight == 4, save, exit, resume for 4: iterations 5..8 identical (dropout on)."""
    _, _, data, vocab = script_run
    common = [*MODEL.split(), "--data-path", data, "--vocab-file", vocab, "--train-iters", "8",
              "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--eval-iters", "0",
              "--position-embedding-type", positions, "--data-cache-path", str(tmp_path / "cache")]
    straight = pretrain_t5.main(common, record_history=True)
    ckpt = str(tmp_path / "ckpt")
    first = pretrain_t5.main([*common, "--save", ckpt, "--save-interval", "4", "--exit-interval", "4"],
                             record_history=True)
    assert first.iteration == 4 and open(get_checkpoint_tracker_filename(ckpt)).read() == "4"
    resumed = pretrain_t5.main([*common, "--load", ckpt], record_history=True)
    assert _losses(first) == _losses(straight)[:4]
    assert _losses(resumed) == _losses(straight)[4:]
    assert _losses(straight)[-1] < _losses(straight)[0]


# ------------------------------------------------------------------------------ parallel layouts
# pretrain_t5.main on 4 gloo ranks (a pool spawned for this module): the same data and model at
# DP=4, TP=2 x DP=2 with sequence parallelism, encoder/decoder PP=2 x DP=2 with the distributed
# optimizer, TP=2 x PP=2, and PP=4 split at 2 with the distributed optimizer give the same losses; a torch_dist checkpoint of the PP=2 run loads
# at TP=2 x DP=2 and continues with the uninterrupted run's losses.

LAYOUTS = {
    "dp4": [],
    "tp2-sp-dp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2-dp2-distopt": ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-split-rank", "1",
                        "--use-distributed-optimizer"],
    "tp2-pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                "--pipeline-model-parallel-split-rank", "1"],
    "pp4-split2-distopt": ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-split-rank", "2",
                           "--use-distributed-optimizer"],
}


def _pretrain_t5(argv):
    """Every rank: train with argv; the last rank's {iteration: lm loss} (it logs the losses)."""
    from megatron.training.initialize import reset_megatron

    try:
        result = pretrain_t5.main(list(argv), record_history=True)
    finally:
        reset_megatron()
    return {record.iteration: record.losses.get("lm loss") for record in result.history}


@pytest.fixture(scope="module")
def pool4():
    from tests.parallel.harness import DistributedPool

    pool = DistributedPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def layout_runs(script_run, pool4, tmp_path_factory):
    _, _, data, vocab = script_run
    root = tmp_path_factory.mktemp("t5_layouts")
    # --adam-eps 1e-4: gradients that are zero in exact arithmetic (the attention key biases: a
    # softmax ignores a shift shared by all keys) are rounding noise that differs by layout, and
    # Adam with eps 1e-8 turns that noise into lr-sized steps of random sign (one CI machine's data
    # drifted 1.5e-5 by iteration 5); a larger eps keeps such steps at the noise's size.
    common = [*MODEL.split(), "--data-path", data, "--vocab-file", vocab, "--train-iters", "6",
              "--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
              "--make-vocab-size-divisible-by", "64", "--data-cache-path", str(root / "cache"), "--adam-eps", "1e-4"]
    runs = {}
    for name, flags in LAYOUTS.items():
        extra = ["--save", str(root / "pp2-ckpt"), "--save-interval", "3"] if name == "pp2-dp2-distopt" else []
        runs[name] = pool4.run(_pretrain_t5, [*common, *flags, *extra])[-1]
    return common, root, runs


def test_parallel_layouts_train_with_the_same_losses(layout_runs):
    _, _, runs = layout_runs
    reference = runs["dp4"]
    assert sorted(reference) == list(range(1, 7))
    for name, losses in runs.items():
        assert sorted(losses) == sorted(reference), name
        for iteration, loss in reference.items():
            assert losses[iteration] == pytest.approx(loss, rel=1e-5), (name, iteration)


def test_a_pipeline_checkpoint_resumes_at_another_layout(layout_runs, pool4):
    common, root, runs = layout_runs
    tracker = root / "pp2-ckpt" / "latest_checkpointed_iteration.txt"
    from megatron.core.atomic_io import atomic_write

    atomic_write(str(tracker), lambda f: f.write(b"3"))
    resumed = pool4.run(_pretrain_t5, [*common, *LAYOUTS["tp2-sp-dp2"], "--load", str(root / "pp2-ckpt")])[-1]
    assert sorted(resumed) == [4, 5, 6]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(runs["pp2-dp2-distopt"][iteration], rel=1e-5), iteration
