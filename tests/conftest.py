"""Shared fixtures: where the real test data lives. Shared helpers (no fixtures) are in tests/helpers/."""
import os
import sys
from pathlib import Path

import pytest
import torch

# What the test modules share lives in tests/helpers/: pytest rewrites the asserts there as in a test module.
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers.paths import ROOT  # noqa: E402 (after the registration)

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Real public data (corpus, GPT-2/BERT/SentencePiece vocabularies, NLTK punkt) sits
# beside the project in ../shared/data; users do not have it, so tests that need it skip.
# torch.compile (our fused kernels, megatron-core's jit_fuser) compiles in the calling process:
# Inductor's default pool of compile workers (one spawned interpreter of ~2 GB per core) buys
# nothing on the 2 cores tests run on, and on a busy machine a megatron-core snippet forked from the
# reference server sat for over ten minutes waiting on that pool. Subprocesses inherit this.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

SHARED_DATA = Path(os.environ.get("MEGATRON_TEST_DATA", ROOT.parent / "shared" / "data"))


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"real test data not found at {path} (set MEGATRON_TEST_DATA to ../shared/data)")
    return path


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return _require(SHARED_DATA)


@pytest.fixture(scope="session")
def corpus_path(shared_data) -> Path:
    return _require(shared_data / "corpus" / "kjv_shakespeare.jsonl")


@pytest.fixture(scope="session")
def gpt2_vocab_dir(shared_data) -> Path:
    return _require(shared_data / "tokenizers" / "gpt2")


@pytest.fixture(scope="session")
def bert_vocab_file(shared_data) -> Path:
    return _require(shared_data / "tokenizers" / "bert-base-uncased" / "vocab.txt")


@pytest.fixture(scope="session")
def sentencepiece_model(shared_data) -> Path:
    return _require(shared_data / "tokenizers" / "sentencepiece" / "mistral-7b-v1.model")


@pytest.fixture(scope="session")
def nltk_data_dir(shared_data) -> Path:
    path = _require(shared_data / "nltk_data")
    os.environ["NLTK_DATA"] = str(path)
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """Models this small run fastest on one intra-op thread (on a busy machine a second one's
    spin-wait costs ten times the work); a module opts in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
