"""torch_dist's names and boxes of MoE experts, on hand-built modules (no process group): local
expert i of expert-parallel rank r is saved as global expert r * E/EP + i, its expert tensor-parallel
slice as a TP-like box; and the classic format's EP checks (checkpoint_fit)."""

import argparse

import pytest
import torch
from torch import nn

from megatron.training.checkpoint_fit import check_checkpoint_args, check_parallel_layout
from megatron.training.checkpoint_safety import CheckpointError
from tests.helpers.args import run_args
from megatron.dist_checkpointing import layout
from megatron.dist_checkpointing.layout import global_expert_names, model_layouts
from megatron.dist_checkpointing.save import saved_sizes


def test_local_experts_are_renumbered_per_layer():
    keys = ["decoder.layers.3.mlp.router.weight",
            "decoder.layers.3.mlp.experts.local_experts.0.linear_fc1.weight",
            "decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight",
            "decoder.layers.5.mlp.experts.local_experts.0.linear_fc1.weight",
            "decoder.layers.3.mlp.shared_experts.linear_fc1.weight"]
    assert global_expert_names(keys, ep_rank=2) == {
        keys[1]: "decoder.layers.3.mlp.experts.local_experts.4.linear_fc1.weight",  # 2 local experts: 2 * 2 + 0
        keys[2]: "decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight",
        keys[3]: "decoder.layers.5.mlp.experts.local_experts.2.linear_fc1.weight",  # 1 local expert there
    }
    assert global_expert_names(keys, ep_rank=0)[keys[2]] == keys[2]


def _expert_linear(weight, partition_dim, stride):
    param = nn.Parameter(weight)
    param.allreduce, param.expert_parallel = False, True
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, partition_dim, stride
    return param


class _Expert(nn.Module):
    def __init__(self, fc1, fc2):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = nn.Module(), nn.Module()
        self.linear_fc1.weight = _expert_linear(fc1, 0, 2)  # gated: [gate ; up] of this ETP rank
        self.linear_fc2.weight = _expert_linear(fc2, 1, 1)


class _Layer(nn.Module):
    """decoder.layers.{n}: a router [E, h] and 2 local experts of ffn 4 / etp, h 3."""

    def __init__(self, layer_number, etp):
        super().__init__()
        self.layer_number = layer_number
        self.mlp = nn.Module()
        self.mlp.router = nn.Linear(3, 8, bias=False)
        self.mlp.experts = nn.Module()
        self.mlp.experts.local_experts = nn.ModuleList(
            [_Expert(torch.randn(8 // etp, 3), torch.randn(3, 4 // etp)) for _ in range(2)])


class _Model(nn.Module):
    def __init__(self, first_layer, etp):
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([_Layer(first_layer, etp)])


def test_experts_get_global_names_and_etp_boxes(monkeypatch):
    # EP rank 1 of 2 (experts 2, 3 of 4), ETP rank 1 of 2, holding global layer 4 (a later stage)
    monkeypatch.setattr(layout, "_expert_ranks", lambda: (1, 2, 1, 2))
    model = _Model(first_layer=5, etp=2)
    by_name = {entry.name: (entry, tensor) for entry, tensor in model_layouts(model)}
    assert sorted(by_name) == ["decoder.layers.4.mlp.experts.local_experts.2.linear_fc1.weight",
                               "decoder.layers.4.mlp.experts.local_experts.2.linear_fc2.weight",
                               "decoder.layers.4.mlp.experts.local_experts.3.linear_fc1.weight",
                               "decoder.layers.4.mlp.experts.local_experts.3.linear_fc2.weight",
                               "decoder.layers.4.mlp.router.weight"]
    fc1, fc1_local = by_name["decoder.layers.4.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.global_shape == (8, 3)  # [2 ffn, h], the ETP = 1 shape
    # ETP rank 1's gate rows [2, 4) and up rows [6, 8) of the global [gate 0..3 ; up 4..7]
    assert [(offsets, tuple(view.shape)) for offsets, view in fc1.boxes(fc1_local)] == [((2, 0), (2, 3)),
                                                                                         ((6, 0), (2, 3))]
    fc2, fc2_local = by_name["decoder.layers.4.mlp.experts.local_experts.2.linear_fc2.weight"]
    assert fc2.global_shape == (3, 4) and [o for o, _ in fc2.boxes(fc2_local)] == [(0, 2)]
    router, _ = by_name["decoder.layers.4.mlp.router.weight"]
    assert router.global_shape == (8, 3) and router.runs == [(0, 0, 8)]  # replicated


def test_an_expert_is_whole_at_etp_1_whatever_the_tp(monkeypatch):
    monkeypatch.setattr(layout, "_expert_ranks", lambda: (0, 4, 0, 1))
    model = _Model(first_layer=1, etp=1)
    entries = {entry.name: entry for entry, _ in model_layouts(model)}
    fc1 = entries["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert fc1.global_shape == fc1.local_shape == (8, 3) and fc1.runs == [(0, 0, 8)]


def test_checkpoints_before_expert_parallelism_read_as_ep_1():
    assert saved_sizes({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                        "data_parallel_size": 4}) == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "data_parallel_size": 4,
        "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 2}


def _args(**kw):
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                num_experts=4, expert_model_parallel_size=2, expert_tensor_parallel_size=None, moe_ffn_hidden_size=8,
                ffn_hidden_size=32, moe_layer_freq=1)
    return argparse.Namespace(**{**base, **kw})


def _run(**kw):
    """This run's (validated) args: the parser's defaults under _args' values."""
    return run_args(**vars(_args(**kw)))


def test_a_classic_checkpoint_refuses_another_ep_or_etp_in_one_line():
    name = "/ckpt/iter_0000002/mp_rank_00_001/model_optim_rng.pt"
    check_parallel_layout(_args(), _args(), name)
    check_parallel_layout(_args(tensor_model_parallel_size=2), _args(tensor_model_parallel_size=2,
                                                                     expert_tensor_parallel_size=2), name)
    with pytest.raises(CheckpointError) as refused:
        check_parallel_layout(_args(), _args(expert_model_parallel_size=4), name)
    message = str(refused.value)
    assert message.startswith("checkpoint /ckpt/iter_0000002 was saved with --expert-model-parallel-size 2 but "
                              "this run has --expert-model-parallel-size 4; ")
    assert "--ckpt-format torch_dist" in message and "\n" not in message
    with pytest.raises(CheckpointError, match="--expert-tensor-parallel-size 1 but this run has "
                                              "--expert-tensor-parallel-size 2"):
        check_parallel_layout(_args(tensor_model_parallel_size=2, expert_tensor_parallel_size=1),
                              _args(tensor_model_parallel_size=2), name)
    check_parallel_layout(_args(num_experts=None), _args(num_experts=None, expert_model_parallel_size=1), name)


def test_the_moe_shape_is_compared():
    check_checkpoint_args(_args(moe_ffn_hidden_size=None, ffn_hidden_size=8), _run(ffn_hidden_size=8), "ckpt")
    with pytest.raises(CheckpointError, match="--num-experts 4 but this run has --num-experts 8"):
        check_checkpoint_args(_args(), _run(num_experts=8), "ckpt")
    check_checkpoint_args(_args(num_experts=None, moe_layer_freq=1), _run(num_experts=None, moe_layer_freq=2), "ckpt")


def test_the_classic_format_refuses_experts_split_over_another_etp(monkeypatch, tmp_path):
    from megatron.training import checkpointing
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_expert_tensor_parallel_world_size", lambda: 2)
    args = argparse.Namespace(save=str(tmp_path), ckpt_format="torch", num_experts=4)
    with pytest.raises(CheckpointError) as refused:
        checkpointing.save_checkpoint(1, [nn.Linear(2, 2)], None, None, args=args)
    assert str(refused.value) == ("--ckpt-format torch keeps one file per tensor/pipeline/expert rank and cannot hold "
                                  "experts split over --expert-tensor-parallel-size 2 while "
                                  "--tensor-model-parallel-size is 1: save with --ckpt-format torch_dist")
    assert list(tmp_path.iterdir()) == []  # refused before anything is written
