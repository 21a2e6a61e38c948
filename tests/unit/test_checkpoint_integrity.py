"""Checkpoints that are damaged, incomplete or cannot be written fail loudly and say why.

The checksum manifest (a flipped byte in model_optim_rng.pt or distrib_optim.pt is named), save
failures (ENOSPC, EROFS: the file, the errno and the checkpoint still intact), --save and --load
checked before any work, missing files described as what is missing, a file from another
iteration refused, and the temporaries of a killed save removed by the next save.
"""

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import megatron.training.arguments_validation as validation
import megatron.core.atomic_io as atomic_io
import pretrain_gpt
from megatron.training.arguments import ArgsError, parse_and_validate_args
from megatron.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from megatron.core.atomic_io import atomic_write
from tests.helpers.checkpoints import TinyGPT, assert_same_weights, build, make_args, model_file

TRACKER = "latest_checkpointed_iteration.txt"
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--lr", "1e-3", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "63"]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


def saved(ckpt: Path, iteration: int = 10, seed: int = 0):
    args = make_args(ckpt)
    model, optimizer, scheduler = build(args, seed=seed)
    save_checkpoint(iteration, [model], optimizer, scheduler, args=args)
    return args, model, optimizer, scheduler


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------- checksum manifest
def test_atomic_write_hashes_what_it_writes(tmp_path):
    path = tmp_path / "state.pt"
    checksum = atomic_write(str(path), lambda f: torch.save({"w": torch.arange(1000.0)}, f),
                            checksum=True)
    assert checksum.sha256 == sha256(path) and checksum.size == path.stat().st_size


def test_flipped_byte_in_the_model_file_is_named(ckpt):
    args, model, _, _ = saved(ckpt)
    manifest = json.loads((ckpt / "iter_0000010" / "checksums.json").read_text())
    path = model_file(ckpt, 10)
    assert manifest["iteration"] == 10 and manifest["algorithm"] == "sha256"
    assert manifest["files"] == {"mp_rank_00/model_optim_rng.pt": {"bytes": path.stat().st_size,
                                                                   "sha256": sha256(path)}}
    fresh = TinyGPT(args)
    load_checkpoint([fresh], None, None, args=make_args(ckpt, no_load_optim=True))  # intact: loads
    assert_same_weights(fresh, model)

    flip_byte(path, path.stat().st_size // 2)  # inside the tensor data: unpickling would not notice
    with pytest.raises(CheckpointError) as info:
        load_checkpoint([TinyGPT(args)], None, None, args=args)
    assert str(info.value).startswith(
        f"checkpoint file {path} does not match its checksum in {ckpt / 'iter_0000010' / 'checksums.json'}")
    assert "damaged after it was saved" in str(info.value)


def test_checkpoint_without_manifest_loads_unverified(ckpt, capsys):
    args, model, _, _ = saved(ckpt)
    (ckpt / "iter_0000010" / "checksums.json").unlink()  # as Megatron-LM writes it
    fresh = TinyGPT(args)
    assert load_checkpoint([fresh], None, None, args=make_args(ckpt, no_load_optim=True))[0] == 10
    assert_same_weights(fresh, model)
    assert f"{model_file(ckpt, 10)} is not verified" in capsys.readouterr().out


def test_flipped_byte_in_distrib_optim_is_named(tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = [*TINY, "--ckpt-format", "torch", "--use-distributed-optimizer", "--bf16", "--save-interval", "2",
             "--train-iters", "2"]
    pretrain_gpt.main([*flags, "--save", str(ckpt)])
    iteration_dir = ckpt / "iter_0000002"
    files = json.loads((iteration_dir / "checksums.json").read_text())["files"]
    assert sorted(files) == ["mp_rank_00/distrib_optim.pt", "mp_rank_00/model_optim_rng.pt"]
    for name, entry in files.items():
        assert entry == {"bytes": (iteration_dir / name).stat().st_size, "sha256": sha256(iteration_dir / name)}
    optim = iteration_dir / "mp_rank_00" / "distrib_optim.pt"
    flip_byte(optim, optim.stat().st_size - 2000)
    with pytest.raises(CheckpointError, match=f"^checkpoint file {optim} does not match its checksum"):
        pretrain_gpt.main([*flags, "--train-iters", "4", "--load", str(ckpt)])


# ------------------------------------------------------------------------- failed saves
class _FullDisk:
    """A file object whose writes fail with `code` once `room` bytes are written (a full disk)."""

    def __init__(self, file, code: int, room: int):
        self._file, self._code, self._room = file, code, room

    def write(self, data):
        self._room -= len(memoryview(data).cast("B"))
        if self._room < 0:
            raise OSError(self._code, os.strerror(self._code))
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)


def _failing_writes(monkeypatch, code: int, room: int = 1000) -> None:
    real = os.fdopen
    monkeypatch.setattr(atomic_io.os, "fdopen", lambda *a, **k: _FullDisk(real(*a, **k), code, room))


def test_disk_full_names_the_file_the_errno_and_the_intact_checkpoint(ckpt, monkeypatch):
    args, model, optimizer, scheduler = saved(ckpt)
    _failing_writes(monkeypatch, errno.ENOSPC)  # torch.save alone would report "unexpected pos"
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(20, [model], optimizer, scheduler, args=args)
    monkeypatch.undo()
    assert str(info.value) == (
        f"checkpoint of iteration 20 was not saved: cannot write {model_file(ckpt, 20)}: ENOSPC "
        f"(No space left on device); the previous checkpoint is intact: {ckpt / TRACKER} still names "
        "iteration 10")
    assert (ckpt / TRACKER).read_text() == "10"
    assert os.listdir(ckpt / "iter_0000020" / "mp_rank_00") == []  # no temporary left behind
    assert load_checkpoint([TinyGPT(args)], None, None, args=args)[0] == 10


def test_read_only_tracker_and_a_first_save(ckpt, monkeypatch):
    args, model, optimizer, scheduler = saved(ckpt)
    real = atomic_io.atomic_write

    def tracker_on_read_only_fs(path, write, checksum=False):
        if path.endswith(TRACKER):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real(path, write, checksum)

    monkeypatch.setattr("megatron.training.checkpointing.atomic_write", tracker_on_read_only_fs)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(20, [model], optimizer, scheduler, args=args)
    assert str(info.value) == (
        f"checkpoint of iteration 20 was not saved: cannot write {ckpt / TRACKER}: EROFS (Read-only "
        f"file system); the previous checkpoint is intact: {ckpt / TRACKER} still names iteration 10")
    monkeypatch.undo()

    _failing_writes(monkeypatch, errno.ENOSPC)
    other = ckpt.parent / "other"
    with pytest.raises(CheckpointError, match=f"no earlier checkpoint was recorded in {other} "
                                              f"\\(there is no {TRACKER}\\)"):
        save_checkpoint(5, [model], optimizer, scheduler, args=make_args(other))


# ------------------------------------------------------------------------- --save / --load at start-up
def _validate(*flags):
    return parse_and_validate_args(argv=[*TINY, "--train-iters", "2", *flags])


def test_save_directory_is_checked_at_start_up(tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ArgsError, match=f"^--save {a_file} is a file, not a directory"):
        _validate("--save", str(a_file), "--save-interval", "1")
    with pytest.raises(ArgsError, match=f"^--save {a_file}/sub: cannot create the directory: ENOTDIR "
                                        "\\(Not a directory\\)$"):
        _validate("--save", str(a_file / "sub"), "--save-interval", "1")
    created = tmp_path / "new" / "deeper"
    _validate("--save", str(created), "--save-interval", "1")
    assert created.is_dir() and os.listdir(created) == []  # the write probe is gone

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(validation.tempfile, "mkstemp", read_only)
    with pytest.raises(ArgsError, match=f"^--save {created}: the directory is not writable: EROFS "
                                        "\\(Read-only file system\\)$"):
        _validate("--save", str(created), "--save-interval", "1")


def test_load_pointing_at_a_file_is_an_error(tmp_path):
    a_file = tmp_path / "model.pt"
    torch.save({}, a_file)
    expected = (f"--load {a_file} is a file, not a checkpoint directory (one holding {TRACKER} and "
                "iter_*/ folders)")
    with pytest.raises(CheckpointError) as info:
        _validate("--load", str(a_file))
    assert str(info.value) == expected
    args = make_args(a_file)
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        load_checkpoint([TinyGPT(args)], None, None, args=args)


# ------------------------------------------------------------------------- incomplete checkpoints
def test_empty_rank_folder_says_what_is_missing(ckpt):
    args, _, _, _ = saved(ckpt)
    model_file(ckpt, 10).unlink()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint([TinyGPT(args)], None, None, args=args)
    assert str(info.value) == (
        f"{model_file(ckpt, 10).parent} has no model_optim_rng.pt (it is empty): the save of iteration "
        f"10 did not finish writing it, or it was removed since; the tracker {ckpt / TRACKER} names "
        "iteration 10")


def test_folder_in_place_of_the_model_file(ckpt):
    args, _, _, _ = saved(ckpt)
    path = model_file(ckpt, 10)
    path.unlink()
    path.mkdir()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint([TinyGPT(args)], None, None, args=args)
    assert str(info.value) == (f"checkpoint file {path} is a directory, not a file written by "
                               f"torch.save (the tracker {ckpt / TRACKER} names iteration 10)")


def test_file_of_another_iteration_is_refused(ckpt):
    args, _, _, _ = saved(ckpt)
    model_file(ckpt, 20).parent.mkdir(parents=True)
    shutil.copy(model_file(ckpt, 10), model_file(ckpt, 20))
    (ckpt / TRACKER).write_text("20")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint([TinyGPT(args)], None, None, args=args)
    assert str(info.value) == (
        f"checkpoint file {model_file(ckpt, 20)} holds iteration 10, but its folder iter_0000020 and "
        f"the tracker {ckpt / TRACKER} say iteration 20: the file belongs to another checkpoint")


def test_next_save_removes_the_temporaries_of_a_killed_one(ckpt):
    args, model, optimizer, scheduler = saved(ckpt)
    rank_dir = ckpt / "iter_0000020" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    leftovers = [rank_dir / ".model_optim_rng.pt.k1ll3d.tmp", rank_dir / ".distrib_optim.pt.x.tmp",
                 ckpt / f".{TRACKER}.abc.tmp", ckpt / "iter_0000020" / ".checksums.json.q.tmp"]
    for path in leftovers:
        path.write_bytes(b"partial")
    (rank_dir / "notes.txt").write_text("not ours")
    save_checkpoint(20, [model], optimizer, scheduler, args=args)
    assert not [path for path in leftovers if path.exists()]
    assert sorted(os.listdir(rank_dir)) == ["model_optim_rng.pt", "notes.txt"]
    assert (ckpt / TRACKER).read_text() == "20"
