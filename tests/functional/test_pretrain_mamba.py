"""pretrain_mamba.py end to end: a hybrid M*M- model trains from the command line, logs Megatron's
lines, saves torch_dist checkpoints and resumes from one exactly."""

from __future__ import annotations

import math

import pretrain_mamba
from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename
from tests.helpers.launch import run_cli
from tests.helpers.training import MOCK, TINY, logged_losses, losses

HYBRID = [*TINY, *MOCK, "--num-layers", "4", "--hybrid-override-pattern", "M*M-", "--mamba-state-dim", "8",
          "--mamba-head-dim", "8", "--mamba-num-groups", "2", "--normalization", "RMSNorm", "--disable-bias-linear",
          "--swiglu", "--position-embedding-type", "none", "--untie-embeddings-and-output-weights",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--train-iters", "4",
          "--lr-warmup-iters", "1"]


def test_cli_trains_a_hybrid_model_and_resumes_from_torch_dist(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = run_cli(["pretrain_mamba.py", *HYBRID, "--save", ckpt, "--save-interval", "2", "--ckpt-format",
                     "torch_dist"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert " > hybrid layer pattern M*M- (M Mamba, * attention, - MLP, E MoE)" in first.stdout
    straight = logged_losses(first.stdout)
    assert sorted(straight) == [1, 2, 3, 4] and all(math.isfinite(v) for v in straight.values())
    with open(get_checkpoint_tracker_filename(ckpt), "w") as tracker:  # resume from iteration 2
        tracker.write("2")
    # In-process (the same entry point's main), the run's own log precision: iterations 3 and 4 again.
    resumed = pretrain_mamba.main([*HYBRID, "--load", ckpt, "--ckpt-format", "torch_dist"], record_history=True)
    assert [i for i, _ in losses(resumed)] == [3, 4]
    for iteration, loss in losses(resumed):
        assert float(f"{loss:.6E}") == straight[iteration]  # the log line's {:.6E}


def test_a_hybrid_model_with_moe_layers_trains_and_logs_the_balancing_loss(capsys, tmp_path):
    """M*-E: the E layer (the MoE MLP, 4 experts, top 2) trains in-process; the log line's balancing loss
    is the mean over the pattern's one MoE layer, so it equals layer 4's own line. Its checkpoint
    converts to EP 2 (the experts split over two files; the converter checks each layer's keys by its
    pattern symbol) and back to EP 1 bit for bit."""
    import re

    import torch

    from megatron.training.initialize import reset_megatron
    from tests.helpers.convert import run_convert

    ckpt = tmp_path / "ckpt"
    flags = [*HYBRID, "--hybrid-override-pattern", "M*-E", "--num-experts", "4", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "0.01", "--moe-per-layer-logging",
             "--train-iters", "3", "--save", str(ckpt), "--save-interval", "3", "--ckpt-format", "torch"]
    try:
        result = pretrain_mamba.main(flags, record_history=True)
    finally:
        reset_megatron()
    out = capsys.readouterr().out
    assert [i for i, _ in losses(result)] == [1, 2, 3] and all(math.isfinite(v) for _, v in losses(result))
    overall = re.findall(r"\| lm loss: \S+ \| load_balancing_loss: (\S+) \|", out)
    per_layer = re.findall(r"^ moe layer (\d+): load_balancing_loss: (\S+) \|", out, re.M)
    assert len(overall) == 3 and [layer for layer, _ in per_layer] == ["4", "4", "4"]
    assert [float(v) for v in overall] == [float(v) for _, v in per_layer]
    assert all(float(v) > 0 for v in overall)
    run_convert(ckpt, tmp_path / "ep2", "megatron", "megatron", "--target-expert-parallel-size", "2")
    assert sorted(p.name for p in (tmp_path / "ep2" / "iter_0000003").glob("mp_rank_*")) == ["mp_rank_00_000",
                                                                                             "mp_rank_00_001"]
    run_convert(tmp_path / "ep2", tmp_path / "back", "megatron", "megatron", "--target-expert-parallel-size", "1")
    source, back = (torch.load(get_checkpoint_name(str(d), 3), weights_only=False)["model"]
                    for d in (ckpt, tmp_path / "back"))
    source = {k: v for k, v in source.items() if "_extra_state" not in k}
    assert "decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight" in source
    assert sorted(source) == sorted(k for k in back if "_extra_state" not in k)
    assert all(torch.equal(source[k], back[k]) for k in source)
