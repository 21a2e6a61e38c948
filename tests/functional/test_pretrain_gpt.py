"""pretrain_gpt.py end to end, in-process: learning, logging, exact resume, fp16 overflow, exits."""
import json
import math
import re

import pytest
import torch

import pretrain_gpt
from megatron.training.checkpointing import get_checkpoint_tracker_filename
from megatron.core.enums import ModelType
from megatron.training.training import NaNLossError, pretrain
from tests.helpers.training import MOCK, TINY, log_lines, losses
from tools import preprocess_data


@pytest.fixture(scope="module")
def text_data(tmp_path_factory, corpus_path, gpt2_vocab_dir):
    """The first 150 documents of the real corpus, preprocessed with the GPT-2 tokenizer."""
    root = tmp_path_factory.mktemp("kjv")
    subset = root / "subset.jsonl"
    with open(corpus_path, encoding="utf-8") as src, open(subset, "w", encoding="utf-8") as dst:
        for _, line in zip(range(150), src):
            dst.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(gpt2_vocab_dir / "vocab.json"),
                 "--merge-file", str(gpt2_vocab_dir / "merges.txt")]
    preprocess_data.main(["--input", str(subset), "--output-prefix", str(root / "kjv"), "--append-eod",
                          "--workers", "1", *tokenizer])
    return ["--data-path", str(root / "kjv_text_document"), "--split", "90,5,5",
            "--data-cache-path", str(root / "cache"), *tokenizer]


def test_loss_decreases_on_real_text_and_validation_is_logged(text_data, capsys):
    result = pretrain_gpt.main([*TINY, *text_data, "--train-iters", "40", "--eval-interval", "20",
                                "--eval-iters", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
                                "--lr-warmup-iters", "4", "--lr-decay-style", "cosine"], record_history=True)
    out = capsys.readouterr().out
    values = [loss for _, loss in losses(result)]
    assert len(values) == 40 and all(math.isfinite(v) for v in values)
    assert values[0] > math.log(50257) - 1.0  # starts near uniform over the GPT-2 vocabulary
    assert sum(values[-5:]) / 5 < values[0] - 2.0
    rows = log_lines(out)
    assert [r["iteration"] for r in rows] == list(range(1, 41))
    assert [r["consumed"] for r in rows] == [4 * i for i in range(1, 41)]
    validation = re.findall(r" validation loss at (.+?) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \|", out)
    assert [v[0] for v in validation] == ["iteration 20", "iteration 40", "iteration 40 on validation set",
                                          "iteration 40 on test set"]
    for _, value, ppl in validation:
        assert float(ppl) == pytest.approx(math.exp(float(value)), rel=1e-5)
    assert float(validation[1][1]) < float(validation[0][1])
    assert " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): " in out


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_resume_continues_exactly(tmp_path, precision):
    """2N straight == N, save, exit, resume for N: iterations N+1..2N bit-identical (dropout on)."""
    common = [*TINY, *MOCK, *precision, "--train-iters", "8", "--hidden-dropout", "0.1",
              "--attention-dropout", "0.1", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
              "--eval-iters", "0"]
    straight = pretrain_gpt.main(common, record_history=True)
    ckpt = str(tmp_path / "ckpt")
    first = pretrain_gpt.main([*common, "--save", ckpt, "--save-interval", "4", "--exit-interval", "4"],
                              record_history=True)
    assert first.exit_reason == "interval" and first.iteration == 4
    assert open(get_checkpoint_tracker_filename(ckpt)).read() == "4"
    resumed = pretrain_gpt.main([*common, "--load", ckpt, "--save", ckpt, "--save-interval", "4"],
                                record_history=True)
    assert losses(first) == losses(straight)[:4]
    assert losses(resumed) == losses(straight)[4:]
    assert [r.grad_norm for r in resumed.history] == [r.grad_norm for r in straight.history[4:]]
    assert [r.learning_rate for r in resumed.history] == [r.learning_rate for r in straight.history[4:]]


def test_fp16_overflow_skips_the_step_halves_the_scale_and_recovers(capsys):
    """An inf gradient injected at iteration 3: skipped, loss scale 1024 -> 512, training goes on."""
    calls = {"n": 0}

    def forward_step(data_iterator, model):
        output, loss_fn = pretrain_gpt.forward_step(data_iterator, model)
        calls["n"] += 1
        if calls["n"] in (5, 6):  # both micro-batches of iteration 3
            output.register_hook(lambda grad: grad * float("inf"))
        return output, loss_fn

    result = pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                      ModelType.encoder_or_decoder, forward_step, record_history=True,
                      argv=[*TINY, *MOCK, "--fp16", "--train-iters", "6", "--initial-loss-scale", "1024",
                            "--hysteresis", "1", "--eval-iters", "0"])
    rows = log_lines(capsys.readouterr().out)
    assert [r.skipped for r in result.history] == [False, False, True, False, False, False]
    assert [r.loss_scale for r in result.history] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 512.0]
    assert [r["skipped"] for r in rows] == [0, 0, 1, 0, 0, 0]
    assert [r["scale"] for r in rows] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 512.0]
    assert rows[2]["loss"] is None and all(r["loss"] is not None for i, r in enumerate(rows) if i != 2)
    assert all(math.isfinite(r.losses["lm loss"]) for r in result.history)
    # the skipped step left the learning-rate schedule where it was
    assert result.history[2].learning_rate == result.history[1].learning_rate
    # the steps after the overflow update again (mock tokens are uniform noise, so the loss
    # itself stays near ln(vocab) and says nothing about recovery)
    assert all(r.grad_norm is not None and math.isfinite(r.grad_norm) and r.grad_norm > 0
               for i, r in enumerate(result.history) if i != 2)


def test_check_for_nan_names_the_iteration():
    def forward_step(data_iterator, model):
        output, loss_fn = pretrain_gpt.forward_step(data_iterator, model)
        if forward_step.calls == 1:  # the single micro-batch of iteration 2
            output = output * float("nan")
        forward_step.calls += 1
        return output, loss_fn
    forward_step.calls = 0
    with pytest.raises(NaNLossError, match="iteration 2: lm loss is nan"):
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 ModelType.encoder_or_decoder, forward_step,
                 argv=[*TINY, *MOCK, "--train-iters", "4", "--eval-iters", "0", "--micro-batch-size", "4",
                       "--check-for-nan-in-loss-and-grad"])


def test_deterministic_mode_gives_bit_identical_losses():
    argv = [*TINY, *MOCK, "--train-iters", "5", "--eval-iters", "0", "--deterministic-mode"]
    try:
        a = pretrain_gpt.main(argv, record_history=True)
        assert torch.are_deterministic_algorithms_enabled()
        b = pretrain_gpt.main(argv, record_history=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert losses(a) == losses(b) and len(losses(a)) == 5


def test_per_token_loss_and_custom_two_value_loss_functions_train():
    """The documented custom-loss forms: Megatron-Core's (sum, tokens, report) and (loss, report)."""
    per_token = pretrain_gpt.main([*TINY, *MOCK, "--train-iters", "3", "--eval-iters", "0",
                                   "--calculate-per-token-loss"], record_history=True)
    default = pretrain_gpt.main([*TINY, *MOCK, "--train-iters", "3", "--eval-iters", "0"], record_history=True)
    # full loss masks: per-token and per-micro-batch normalisation give the same training
    for a, b in zip(losses(per_token), losses(default)):
        assert a[1] == pytest.approx(b[1], rel=1e-5)

    def forward_step(data_iterator, model):
        tokens, labels, loss_mask, attention_mask, position_ids = pretrain_gpt.get_batch(data_iterator)
        output = model(tokens, position_ids, attention_mask, labels=labels)

        def mean_loss(output_tensor):
            loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
            return loss, {"my loss": loss.detach()}
        return output, mean_loss

    custom = pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                      ModelType.encoder_or_decoder, forward_step, record_history=True,
                      argv=[*TINY, *MOCK, "--train-iters", "3", "--eval-iters", "0"])
    assert [r.losses["my loss"] for r in custom.history] == pytest.approx(
        [loss for _, loss in losses(default)], rel=1e-5)
