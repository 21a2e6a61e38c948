"""megatron.training.api.load: a HuggingFace folder or one of our checkpoints becomes a model whose
score() gives HF transformers' log-probabilities and whose greedy generate() gives HF's text."""

import os
import subprocess
import sys

import pytest
import torch

from megatron.training.api import load
from megatron.training.config import MegatronConfig
from megatron.training.initialize import reset_megatron
from tests.helpers.paths import ROOT

transformers = pytest.importorskip("transformers")

EOT = 50256
TEXTS = ["The quick brown fox jumps over the lazy dog.", "In the beginning God created the heaven"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory, gpt2_vocab_dir):
    from tests.helpers.hf_models import gpt2_folder

    return gpt2_folder(tmp_path_factory.mktemp("api_load") / "hf", gpt2_vocab_dir, 64)


def _hf_scores(hf, text):
    model, tokenizer, _ = hf
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0].tolist()


@pytest.fixture
def fresh():
    yield
    reset_megatron()


def test_a_huggingface_folder_scores_and_generates_as_transformers(hf, fresh):
    model = load(str(hf[2]))
    for text, scores in zip(TEXTS, model.score(TEXTS)):
        assert scores == pytest.approx(_hf_scores(hf, text), rel=1e-4, abs=1e-5)
    assert model.score(TEXTS[0]) == pytest.approx(_hf_scores(hf, TEXTS[0]), rel=1e-4, abs=1e-5)
    hf_model, tokenizer, _ = hf
    ids = torch.tensor([tokenizer.encode("The cat")])
    want = hf_model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=EOT)[0]
    assert model.generate("The cat", max_new_tokens=8) == tokenizer.decode(want)


def test_our_checkpoint_of_it_scores_the_same(hf, tmp_path, gpt2_vocab_dir, fresh):
    ckpt = tmp_path / "ckpt"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"), "--model-type",
                          "GPT", "--loader", "hf", "--saver", "megatron", "--load-dir", str(hf[2]),
                          "--save-dir", str(ckpt)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    config = MegatronConfig()
    config.tokenizer.tokenizer_type = "GPT2BPETokenizer"
    config.tokenizer.vocab_file = str(gpt2_vocab_dir / "vocab.json")
    config.tokenizer.merge_file = str(gpt2_vocab_dir / "merges.txt")
    model = load(str(ckpt), config)
    for text, scores in zip(TEXTS, model.score(TEXTS)):
        assert scores == pytest.approx(_hf_scores(hf, text), rel=1e-4, abs=1e-5)


def test_a_folder_that_is_neither_is_one_line(tmp_path):
    from megatron.training.checkpointing import CheckpointError

    with pytest.raises(CheckpointError, match=r"neither a checkpoint folder .* nor a HuggingFace folder"):
        load(str(tmp_path))
