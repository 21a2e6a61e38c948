"""pretrain_mamba.py at TP / SP / PP / DP / CP / distributed-optimizer / recompute layouts on the shared 4-rank
gloo pool (TP2+SP x DP2, PP2 x DP2, PP2 x 2 virtual stages x DP2, TP2+SP x PP2, PP2 x DP2 distopt, DP4 distopt
with full recompute, CP2 x DP2): every layout logs the serial run's losses and gradient norms (rel 1e-5); a torch_dist checkpoint the
TP2 x PP2 run saves at iteration 2 resumes at DP4 with the distributed optimizer (the Mamba mixer's explicit
in_proj / conv1d rows resharded) and iterations 3-4 again log the serial run's. The pattern M*-E (an MoE layer of
4 experts, top 2, aux loss) at EP2 x DP4, TP2+SP x EP2 x DP2 with the distributed optimizer and PP2 x EP2 x DP2 logs its serial
run's losses, gradient norms and load-balancing losses (rel 1e-5).

The model: the hybrid pattern M*M- (the pipeline splits it M* | M-), hidden 32, 8 Mamba heads of 8 in 2
groups (TP 2: 4 heads and 1 group per rank), state 8, chunk 128 > s (one chunk), 4 iterations of a global
batch of 8 on mock data, Adam. The serial run is pretrain_mamba.main in this (pytest's) process; each layout
runs it on every pool rank. The gradient norm equals the serial one only if every gradient does (Mamba's
in_proj, conv1d, dt_bias, A_log, D and gated-norm slices included).
"""

from __future__ import annotations

import os

import pytest

import pretrain_mamba

MODEL = ["--num-layers", "4", "--hybrid-override-pattern", "M*M-", "--hidden-size", "32", "--num-attention-heads",
         "4", "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--train-iters", "4", "--lr", "3e-3", "--lr-warmup-iters", "1", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "127", "--make-vocab-size-divisible-by", "64", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "none", "--untie-embeddings-and-output-weights", "--eval-iters", "0",
         "--log-interval", "1", "--clip-grad", "1.0", "--seed", "7", "--num-workers", "0"]
TP2, PP2, DISTOPT = (["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                     ["--pipeline-model-parallel-size", "2"], ["--use-distributed-optimizer"])
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
LAYOUTS = {
    "tp2-sp-dp2": TP2,
    "pp2-dp2": PP2,
    "pp2-vpp2-dp2": [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"],  # chunks M | * | M | - round-robin
    "tp2-sp-pp2": [*TP2, *PP2],
    "pp2-dp2-distopt": [*PP2, *DISTOPT],
    "dp4-distopt-recompute": [*DISTOPT, *RECOMPUTE],
    "cp2-dp2": ["--context-parallel-size", "2"],  # Mamba CP: 4 heads, 1 group per CP rank; the attention's p2p ring
}


def _pretrain(argv):
    """Train with argv; (lm loss, grad norm) by iteration, as this rank recorded them."""
    from megatron.training.initialize import reset_megatron

    try:
        result = pretrain_mamba.main(list(argv), record_history=True)
    finally:
        reset_megatron()
    return {r.iteration: (r.losses.get("lm loss"), r.grad_norm, r.losses.get("load_balancing_loss"))
            for r in result.history}


# The same model with an E (MoE) layer in M*-E: 4 experts of 24, top 2, aux loss 1e-2 (its log value compared too).
MOE_MODEL = [*MODEL, "--hybrid-override-pattern", "M*-E", "--num-experts", "4", "--moe-ffn-hidden-size", "24",
             "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"]
EP2 = ["--expert-model-parallel-size", "2"]
MOE_LAYOUTS = {
    "ep2-dp4": EP2,
    "tp2-sp-ep2-dp2-distopt": [*TP2, *EP2, *DISTOPT],
    "pp2-ep2-dp2": [*PP2, *EP2],  # the stages M* | -E
}


@pytest.fixture(scope="module")
def serial():
    return _pretrain(MODEL)


def _same(run, serial, name, iterations=(1, 2, 3, 4)):
    assert sorted(run) == list(iterations), name
    for iteration in iterations:
        loss, grad_norm, balancing = serial[iteration]
        assert run[iteration][0] == pytest.approx(loss, rel=1e-5), (name, iteration, "loss")
        assert run[iteration][1] == pytest.approx(grad_norm, rel=1e-5), (name, iteration, "grad norm")
        assert (run[iteration][2] is None) == (balancing is None), (name, iteration, "balancing loss logged")
        if balancing is not None:
            assert run[iteration][2] == pytest.approx(balancing, rel=1e-5), (name, iteration, "balancing loss")


def test_layouts_log_the_serial_runs_losses(dist_pool, serial, tmp_path):
    assert sorted(serial) == [1, 2, 3, 4]
    ckpt = str(tmp_path / "ckpt")
    saving = ["--save", ckpt, "--save-interval", "2", "--ckpt-format", "torch_dist"]
    for name, flags in LAYOUTS.items():
        extra = saving if name == "tp2-sp-pp2" else []
        run = dist_pool.run(_pretrain, [*MODEL, *flags, *extra])[-1]  # the last rank: the last pipeline stage
        _same(run, serial, name)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as tracker:
        tracker.write("2")
    resumed = dist_pool.run(_pretrain, [*MODEL, *DISTOPT, "--load", ckpt, "--ckpt-format", "torch_dist"])[-1]
    _same(resumed, serial, "tp2-pp2 checkpoint resumed at dp4-distopt", (3, 4))


def test_moe_layouts_log_the_serial_runs_losses(dist_pool):
    serial = _pretrain(MOE_MODEL)
    assert sorted(serial) == [1, 2, 3, 4] and all(serial[i][2] > 0 for i in serial)
    for name, flags in MOE_LAYOUTS.items():
        _same(dist_pool.run(_pretrain, [*MOE_MODEL, *flags])[-1], serial, name)
