"""Saving on 4 gloo ranks (TP=2 x DP=2): rank 0's manifest lists both writers' files, and a write
that fails on one rank is reported on every rank (none waits forever), with the tracker intact."""

import errno
import json
import os

import torch

import megatron.core.atomic_io as atomic_io
from megatron.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from tests.helpers.checkpoints import TinyGPT, make_args
from tests.parallel.harness import init_parallel


def _save_then_fail_on_rank_1(directory: str):
    init_parallel(tp=2)
    args = make_args(directory, tensor_model_parallel_size=2)
    torch.manual_seed(torch.distributed.get_rank() % 2)  # each tensor rank its own shard
    model = TinyGPT(args)
    save_checkpoint(10, [model], None, None, args=args)
    loaded = TinyGPT(args)
    load_checkpoint([loaded], None, None, args=make_args(directory, tensor_model_parallel_size=2,
                                                        no_load_optim=True))  # verified on every rank
    same = all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))

    real = os.fdopen
    if torch.distributed.get_rank() == 1:  # tensor rank 1 writes mp_rank_01: its disk is full
        def full_disk(*a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        atomic_io.os.fdopen = full_disk
    try:
        save_checkpoint(20, [model], None, None, args=args)
        message = None
    except CheckpointError as error:
        message = str(error)
    finally:
        atomic_io.os.fdopen = real
    return {"same": same, "message": message}


def test_manifest_gathers_every_writer_and_a_failure_reaches_every_rank(dist_pool, tmp_path):
    ckpt = tmp_path / "ckpt"
    results = dist_pool.run(_save_then_fail_on_rank_1, str(ckpt))
    manifest = json.loads((ckpt / "iter_0000010" / "checksums.json").read_text())
    assert sorted(manifest["files"]) == ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"]
    assert all(result["same"] for result in results)
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    expected = (f"checkpoint of iteration 20 was not saved: rank 1: cannot write "
                f"{ckpt / 'iter_0000020' / 'mp_rank_01' / 'model_optim_rng.pt'}: ENOSPC (No space left on "
                f"device); the previous checkpoint is intact: {tracker} still names iteration 10")
    assert [result["message"] for result in results] == [expected] * 4
    assert tracker.read_text() == "10" and not (ckpt / "iter_0000020" / "checksums.json").exists()
