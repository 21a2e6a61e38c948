"""pretrain_gpt.py with MoE layers on 4 gloo ranks: expert parallelism with DistributedDataParallel
and the distributed optimizer trains with the same losses, balancing losses and gradient norms as
EP = 1, for both dispatchers, with and without capacity dropping; a single process logs the MoE
lines (per layer with --moe-per-layer-logging) and warns about a starved expert.

The model: 2 layers, 4 experts of a SwiGLU MLP, top-2, aux loss 1e-2 and z-loss 1e-3, mock data,
6 iterations of a global batch of 8 (2 micro-batches of 1 per rank at DP = 4); no linear biases but
in one test, whose experts have biases at expert TP 2. The gradient norm,
taken over every parameter once (experts included), equals EP = 1's only if every gradient does.
"""

from __future__ import annotations

import pytest

import pretrain_gpt

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--train-iters", "6", "--lr", "3e-3", "--lr-warmup-iters", "1", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "128", "--make-vocab-size-divisible-by", "64", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--eval-iters", "0",
         "--log-interval", "1", "--num-experts", "4", "--moe-ffn-hidden-size", "24", "--moe-router-topk", "2",
         "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--clip-grad", "1.0", "--seed", "7",
         "--num-workers", "0", "--cpu-threads", "1"]
DIST_OPT = ["--use-distributed-optimizer"]
LAYOUTS = {
    "ep1-dp4": [],
    "ep2-dp4": ["--expert-model-parallel-size", "2", "--check-weight-hash-across-dp-replicas-interval", "2"],
    "ep4-dp4-distopt": ["--expert-model-parallel-size", "4", *DIST_OPT],
    "ep2-dp4-distopt-overlap": ["--expert-model-parallel-size", "2", *DIST_OPT, "--overlap-grad-reduce",
                                "--overlap-param-gather"],
    "tp2-sp-ep2-dp2-distopt": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--expert-model-parallel-size", "2", *DIST_OPT],
    "tp2-sp-etp1-ep2-dp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"],
    "pp2-ep2-dp2-distopt": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", *DIST_OPT],
}
DROPPING = ["--moe-expert-capacity-factor", "1.0"]


def _pretrain(argv):
    """Every rank: train with argv; the last rank's records (it logs the losses)."""
    from megatron.training.initialize import reset_megatron

    try:
        result = pretrain_gpt.main(list(argv), record_history=True)
    finally:
        reset_megatron()
    return {r.iteration: (r.losses, r.grad_norm) for r in result.history}


@pytest.fixture(scope="module")
def pool4():
    from tests.parallel.harness import DistributedPool

    pool = DistributedPool(4)
    yield pool
    pool.close()


def _same(run, reference, name):
    assert sorted(run) == sorted(reference) == list(range(1, 7)), name
    for iteration, (losses, grad_norm) in reference.items():
        got, got_norm = run[iteration]
        assert sorted(got) == ["lm loss", "load_balancing_loss", "z_loss"], name
        for key, value in losses.items():
            assert got[key] == pytest.approx(value, rel=1e-5), (name, iteration, key)
        assert got_norm == pytest.approx(grad_norm, rel=1e-5), (name, iteration, "grad norm")


@pytest.fixture(scope="module")
def reference(pool4):
    """EP = 1 at DP = 4: both dispatchers compute the same function there."""
    return pool4.run(_pretrain, [*MODEL, *LAYOUTS["ep1-dp4"]])[-1]


ALLGATHER_LAYOUTS = ("ep4-dp4-distopt", "tp2-sp-ep2-dp2-distopt")  # (the dispatcher is the same under PP)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_expert_parallel_layouts_train_like_ep1(pool4, reference, dispatcher):
    names = [n for n in LAYOUTS if n != "ep1-dp4" and (dispatcher == "alltoall" or n in ALLGATHER_LAYOUTS)]
    for name in names:
        run = pool4.run(_pretrain, [*MODEL, "--moe-token-dispatcher-type", dispatcher, *LAYOUTS[name]])[-1]
        _same(run, reference, f"{dispatcher} {name}")


def test_biased_experts_at_expert_tp_2_train_like_ep1(pool4):
    """Megatron's default linear biases, TP 2 with SP x EP 2 (expert TP 2): the zero-initialised
    biases move from the first step on, so later losses use them."""
    biased = [f for f in MODEL if f != "--disable-bias-linear"]
    reference = pool4.run(_pretrain, biased)[-1]
    run = pool4.run(_pretrain, [*biased, "--moe-token-dispatcher-type", "alltoall",
                                *LAYOUTS["tp2-sp-ep2-dp2-distopt"]])[-1]
    _same(run, reference, "biased tp2-sp-ep2-dp2-distopt")


def test_expert_parallel_with_capacity_dropping_trains_like_ep1(pool4):
    common = [*MODEL, "--moe-token-dispatcher-type", "alltoall", *DROPPING]
    reference = pool4.run(_pretrain, [*common])[-1]
    for name in ("ep4-dp4-distopt", "ep2-dp4"):
        _same(pool4.run(_pretrain, [*common, *LAYOUTS[name]])[-1], reference, name)


# ------------------------------------------------------------------------------ one process: the log

def test_one_process_logs_balancing_losses_per_layer_tokens_and_warnings():
    import re

    from tests.helpers.launch import run_cli

    flags = [*MODEL, "--num-experts", "16", "--moe-router-topk", "1", "--global-batch-size", "1",
             "--moe-per-layer-logging", "--moe-layer-freq", "([0]+[1])", "--moe-expert-capacity-factor", "0.25",
             "--train-iters", "2"]
    proc = run_cli(["pretrain_gpt.py", *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"\| lm loss: \S+ \| load_balancing_loss: \S+ \| z_loss: \S+ \| loss scale:", out)
    layers = re.findall(r"^ moe layer (\d+): load_balancing_loss: (\S+) \| z_loss: (\S+) \| "
                        r"tokens per expert: \[([\d, ]+)\] \| dropped: ([\d.]+)% \|$", out, re.M)
    assert [layer[0] for layer in layers] == ["2", "2"]  # only layer 2 is an MoE layer
    for _, _, _, counts, _ in layers:
        counts = [int(c) for c in counts.split(",")]
        assert len(counts) == 16 and sum(counts) == 16  # 16 tokens, top-1
    # 16 tokens over 16 experts: some expert gets none; capacity ceil(16 / 16 * 0.25) = 1 drops the rest
    assert re.search(r"^WARNING: MoE layer 2: expert\(s\) \[[\d, ]+\] received no tokens in the last 1 iteration",
                     out, re.M)
    assert re.search(r"^WARNING: MoE layer 2 dropped [\d.]+% of its routed tokens in the last 1 iteration\(s\) "
                     r"\(over --moe-drop-warning-threshold 0.1\)", out, re.M)


def test_a_run_that_stops_between_log_lines_leaves_nothing_to_the_next_in_the_process():
    """The MoE interval (per-layer values since the last log line) belongs to one run: a run that
    stops before its log line, then a run with another expert count in the same process."""
    from megatron.training.initialize import reset_megatron

    try:
        first = pretrain_gpt.main([*MODEL, "--train-iters", "3", "--log-interval", "10"], record_history=True)
    finally:
        reset_megatron()
    try:
        second = pretrain_gpt.main([*MODEL, "--num-experts", "8", "--train-iters", "2"], record_history=True)
    finally:
        reset_megatron()
    assert [r.iteration for r in first.history] == [1, 2, 3] and [r.iteration for r in second.history] == [1, 2]
    assert all("load_balancing_loss" in r.losses for r in second.history)
