"""LoRA checkpoints through pretrain_gpt (one process, mock data): a base run, a LoRA run started from
it (--load of a plain checkpoint, or --pretrained-checkpoint), its checkpoints holding the adapters
alone (exact tensor bytes) plus lora_base.json, and a resumed run that logs the uninterrupted run's
losses bit for bit; a moved base is refused."""

import json

import pytest
import torch

from megatron.training.checkpoint_safety import CheckpointError
from tests.helpers.training import MOCK, TINY

LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
# 2 layers x 4 (h + out) per adapted layer: qkv 32 + 96, proj 32 + 32, fc1 32 + 128, fc2 128 + 32
TRAINABLE = 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32))


def _train(argv):
    import pretrain_gpt
    from megatron.training.initialize import reset_megatron

    try:
        result = pretrain_gpt.main([*TINY, *MOCK, "--eval-iters", "0", *argv], record_history=True)
    finally:
        reset_megatron()
    return {record.iteration: record.losses["lm loss"] for record in result.history}


@pytest.fixture(scope="module", autouse=True)
def _destroy_distributed_after():
    yield
    from megatron.training.initialize import _destroy_distributed

    _destroy_distributed()


def _adapter_tensor_bytes(directory, fmt):
    """{name: bytes} of every tensor the iteration-2 checkpoint holds for the model and the optimizer."""
    iteration_dir = directory / "iter_0000002"
    if fmt == "torch":
        from megatron.training.checkpoint_safety import load_file

        saved = load_file(str(iteration_dir / "mp_rank_00" / "model_optim_rng.pt"))
        out = {name: t.numel() * t.element_size() for name, t in saved["model"].items()}
        for index, state in saved["optimizer"]["state"].items():
            for key, value in state.items():
                if value.dim() > 0:
                    out[f"optimizer.{index}.{key}"] = value.numel() * value.element_size()
        return out
    from megatron.dist_checkpointing.dcp_io import read_dcp_metadata

    metadata = read_dcp_metadata(str(iteration_dir / ".metadata"))
    return {name: meta.size.numel() * meta.properties.dtype.itemsize
            for name, meta in metadata.state_dict_metadata.items() if hasattr(meta, "size")}


def _check_merge(base, lora, merged_dir):
    """convert.py --loader lora --saver megatron: the merged checkpoint's logits are the base's with the
    adapters attached (not merged)."""
    from megatron.convert import verify
    from megatron.convert.megatron_format import open_source, read_tensors
    from megatron.core.tensor_parallel.lora import LoRAConfig
    from megatron.model.lora import apply_lora
    from tools.checkpoint import convert
    from tools.checkpoint.lora_common import read_adapters

    convert.main(["--model-type", "GPT", "--loader", "lora", "--saver", "megatron", "--load-dir", str(lora),
                  "--save-dir", str(merged_dir)])
    source = open_source(str(base))
    model = verify.build_serial_model(source.args, read_tensors(source))
    adapters = read_adapters(str(lora))
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0), seed=0)
    model.load_state_dict(adapters.tensors, strict=False)
    tokens = verify.sample_tokens(255, 32)
    merged = open_source(str(merged_dir))
    expected = verify.logits_of(model, tokens)
    actual = verify.serial_logits(merged.args, read_tensors(merged), tokens)
    assert ((actual - expected).abs().max() / expected.abs().max()).item() <= 1e-5
    assert not torch.equal(actual, verify.serial_logits(source.args, read_tensors(source), tokens))  # it merged


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_adapter_checkpoints_resume_bit_for_bit(tmp_path, fmt):
    common = ["--ckpt-format", fmt, "--train-iters", "4", "--save-interval", "2"]
    base, lora = tmp_path / "base", tmp_path / "lora"
    _train(["--ckpt-format", fmt, "--train-iters", "2", "--save", str(base), "--save-interval", "2"])
    # torch: --load of a plain checkpoint starts LoRA fine-tuning; torch_dist: --pretrained-checkpoint
    start = ["--load", str(base)] if fmt == "torch" else ["--pretrained-checkpoint", str(base), "--load", str(lora)]
    full = _train([*common, *LORA, *start, "--save", str(lora)])
    assert sorted(full) == [1, 2, 3, 4]
    pointer = json.loads((lora / "lora_base.json").read_text())
    assert pointer["base"] == {"load": str(base), "iteration": 2}
    assert pointer["lora"]["rank"] == 4 and pointer["lora"]["alpha"] == 8.0

    tensors = _adapter_tensor_bytes(lora, fmt)
    model = {name: size for name, size in tensors.items() if not name.startswith("optimizer")}
    assert all(".adapter.linear_" in name for name in model) and len(model) == 16
    assert sum(model.values()) == 4 * TRAINABLE  # fp32 adapters, nothing of the base
    assert sum(tensors.values()) - sum(model.values()) == 8 * TRAINABLE  # Adam's two moments of the adapters

    _check_merge(base, lora, tmp_path / "merged")

    (lora / "latest_checkpointed_iteration.txt").write_text("2")  # resume from the iteration-2 checkpoint
    resumed = _train([*common, *LORA, "--load", str(lora), "--save", str(lora)])
    assert sorted(resumed) == [3, 4]
    assert resumed[3] == full[3] and resumed[4] == full[4]  # bit for bit


def test_a_base_checkpoint_that_moved_on_is_refused(tmp_path):
    base, lora = tmp_path / "base", tmp_path / "lora"
    _train(["--ckpt-format", "torch", "--train-iters", "2", "--save", str(base), "--save-interval", "1"])
    (base / "latest_checkpointed_iteration.txt").write_text("2")
    _train(["--ckpt-format", "torch", "--train-iters", "1", *LORA, "--load", str(base), "--save", str(lora),
            "--save-interval", "1"])
    (base / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(CheckpointError, match="tracker names iteration 1, but the adapters were trained on "
                                              "iteration 2"):
        _train(["--ckpt-format", "torch", "--train-iters", "2", *LORA, "--load", str(lora)])
    with pytest.raises(CheckpointError, match="trained with LoRA"):
        _train(["--ckpt-format", "torch", "--train-iters", "2", "--lora-rank", "2", "--load", str(lora)])


def test_saving_adapters_without_a_base_is_refused_before_training(tmp_path):
    with pytest.raises(CheckpointError, match="needs a base model to point to"):
        _train(["--ckpt-format", "torch", "--train-iters", "1", *LORA, "--save", str(tmp_path / "lora"),
                "--save-interval", "1"])
    assert not (tmp_path / "lora" / "latest_checkpointed_iteration.txt").exists()
