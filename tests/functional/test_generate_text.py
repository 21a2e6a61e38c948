"""tools/generate_text.py (what `make run` ends with): a trained checkpoint's continuations printed,
model flags from the checkpoint (--use-checkpoint-args), equal to megatron.inference.api.generate's."""

import os
import re
import subprocess
import sys

import pytest

import pretrain_gpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "64"]
TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("generate") / "ckpt"
    pretrain_gpt.main([*MODEL, *TOKENIZER, "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-2",
                       "--mock-data", "--save", str(ckpt), "--save-interval", "3", "--eval-iters", "0"])
    from megatron.training.initialize import reset_megatron

    reset_megatron()
    return ckpt


def _run(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate_text.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_prints_each_prompts_greedy_continuation_as_the_api_gives_it(checkpoint):
    run = _run("--load", str(checkpoint), "--use-checkpoint-args", *TOKENIZER, "--prompt", "1 2 3", "--prompt", "7 8",
               "--tokens-to-generate", "5")
    assert run.returncode == 0, run.stderr[-2000:]
    blocks = re.findall(r"^--- (.*)\n(.*)$", run.stdout, re.M)
    assert [prompt for prompt, _ in blocks] == ["'1 2 3'", "'7 8'"]
    texts = [text for _, text in blocks]
    assert texts[0].startswith("1 2 3 ") and len(texts[0].split()) == 8  # 3 + 5 tokens
    assert texts[1].startswith("7 8 ") and len(texts[1].split()) == 8  # a batch runs to its longest prompt + 5
    # the same as the library call on the same checkpoint
    import torch

    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.global_vars import get_tokenizer
    from megatron.inference.api import generate
    from megatron.training.initialize import initialize_megatron, reset_megatron
    from megatron.training.training import get_model

    args = initialize_megatron(argv=[*MODEL, *TOKENIZER, "--micro-batch-size", "1", "--train-iters", "1", "--lr", "0",
                                     "--mock-data", "--load", str(checkpoint)])
    try:
        model = get_model(pretrain_gpt.model_provider)
        load_checkpoint(model, None, None, args=args)
        with torch.no_grad():
            expected = generate(model[0].eval(), get_tokenizer(), ["1 2 3", "7 8"], 5, top_k=1)["text"]
    finally:
        reset_megatron()
    assert texts == expected


def test_no_prompt_is_one_line(checkpoint):
    run = _run("--load", str(checkpoint), "--use-checkpoint-args", *TOKENIZER)
    assert run.returncode == 1
    assert run.stderr.strip() == "generate_text.py: error: give at least one --prompt"
