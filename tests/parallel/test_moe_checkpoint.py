"""Checkpoints of a GPT with MoE layers at expert parallelism: torch_dist names the experts
globally, so a checkpoint saved by 4 gloo ranks at EP=2 (DP=4, expert DP=2, the distributed
optimizer sharding the experts over expert DP, Adam) loads at EP=1, EP=4 (--moe-grouped-gemm),
TP=2 x EP=2 (ETP=2 and 1; a plain optimizer) and PP=2 x EP=2 with every global tensor (weights
and optimizer state) equal to the saved one and the next iteration's loss equal to the
uninterrupted run's. The classic (torch) format keeps one folder per expert rank
(mp_rank_00_00E, with its distrib_optim.pt): it resumes exactly at EP=2 and refuses another EP
in one line. Every rank runs pretrain_gpt (or the training API) in the shared 4-rank pool.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron.training.checkpoint_safety import CheckpointError
from megatron.core.atomic_io import atomic_write
from megatron.dist_checkpointing import read_dcp_metadata
from tests.helpers.checkpoints import pretrain, pretrain_error

FLAGS = ["--num-layers", "2", "--hidden-size", "16", "--ffn-hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "8",
         "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--lr", "1e-2", "--lr-decay-style", "constant", "--seed", "1234", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "63", "--make-vocab-size-divisible-by", "32",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--eval-iters", "0",
         "--log-interval", "1", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--num-experts", "4", "--moe-ffn-hidden-size", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
         "--moe-layer-freq", "[0,1]", "--moe-token-dispatcher-type", "alltoall"]
EP2 = ["--expert-model-parallel-size", "2"]
DISTOPT = ["--use-distributed-optimizer"]




def _load_and_save(argv, save_dir):
    """Every rank: build the model and optimizer at argv's layout, load --load, save it again at
    that layout in torch_dist under save_dir (no training step in between)."""
    import pretrain_gpt
    from megatron import dist_checkpointing
    from megatron.training.global_vars import get_args
    from megatron.training.initialize import initialize_megatron, reset_megatron
    from megatron.core.enums import ModelType
    from megatron.training.training import setup_model_and_optimizer

    try:
        initialize_megatron(args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, argv=list(argv))
        model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider,
                                                                ModelType.encoder_or_decoder)
        args = get_args()
        args.save = save_dir
        dist_checkpointing.save_checkpoint(args.iteration, model, optimizer, scheduler, args)
    finally:
        reset_megatron()


def _every_tensor(folder):
    """{name: whole tensor} of every tensor a torch_dist iteration folder holds (model and optimizer)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron.dist_checkpointing.layout import GlobalTensor
    from megatron.dist_checkpointing.load import _read

    metadata = read_dcp_metadata(os.path.join(folder, ".metadata"))
    out = {}
    for name, stored in metadata.state_dict_metadata.items():
        if isinstance(stored, TensorStorageMetadata):
            whole = torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
            _read({name: GlobalTensor(tuple(whole.shape), [((0,) * whole.dim(), whole)])}, folder, metadata)
            out[name] = whole
    return out


@pytest.fixture(scope="module")
def saved(dist_pool, tmp_path_factory):
    """The uninterrupted EP=2 run (3 iterations, saved at 2); the tracker then names iteration 2."""
    ckpt = tmp_path_factory.mktemp("moe") / "ckpt"
    losses = dist_pool.run(pretrain, [*FLAGS, *EP2, *DISTOPT, "--train-iters", "3",
                                      "--save", str(ckpt), "--save-interval", "2"])[-1]
    atomic_write(str(ckpt / "latest_checkpointed_iteration.txt"), lambda f: f.write(b"2"))
    return ckpt, losses


def test_experts_are_saved_under_global_names(saved):
    ckpt, losses = saved
    assert sorted(losses) == [1, 2, 3]
    tensors = read_dcp_metadata(str(ckpt / "iter_0000002" / ".metadata")).state_dict_metadata
    experts = sorted(name for name in tensors if name.startswith("decoder.layers.1.mlp.experts."))
    assert experts == [f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc{i}.weight"
                       for e in range(4) for i in (1, 2)]
    assert list(tensors["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].size) == [16, 16]
    assert "optimizer.state.exp_avg.decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in tensors
    assert "decoder.layers.1.mlp.router.weight" in tensors and "decoder.layers.0.mlp.linear_fc1.weight" in tensors


@pytest.mark.parametrize("layout", [
    (*DISTOPT,),
    ("--expert-model-parallel-size", "4", "--moe-grouped-gemm", *DISTOPT),
    ("--tensor-model-parallel-size", "2", "--sequence-parallel", *EP2),  # (and a plain optimizer)
    ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1", *EP2),
    ("--pipeline-model-parallel-size", "2", *EP2, *DISTOPT),
], ids=["ep1", "ep4-grouped-gemm", "tp2-ep2-etp2", "tp2-ep2-etp1", "pp2-ep2"])
def test_loads_at_another_expert_layout_with_the_same_state_and_losses(dist_pool, saved, layout, tmp_path):
    ckpt, losses = saved
    again = tmp_path / "again"
    dist_pool.run(_load_and_save, [*FLAGS, *layout, "--train-iters", "3", "--load", str(ckpt)], str(again))
    before, after = _every_tensor(str(ckpt / "iter_0000002")), _every_tensor(str(again / "iter_0000002"))
    assert sorted(after) == sorted(before)
    differ = [name for name in before if not torch.equal(before[name], after[name])]
    assert differ == []
    resumed = dist_pool.run(pretrain, [*FLAGS, *layout, "--train-iters", "3", "--load", str(ckpt)])[-1]
    assert sorted(resumed) == [3] and resumed[3] == pytest.approx(losses[3], rel=1e-6)  # other reduction orders


def test_classic_format_resumes_at_its_ep_and_refuses_another(dist_pool, saved, tmp_path):
    _, losses = saved
    legacy = tmp_path / "legacy"
    dist_pool.run(pretrain, [*FLAGS, *EP2, *DISTOPT, "--train-iters", "3", "--exit-interval",
                             "2", "--ckpt-format", "torch", "--save", str(legacy), "--save-interval", "2"])
    folders = sorted(os.listdir(legacy / "iter_0000002"))
    assert folders == ["checksums.json", "mp_rank_00_000", "mp_rank_00_001"]
    for folder in folders[1:]:  # each expert rank's experts, and their distributed optimizer state
        assert sorted(os.listdir(legacy / "iter_0000002" / folder)) == ["distrib_optim.pt", "model_optim_rng.pt"]
    resumed = dist_pool.run(pretrain, [*FLAGS, *EP2, *DISTOPT, "--train-iters", "3",
                                       "--ckpt-format", "torch", "--load", str(legacy)])[-1]
    assert sorted(resumed) == [3] and resumed[3] == pytest.approx(losses[3], rel=1e-6)
    refused = dist_pool.run(pretrain_error, [*FLAGS, "--expert-model-parallel-size", "4", "--train-iters", "3",
                                             "--ckpt-format", "torch", "--load", str(legacy)])
    assert len(set(refused)) == 1 and "\n" not in refused[0]
    assert refused[0].startswith(f"checkpoint {legacy / 'iter_0000002'} "
                                 "was saved with --expert-model-parallel-size 2 but this run has "
                                 "--expert-model-parallel-size 4")
