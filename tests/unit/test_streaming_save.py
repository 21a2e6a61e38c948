"""megatron.convert.streaming_save: a torch.save file written one tensor at a time reads back as
torch.save's would (through the safe loader, mapped or not), and an abandoned one leaves nothing."""

import argparse
import os

import pytest
import torch

from megatron.training.checkpoint_safety import load_file
from megatron.convert.streaming_save import StreamingFile
from megatron.core.atomic_io import file_checksum


def _tensors():
    base = torch.randn(5, 6)
    return {"fp32": torch.randn(3, 4), "int64": torch.arange(10), "strided": base[:, :2], "view": base[1],
            "bf16": torch.randn(2, 3).to(torch.bfloat16), "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}


@pytest.mark.parametrize("mmap", [False, True])
def test_reads_back_as_torch_save_would(tmp_path, mmap):
    tensors = _tensors()
    path = str(tmp_path / "model_optim_rng.pt")
    f = StreamingFile(path)
    state = {"model": {name: f.add(t) for name, t in tensors.items()}, "args": argparse.Namespace(tp=2),
             "checkpoint_version": 3.0, "nested": [1, ("a", None)]}
    assert not os.path.exists(path)  # only complete files get the final name
    checksum = f.finish(state)
    assert checksum == file_checksum(path)
    assert os.listdir(tmp_path) == ["model_optim_rng.pt"]
    loaded = load_file(path, mmap=mmap)
    assert loaded["args"] == argparse.Namespace(tp=2) and loaded["nested"] == [1, ("a", None)]
    assert list(loaded["model"]) == list(tensors)
    for name, tensor in tensors.items():
        assert loaded["model"][name].dtype == tensor.dtype and torch.equal(loaded["model"][name], tensor), name
    # each record holds only the tensor's own bytes, as torch.save of a clone would
    reference = str(tmp_path / "reference.pt")
    torch.save({name: t.clone() for name, t in tensors.items()}, reference)
    assert abs(os.path.getsize(path) - os.path.getsize(reference)) < 4096


def test_an_unadded_tensor_is_refused_and_abandon_leaves_nothing(tmp_path):
    f = StreamingFile(str(tmp_path / "x.pt"))
    f.add(torch.ones(3))
    with pytest.raises(TypeError, match="not added"):
        f.finish({"model": {"w": torch.ones(2)}})
    f.abandon()
    assert os.listdir(tmp_path) == []
