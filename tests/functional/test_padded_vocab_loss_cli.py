"""pretrain_gpt.py says at start-up which loss it computes, and --include-padded-vocab-in-loss reaches the model."""

import math

import pytest

import pretrain_gpt

# NullTokenizer --vocab-size 300: 301 ids (its end-of-document id included), padded to 384.
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
        "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "1", "--seed", "1234",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]


def test_start_up_log_names_the_loss_in_use(capsys):
    default = pretrain_gpt.main(TINY, record_history=True)
    out = capsys.readouterr().out
    assert (" > loss over the tokenizer's 301 ids, the 83 padding ids excluded "
            "(--include-padded-vocab-in-loss for Megatron's loss over all 384)\n") in out
    assert "padding ids included" not in out

    megatron = pretrain_gpt.main([*TINY, "--include-padded-vocab-in-loss"], record_history=True)
    out = capsys.readouterr().out
    assert (" > loss over all 384 ids, the 83 padding ids included "
            "(Megatron's loss, --include-padded-vocab-in-loss)\n") in out
    assert "padding ids excluded" not in out
    # A fresh model's logits are all small, so each loss is close to log(ids in the softmax): the
    # flag did move the softmax from 301 ids to 384.
    default_loss, megatron_loss = default.history[0].losses["lm loss"], megatron.history[0].losses["lm loss"]
    assert megatron_loss - default_loss == pytest.approx(math.log(384 / 301), abs=0.02)
