"""Reading a checkpoint runs no code from it: the allow-list unpickler (megatron/training/checkpoint_safety.py).

A checkpoint whose pickle calls os.system is refused on every path that reads one (--load,
--finetune --no-load-optim --no-load-rng, --use-checkpoint-args), naming the file and the global,
and the command never runs; what real checkpoints hold (argparse.Namespace, numpy RNG state
pickled by numpy 1.x or 2.x, torch dtypes, megatron-core's enums) still loads.
"""

import argparse
import fractions
import os
import pickle
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron.training.checkpoint_safety import CheckpointError, ForeignObject, load_file

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--lr", "1e-3", "--train-iters", "1", "--num-workers", "0", "--eval-iters", "0",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "63"]


class RunsCommand:
    """Unpickling this object runs a shell command (what an attacker's checkpoint would do)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def write_checkpoint(directory: Path, state, iteration: int = 10) -> Path:
    path = directory / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    (directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return path


@pytest.fixture
def malicious(tmp_path):
    """(checkpoint dir, its file, the marker the payload would create)."""
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    args = argparse.Namespace(num_layers=1, hidden_size=16, payload=RunsCommand(f"touch {marker}"))
    path = write_checkpoint(ckpt, {"args": args, "checkpoint_version": 3.0, "iteration": 10,
                                   "model": {}, "hook": RunsCommand(f"touch {marker}")})
    return ckpt, path, marker


@pytest.mark.parametrize("flags", [
    [],
    ["--finetune", "--no-load-optim", "--no-load-rng"],
    ["--use-checkpoint-args"],
], ids=["load", "finetune", "use-checkpoint-args"])
def test_malicious_checkpoint_is_refused_before_anything_runs(malicious, flags):
    ckpt, path, marker = malicious
    with pytest.raises(CheckpointError) as info:
        pretrain_gpt.main([*TINY, "--ckpt-format", "torch", "--load", str(ckpt), *flags])
    assert not marker.exists()
    message = str(info.value)
    assert message.startswith(f"checkpoint file {path} refers to posix.system, which is not on the list")
    assert "--trust-checkpoint-pickles" in message
    # plain unpickling does run the payload: the file really is malicious
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("payload, name", [
    ((eval, ("1",)), "builtins.eval"),
    ((shutil.disk_usage, ("/",)), "shutil.disk_usage"),
    ((fractions.Fraction, (1, 3)), "fractions.Fraction"),
])
def test_any_global_outside_the_list_is_named(tmp_path, payload, name):
    class Payload:
        def __reduce__(self):
            return payload

    path = tmp_path / "x.pt"
    torch.save({"args": argparse.Namespace(value=Payload())}, path)
    with pytest.raises(CheckpointError, match=f"checkpoint file {path} refers to {name}, "):
        load_file(str(path))


def test_trust_checkpoint_pickles_reads_fully_and_says_so(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    state = {"args": argparse.Namespace(ratio=fractions.Fraction(1, 3)), "iteration": 10}
    path = write_checkpoint(ckpt, state)
    with pytest.raises(CheckpointError, match="refers to fractions.Fraction"):
        load_file(str(path))
    logged = []
    loaded = load_file(str(path), trust_pickles=True, log=logged.append)
    assert loaded["args"].ratio == fractions.Fraction(1, 3)
    assert logged == [f"WARNING: --trust-checkpoint-pickles: reading {path} with full unpickling "
                      "(a malicious file can run code)"]
    # the flag reaches the loader from the command line
    with pytest.raises(Exception) as info:  # the file has no model: refused later, not on unpickling
        pretrain_gpt.main([*TINY, "--ckpt-format", "torch", "--load", str(ckpt), "--finetune",
                           "--trust-checkpoint-pickles"])
    assert "fractions" not in str(info.value)
    assert f"WARNING: --trust-checkpoint-pickles: reading {path}" in capsys.readouterr().out


class _Numpy1Pickler(pickle._Pickler):
    """Writes numpy's reconstructors under numpy 1.x's module name (numpy.core.multiarray), as a
    file saved with numpy 1.x holds them."""

    def save_global(self, obj, name=None):
        module = getattr(obj, "__module__", "")
        if module == "numpy._core.multiarray" or module == "numpy.core.multiarray":
            self.write(pickle.GLOBAL + f"numpy.core.multiarray\n{obj.__name__}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)

    dispatch = dict(pickle._Pickler.dispatch)


def test_numpy_rng_state_from_numpy_1_and_2_loads(tmp_path):
    np.random.seed(7)
    state = {"np_rng_state": np.random.get_state(), "scalar": np.float64(2.5),
             "dtype": torch.bfloat16, "shape": torch.Size([2, 3])}
    expected = np.random.rand()
    numpy1 = types.SimpleNamespace(Pickler=_Numpy1Pickler, __name__="numpy1_pickle")
    torch.save(state, tmp_path / "numpy2.pt")
    torch.save(state, tmp_path / "numpy1.pt", pickle_module=numpy1)
    assert b"numpy.core.multiarray" in (tmp_path / "numpy1.pt").read_bytes()
    for name in ("numpy1.pt", "numpy2.pt"):
        loaded = load_file(str(tmp_path / name))
        np.random.set_state(loaded["np_rng_state"])
        assert np.random.rand() == expected
        assert loaded["scalar"] == 2.5 and loaded["dtype"] is torch.bfloat16
        assert loaded["shape"] == torch.Size([2, 3])


def test_object_arrays_are_refused(tmp_path):
    path = tmp_path / "objects.pt"
    torch.save({"a": np.array([{"x": 1}], dtype=object)}, path)
    with pytest.raises(CheckpointError, match=r"objects.pt refers to (numpy\.dtypes\.ObjectDType|builtins\.object)"):
        load_file(str(path))


def test_foreign_enum_is_an_inert_placeholder():
    cls = type("AttnBackend", (ForeignObject,), {"__module__": "megatron.core.transformer.enums",
                                                  "__qualname__": "AttnBackend",
                                                  "_members": {5: "auto"}})
    value = cls(5)
    assert value.name == "auto" and value.value == 5 and repr(value) == "AttnBackend.auto"
    assert value == cls(5) and value != cls(1)
    assert "not imported" in repr(cls(9))
