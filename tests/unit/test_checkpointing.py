"""Legacy (`--ckpt-format torch`) checkpoints: layout, round trip, crash safety, load rules.

The model, optimizer and scheduler here are tiny stand-ins with Megatron's state-dict key names
and the methods checkpointing uses, so these tests do not depend on megatron.model or
megatron.core.optimizer.
"""

import argparse
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import megatron.training.checkpointing as checkpointing
from megatron.training.checkpointing import (
    CheckpointError,
    checkpoint_exists,
    find_checkpoint_rank_0,
    generate_state_dict,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    get_rng_state,
    load_args_from_checkpoint,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)
from megatron.training.checkpoint_safety import load_file
from megatron.core import device, tensor_parallel
from tests.helpers.checkpoints import TinyGPT, TinyScheduler, assert_same_weights, build, make_args, model_file

TRACKER = "latest_checkpointed_iteration.txt"


class Wrapper(nn.Module):
    """A DDP-like wrapper: its own state_dict would prefix every key with 'module.'."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


def draws():
    """The next numbers of every generator that checkpoints restore."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


def test_layout_file_names_and_tracker(ckpt, capsys):
    args = make_args(ckpt)
    model, optimizer, scheduler = build(args, seed=0)
    assert not checkpoint_exists(str(ckpt))
    save_checkpoint(10, [model], optimizer, scheduler, args=args)
    assert sorted(os.listdir(ckpt)) == ["iter_0000010", TRACKER]
    assert sorted(os.listdir(ckpt / "iter_0000010")) == ["checksums.json", "mp_rank_00"]
    assert os.listdir(ckpt / "iter_0000010" / "mp_rank_00") == ["model_optim_rng.pt"]
    assert (ckpt / TRACKER).read_bytes() == b"10"  # no newline
    assert checkpoint_exists(str(ckpt)) and not checkpoint_exists(None)
    out = capsys.readouterr().out
    assert f"saving checkpoint at iteration      10 to {ckpt}" in out
    assert f"  successfully saved checkpoint from iteration      10 to {ckpt}" in out


def test_checkpoint_names():
    assert get_checkpoint_name("/c", 10) == "/c/iter_0000010/mp_rank_00/model_optim_rng.pt"
    assert get_checkpoint_name("/c", 5, release=True) == "/c/release/mp_rank_00/model_optim_rng.pt"
    assert get_checkpoint_name("/c", 10, return_base_dir=True) == "/c/iter_0000010"
    assert (get_checkpoint_name("/c", 2000, pipeline_parallel=True, tensor_rank=1, pipeline_rank=3)
            == "/c/iter_0002000/mp_rank_01_003/model_optim_rng.pt")
    assert (get_checkpoint_name("/c", 7, pipeline_parallel=True, expert_parallel=True,
                                tensor_rank=0, pipeline_rank=0, expert_rank=2)
            == "/c/iter_0000007/mp_rank_00_000_002/model_optim_rng.pt")
    assert get_checkpoint_tracker_filename("/c") == "/c/" + TRACKER


def test_find_checkpoint_rank_0_tries_the_pipeline_layout(tmp_path):
    name = get_checkpoint_name(str(tmp_path), 3, pipeline_parallel=True, tensor_rank=0,
                               pipeline_rank=0)
    assert find_checkpoint_rank_0(str(tmp_path), 3) is None
    os.makedirs(os.path.dirname(name))
    Path(name).write_bytes(b"x")
    assert find_checkpoint_rank_0(str(tmp_path), 3) == name


def test_top_level_keys_version_and_unwrapped_model(ckpt):
    args = make_args(ckpt, consumed_train_samples=640)
    model, optimizer, scheduler = build(args, seed=0)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    tracker_states = tensor_parallel.get_cuda_rng_tracker().get_states()
    save_checkpoint(10, [Wrapper(Wrapper(model))], optimizer, scheduler,
                    num_floating_point_operations_so_far=1.5e9, args=args)
    # the next draw of the dropout stream is restored on load
    with tensor_parallel.get_cuda_rng_tracker().fork():
        expected_draw = torch.rand(3)
    tensor_parallel.model_parallel_cuda_manual_seed(8)
    load_checkpoint([model], None, None, args=make_args(ckpt, no_load_optim=True))
    with tensor_parallel.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), expected_draw)
    state = load_file(str(model_file(ckpt, 10)))
    assert set(state) == {"args", "checkpoint_version", "iteration", "model", "optimizer",
                          "opt_param_scheduler", "rng_state",
                          "num_floating_point_operations_so_far"}
    assert state["checkpoint_version"] == 3.0 and isinstance(state["checkpoint_version"], float)
    assert state["iteration"] == 10
    assert state["num_floating_point_operations_so_far"] == 1.5e9
    assert isinstance(state["args"], argparse.Namespace)
    assert state["args"].consumed_train_samples == 640
    assert list(state["model"]) == list(model.state_dict())  # no 'module.' prefixes
    assert "embedding.word_embeddings.weight" in state["model"]
    assert state["opt_param_scheduler"] == {"max_lr": 1e-2, "num_steps": 4}
    assert len(state["rng_state"]) == 1
    on_cpu = device.get_rng_state() is None
    assert set(state["rng_state"][0]) == {"random_rng_state", "np_rng_state", "torch_rng_state",
                                          "cuda_rng_state", "rng_tracker_states"} | (
                                              {"cpu_rng_tracker_states"} if on_cpu else set())
    # our exact states: the CPU generator's on CPU (beside the CUDA-shaped ones Megatron reads)
    saved_tracker = state["rng_state"][0]["cpu_rng_tracker_states" if on_cpu else "rng_tracker_states"]
    assert set(saved_tracker) == {"model-parallel-rng"} == set(tracker_states)
    assert torch.equal(saved_tracker["model-parallel-rng"], tracker_states["model-parallel-rng"])
    assert isinstance(state["args"], argparse.Namespace)  # read back by the allow-list unpickler


def test_model_chunks_are_saved_as_model0_model1(ckpt):
    args = make_args(ckpt)
    first, optimizer, scheduler = build(args, seed=0)
    second, _, _ = build(args, seed=1)
    save_checkpoint(4, [first, Wrapper(second)], optimizer, scheduler, args=args)
    state = load_file(str(model_file(ckpt, 4)))
    assert "model" not in state and {"model0", "model1"} <= set(state)
    fresh = [build(args, seed=5)[0], build(args, seed=6)[0]]
    load_checkpoint([fresh[0], Wrapper(fresh[1])], None, None, args=make_args(ckpt, no_load_rng=True))
    assert_same_weights(fresh[0], first)
    assert_same_weights(fresh[1], second)


def test_round_trip_restores_everything(ckpt, capsys):
    args = make_args(ckpt, consumed_train_samples=640, consumed_valid_samples=96,
                     skipped_train_samples=3)
    model, optimizer, scheduler = build(args, seed=0, train_steps=2)
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    save_checkpoint(10, [model], optimizer, scheduler,
                    num_floating_point_operations_so_far=123.0, args=args)
    expected = draws()

    new_args = make_args(ckpt)
    new_model, new_optimizer, new_scheduler = build(new_args, seed=1, train_steps=0)
    torch.manual_seed(99)  # move every generator away from the saved state
    random.seed(98)
    np.random.seed(97)
    iteration, flops = load_checkpoint([new_model], new_optimizer, new_scheduler, args=new_args)
    assert (iteration, flops) == (10, 123.0)
    assert draws() == expected
    assert_same_weights(new_model, model)
    saved_opt, loaded_opt = optimizer.state_dict(), new_optimizer.state_dict()
    assert saved_opt["param_groups"] == loaded_opt["param_groups"]
    for index, state in saved_opt["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(loaded_opt["state"][index][key], value, rtol=0, atol=0)
    assert new_scheduler.state_dict() == {"max_lr": 1e-2, "num_steps": 8}
    assert (new_args.consumed_train_samples, new_args.consumed_valid_samples,
            new_args.skipped_train_samples) == (640, 96, 3)
    out = capsys.readouterr().out
    assert f" loading checkpoint from {ckpt} at iteration 10" in out
    assert f"  successfully loaded checkpoint from {ckpt} [ t 1/1, p 1/1 ] at iteration 10" in out


def _partial_save(obj, f, *args, **kwargs):
    """Stands in for torch.save on a full disk: some bytes land, then it fails."""
    data = b"PK\x03\x04 partial zip"
    if hasattr(f, "write"):
        f.write(data)
    else:
        Path(f).write_bytes(data)
    raise OSError(28, "No space left on device")


def test_crash_during_save_keeps_previous_checkpoint(ckpt, monkeypatch):
    args = make_args(ckpt)
    model, optimizer, scheduler = build(args, seed=0)
    save_checkpoint(10, [model], optimizer, scheduler, args=args)
    later, later_optimizer, later_scheduler = build(args, seed=3)

    monkeypatch.setattr(checkpointing.torch, "save", _partial_save)
    with pytest.raises(CheckpointError, match="ENOSPC \\(No space left on device\\)"):
        save_checkpoint(20, [later], later_optimizer, later_scheduler, args=args)
    monkeypatch.undo()

    assert (ckpt / TRACKER).read_bytes() == b"10"
    assert not model_file(ckpt, 20).exists()
    rank_dir = ckpt / "iter_0000020" / "mp_rank_00"
    assert not rank_dir.exists() or os.listdir(rank_dir) == []  # the temp file is gone too
    fresh, fresh_optimizer, fresh_scheduler = build(args, seed=7, train_steps=0)
    iteration, _ = load_checkpoint([fresh], fresh_optimizer, fresh_scheduler, args=make_args(ckpt))
    assert iteration == 10
    assert_same_weights(fresh, model)


def test_crash_between_model_file_and_tracker(ckpt, monkeypatch):
    args = make_args(ckpt)
    model, optimizer, scheduler = build(args, seed=0)
    save_checkpoint(10, [model], optimizer, scheduler, args=args)
    real_replace = os.replace

    def replace_failing_on_tracker(src, dst):
        if str(dst).endswith(TRACKER):
            raise OSError("killed before the tracker was renamed")
        real_replace(src, dst)

    monkeypatch.setattr(checkpointing.os, "replace", replace_failing_on_tracker)
    with pytest.raises(CheckpointError, match="killed"):
        save_checkpoint(20, [model], optimizer, scheduler, args=args)
    monkeypatch.undo()

    assert (ckpt / TRACKER).read_bytes() == b"10"
    assert sorted(os.listdir(ckpt)) == ["iter_0000010", "iter_0000020", TRACKER]  # no temp
    complete = load_file(str(model_file(ckpt, 20)))
    assert complete["iteration"] == 20
    iteration, _ = load_checkpoint([build(args, seed=2)[0]], None, None, args=make_args(ckpt))
    assert iteration == 10


def _write_release(ckpt: Path, args, model, optimizer, scheduler) -> None:
    state = generate_state_dict(args, [model], optimizer, scheduler, None, iteration=0)
    name = get_checkpoint_name(str(ckpt), 0, release=True)
    os.makedirs(os.path.dirname(name))
    torch.save(state, name)
    (ckpt / TRACKER).write_text("release")


def test_release_checkpoint_loads_weights_only(ckpt):
    args = make_args(ckpt, consumed_train_samples=64)
    model, optimizer, scheduler = build(args, seed=0)
    _write_release(ckpt, args, model, optimizer, scheduler)  # no rng_state at all
    assert read_metadata(str(ckpt / TRACKER)) == (0, True)

    new_model, new_optimizer, new_scheduler = build(args, seed=1, train_steps=0)
    iteration, _ = load_checkpoint([new_model], new_optimizer, new_scheduler, args=make_args(ckpt))
    assert iteration == 0
    assert_same_weights(new_model, model)
    assert new_optimizer.state_dict()["state"] == {}
    assert new_scheduler.num_steps == 0


def test_finetune_resets_iteration_and_skips_optimizer_and_rng(ckpt):
    args = make_args(ckpt, consumed_train_samples=640)
    model, optimizer, scheduler = build(args, seed=0)
    save_checkpoint(10, [model], optimizer, scheduler, args=args)

    new_args = make_args(ckpt, finetune=True)
    new_model, new_optimizer, new_scheduler = build(new_args, seed=1, train_steps=0)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    iteration, _ = load_checkpoint([new_model], new_optimizer, new_scheduler, args=new_args)
    assert iteration == 0
    assert_same_weights(new_model, model)
    assert new_optimizer.state_dict()["state"] == {}
    assert new_scheduler.num_steps == 0
    assert new_args.consumed_train_samples == 0
    torch.testing.assert_close(torch.rand(3), expected)  # the RNG was left alone


@pytest.mark.parametrize("field, value, words", [
    ("hidden_size", 32, ["--hidden-size 16", "--hidden-size 32"]),
    ("num_layers", 2, ["--num-layers 1", "--num-layers 2"]),
    ("untie_embeddings_and_output_weights", True,
     ["no --untie-embeddings-and-output-weights", "this run has "
      "--untie-embeddings-and-output-weights"]),
    ("add_bias_linear", False, ["saved with no --disable-bias-linear",
                                "this run has --disable-bias-linear"]),
])
def test_shape_mismatch_names_the_flag(ckpt, field, value, words):
    args = make_args(ckpt)
    model, optimizer, scheduler = build(args, seed=0)
    save_checkpoint(10, [model], optimizer, scheduler, args=args)
    other_args = make_args(ckpt, **{field: value})
    other = TinyGPT(other_args)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint([other], None, None, args=other_args)
    message = str(info.value)
    assert str(ckpt) in message and "--use-checkpoint-args" in message
    for word in words:
        assert word in message


def test_tensor_shape_mismatch_names_the_tensor(ckpt):
    args = make_args(ckpt)
    model, optimizer, scheduler = build(args, seed=0)
    save_checkpoint(10, [model], optimizer, scheduler, args=args)
    bigger = TinyGPT(make_args(ckpt, padded_vocab_size=64))  # args still say 32
    with pytest.raises(CheckpointError, match=r"embedding\.word_embeddings\.weight is \[32, 16\]"):
        load_checkpoint([bigger], None, None, args=make_args(ckpt))


@pytest.mark.parametrize("content, words", [
    ("ten\n", ["invalid checkpoint tracker", "'ten'"]),
    ("-5", ["iteration -5 must be >= 0"]),
])
def test_bad_tracker_is_a_clear_error(ckpt, content, words):
    ckpt.mkdir()
    (ckpt / TRACKER).write_text(content)
    args = make_args(ckpt)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint([TinyGPT(args)], None, None, args=args)
    assert str(ckpt / TRACKER) in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_tracker_naming_a_missing_file(ckpt):
    ckpt.mkdir()
    (ckpt / TRACKER).write_text("30")
    args = make_args(ckpt)
    with pytest.raises(CheckpointError, match="iter_0000030/mp_rank_00/model_optim_rng.pt does "
                                              "not exist"):
        load_checkpoint([TinyGPT(args)], None, None, args=args)


def test_truncated_checkpoint_file_is_a_clear_error(ckpt):
    args = make_args(ckpt)
    model, optimizer, scheduler = build(args, seed=0)
    save_checkpoint(10, [model], optimizer, scheduler, args=args)
    path = model_file(ckpt, 10)
    path.write_bytes(path.read_bytes()[:200])
    (ckpt / "iter_0000010" / "checksums.json").unlink()  # as in a Megatron checkpoint: unverified
    with pytest.raises(CheckpointError, match="cannot read checkpoint file"):
        load_checkpoint([TinyGPT(args)], None, None, args=args)


def test_missing_checkpoint_warns_and_starts_from_scratch(ckpt, capsys):
    args = make_args(ckpt)
    model = TinyGPT(args)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert load_checkpoint([model], None, None, args=args) == (0, 0)
    out = capsys.readouterr().out
    assert f"WARNING: could not find the metadata file {ckpt / TRACKER}" in out
    assert "will not load any checkpoints and will start from random" in out
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])
    with pytest.raises(CheckpointError, match="--exit-on-missing-checkpoint"):
        load_checkpoint([model], None, None, args=make_args(ckpt, exit_on_missing_checkpoint=True))


def test_no_save_optim_and_no_save_rng(ckpt):
    args = make_args(ckpt, no_save_optim=True, no_save_rng=True)
    model, optimizer, scheduler = build(args, seed=0)
    save_checkpoint(10, [model], optimizer, scheduler, args=args)
    state = load_file(str(model_file(ckpt, 10)))
    assert not {"optimizer", "opt_param_scheduler", "rng_state"} & set(state)
    assert "model" in state

    def load(**flags):
        new_args = make_args(ckpt, **flags)
        new_model, new_optimizer, new_scheduler = build(new_args, seed=1, train_steps=0)
        return load_checkpoint([new_model], new_optimizer, new_scheduler, args=new_args)

    with pytest.raises(CheckpointError, match="no optimizer state.*--no-load-optim"):
        load()
    with pytest.raises(CheckpointError, match="no RNG state.*--no-load-rng"):
        load(no_load_optim=True)
    assert load(no_load_optim=True, no_load_rng=True)[0] == 10


def test_load_args_from_checkpoint_takes_the_shape(ckpt, capsys):
    args = make_args(ckpt, vocab_file="/saved/vocab.json", untie_embeddings_and_output_weights=True)
    model, optimizer, scheduler = build(args, seed=0)
    save_checkpoint(10, [model], optimizer, scheduler, args=args)

    new_args = make_args(ckpt, hidden_size=32, num_layers=2, ffn_hidden_size=None,
                         kv_channels=None, use_checkpoint_args=True)
    assert load_args_from_checkpoint(new_args) is new_args
    assert (new_args.hidden_size, new_args.num_layers, new_args.ffn_hidden_size,
            new_args.kv_channels) == (16, 1, 32, 8)
    assert new_args.untie_embeddings_and_output_weights is True
    assert new_args.vocab_file == "/saved/vocab.json"  # this run gave none
    assert "overriding hidden_size = 32 with 16" in capsys.readouterr().out
    new_model = TinyGPT(new_args)
    assert load_checkpoint([new_model], None, None, args=new_args)[0] == 10
    assert_same_weights(new_model, model)

    mine = make_args(ckpt, vocab_file="/here/vocab.json")
    assert load_args_from_checkpoint(mine).vocab_file == "/here/vocab.json"


def test_load_args_without_checkpoint_keeps_args(ckpt):
    args = make_args(ckpt, hidden_size=48)
    assert load_args_from_checkpoint(args).hidden_size == 48
    with pytest.raises(CheckpointError, match="no checkpoint was found"):
        load_args_from_checkpoint(make_args(ckpt, exit_on_missing_checkpoint=True))


def test_old_key_names_load(ckpt):
    args = make_args(ckpt, consumed_train_samples=28)
    model, _, _ = build(args, seed=0)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    rng = get_rng_state()[0]
    state = {"args": args, "checkpoint_version": 3.0, "total_iters": 7,
             "model": model.state_dict(), "lr_scheduler": {"max_lr": 0.5, "num_steps": 28},
             "random_rng_state": rng["random_rng_state"], "np_rng_state": rng["np_rng_state"],
             "torch_rng_state": rng["torch_rng_state"], "cuda_rng_state": rng["cuda_rng_state"]}
    expected = draws()
    os.makedirs(model_file(ckpt, 7).parent)
    torch.save(state, model_file(ckpt, 7))
    (ckpt / TRACKER).write_text("7")

    new_args = make_args(ckpt)
    new_model = TinyGPT(new_args)
    scheduler = TinyScheduler()
    torch.manual_seed(50)
    iteration, flops = load_checkpoint([new_model], None, scheduler, args=new_args)
    assert (iteration, flops) == (7, 0)
    assert scheduler.state_dict() == {"max_lr": 0.5, "num_steps": 28}
    assert draws() == expected
    assert new_args.consumed_train_samples == 28
    assert_same_weights(new_model, model)


def test_pre_v2_qkv_layout_is_refused(ckpt):
    args = make_args(ckpt)
    model, optimizer, scheduler = build(args, seed=0)
    state = generate_state_dict(args, [model], optimizer, scheduler, get_rng_state(), 5)
    state["checkpoint_version"] = 1.0
    os.makedirs(model_file(ckpt, 5).parent)
    torch.save(state, model_file(ckpt, 5))
    (ckpt / TRACKER).write_text("5")
    with pytest.raises(CheckpointError, match="checkpoint_version 1.0"):
        load_checkpoint([TinyGPT(args)], None, None, args=args)


def test_save_needs_a_directory_and_a_positive_iteration(ckpt):
    model, optimizer, scheduler = build(make_args(ckpt), seed=0)
    with pytest.raises(CheckpointError, match="--save"):
        save_checkpoint(10, [model], optimizer, scheduler, args=make_args(ckpt, save=None))
    with pytest.raises(CheckpointError, match="iteration 0"):
        save_checkpoint(0, [model], optimizer, scheduler, args=make_args(ckpt))
    assert not ckpt.exists()
