"""pretrain_gpt.py with the aux-loss-free expert bias and group-limited routing (sigmoid top-2 of 4
experts in 2 groups, each token's experts from its best group): the serial run, a data-parallel run on
2 gloo ranks and a TP 2 run with sequence parallelism (each rank routes half of each sequence) log the same
losses (rel 1e-5), and the routers' biases after training are the same on both ranks and equal to the
serial run's (the counts are summed over the TP x DP ranks before each update); the bias moves each step by
exactly the update rate per expert. A run resumed from its
iteration-2 checkpoint (torch_dist, the bias saved under mlp.router.expert_bias) continues with the
uninterrupted run's losses and ends with its biases.

The tasks call pretrain() with the recipe's arguments and a model provider that keeps the model, so the
routers' buffers can be read after the run.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

RATE = 0.01
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--train-iters", "3", "--lr", "3e-3", "--lr-warmup-iters", "1", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "128", "--make-vocab-size-divisible-by", "64", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--eval-iters", "0",
         "--log-interval", "1", "--num-experts", "4", "--moe-ffn-hidden-size", "24", "--moe-router-topk", "2",
         "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
         "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", str(RATE), "--seed", "7",
         "--num-workers", "0", "--cpu-threads", "1"]


def _train(argv):
    """Every rank: pretrain with argv; (losses by iteration as logged, {router: expert_bias})."""
    from megatron.training.initialize import reset_megatron
    from megatron.training.recipes.gpt import model_provider, pretrain_arguments
    from megatron.training.training import pretrain

    models = []

    @functools.wraps(model_provider)
    def keeping(*args, **kwargs):
        model = model_provider(*args, **kwargs)
        models.append(model)
        return model

    try:
        result = pretrain(**dict(pretrain_arguments(), model_provider=keeping), argv=list(argv), record_history=True)
    finally:
        reset_megatron()
    biases = {name: buffer.clone() for model in models for name, buffer in model.named_buffers()
              if name.endswith("router.expert_bias")}
    return {record.iteration: record.losses for record in result.history}, biases


@pytest.fixture(scope="module")
def pool2():
    from tests.parallel.harness import DistributedPool

    pool = DistributedPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def serial():
    return _train(FLAGS)


def _same_losses(run, reference):
    assert sorted(run) == sorted(reference)
    for iteration, losses in reference.items():
        assert run[iteration]["lm loss"] == pytest.approx(losses["lm loss"], rel=1e-5), iteration


@pytest.mark.parametrize("layout", [[], ["--tensor-model-parallel-size", "2", "--sequence-parallel"]],
                         ids=["dp2", "tp2-sp"])
def test_two_ranks_keep_one_bias_and_the_serial_losses(pool2, serial, layout):
    losses, biases = serial
    assert sorted(losses) == [1, 2, 3]
    assert sorted(biases) == ["decoder.layers.0.mlp.router.expert_bias", "decoder.layers.1.mlp.router.expert_bias"]
    for bias in biases.values():
        # 3 updates of +-RATE (0 where an expert got exactly the mean): a multiple of RATE, here not 0 (the
        # bias swings: an expert under the mean in one step is often over it in the next)
        assert bias.dtype == torch.float32 and bias.abs().max() > 0
        steps = bias / RATE
        torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)
        assert steps.abs().max() <= 3
    ranks = pool2.run(_train, [*FLAGS, *layout])
    _same_losses(ranks[-1][0], losses)
    for rank_losses, rank_biases in ranks:
        assert sorted(rank_biases) == sorted(biases)
        for name, bias in biases.items():
            torch.testing.assert_close(rank_biases[name], bias, rtol=0, atol=1e-7, msg=name)


def test_resuming_from_a_checkpoint_keeps_the_bias(pool2, serial, tmp_path):
    from megatron.dist_checkpointing import read_dcp_metadata

    from megatron.core.atomic_io import atomic_write

    ckpt = str(tmp_path / "ckpt")
    pool2.run(_train, [*FLAGS, "--save", ckpt, "--save-interval", "2"])
    atomic_write(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), lambda f: f.write(b"2"))
    saved = read_dcp_metadata(os.path.join(ckpt, "iter_0000002", ".metadata")).state_dict_metadata
    assert "decoder.layers.1.mlp.router.expert_bias" in saved
    assert not any("local_tokens_per_expert" in name for name in saved)  # not persistent, as in Megatron
    ranks = pool2.run(_train, [*FLAGS, "--load", ckpt])
    losses, biases = serial
    assert sorted(ranks[-1][0]) == [3]
    _same_losses(ranks[-1][0], {3: losses[3]})
    for _, rank_biases in ranks:
        for name, bias in biases.items():
            torch.testing.assert_close(rank_biases[name], bias, rtol=0, atol=1e-7, msg=name)
