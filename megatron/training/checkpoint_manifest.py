"""Checksums of a checkpoint's files: `<save>/iter_XXXXXXX/checksums.json`.

    {"format": "megatron-checkpoint-checksums", "version": 1, "algorithm": "sha256",
     "iteration": 10,
     "files": {"mp_rank_00/model_optim_rng.pt": {"bytes": 123456, "sha256": "9f86d0..."},
               "mp_rank_00/distrib_optim.pt": {...}}}

Each rank hashes the files it writes while writing them (atomic_write(checksum=True)); global
rank 0 gathers the entries and writes the manifest after every file is complete and before the
tracker, so a tracker always names an iteration whose manifest lists all of its files. On load,
each file is checked (size, then sha256) before it is unpickled. A folder without a manifest
(Megatron-LM's, or ours from before manifests) loads unverified.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

from megatron.training.checkpoint_safety import CheckpointError
from megatron.core.atomic_io import Checksum, atomic_write, file_checksum

MANIFEST_NAME = "checksums.json"
_FORMAT = "megatron-checkpoint-checksums"


def manifest_path(iteration_dir: str) -> str:
    """Where the manifest of an iteration folder lives."""
    return os.path.join(iteration_dir, MANIFEST_NAME)


def write_manifest(iteration_dir: str, iteration: int, files: Dict[str, Checksum]) -> None:
    """Write (atomically) the manifest listing `files` (paths relative to iteration_dir)."""
    document = {
        "format": _FORMAT, "version": 1, "algorithm": "sha256", "iteration": iteration,
        "files": {name: {"bytes": files[name].size, "sha256": files[name].sha256}
                  for name in sorted(files)},
    }
    text = json.dumps(document, indent=1) + "\n"
    atomic_write(manifest_path(iteration_dir), lambda f: f.write(text.encode("utf-8")))


def read_manifest(iteration_dir: str) -> Optional[Dict[str, Checksum]]:
    """{relative path: Checksum}, or None when the folder has no manifest."""
    path = manifest_path(iteration_dir)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            document = json.load(f)
        if document.get("format") != _FORMAT or document.get("algorithm") != "sha256":
            raise ValueError(f"not a {_FORMAT} sha256 manifest")
        return {name: Checksum(int(entry["bytes"]), str(entry["sha256"]))
                for name, entry in document["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"checksum manifest {path} is unreadable ({error}); delete it to load "
                              "the checkpoint unverified") from None


def verify_file(path: str, iteration_dir: str) -> bool:
    """Check `path` (a file under iteration_dir) against the folder's manifest.

    Returns False when there is no manifest (nothing verified), True when the file matches;
    raises CheckpointError naming the file when it is unlisted, of another size or checksum.
    """
    expected_all = read_manifest(iteration_dir)
    if expected_all is None:
        return False
    name = os.path.relpath(path, iteration_dir).replace(os.sep, "/")
    manifest = manifest_path(iteration_dir)
    expected = expected_all.get(name)
    if expected is None:
        raise CheckpointError(f"checkpoint file {path} is not listed in {manifest}: the folder holds "
                              "files from another save (delete the manifest to load it unverified)")
    size = os.path.getsize(path)
    if size != expected.size:
        raise CheckpointError(f"checkpoint file {path} is {size} bytes but {manifest} recorded "
                              f"{expected.size} when it was saved: the file was truncated or "
                              "replaced; restore it or load an earlier checkpoint")
    actual = file_checksum(path)
    if actual.sha256 != expected.sha256:
        raise CheckpointError(f"checkpoint file {path} does not match its checksum in {manifest} "
                              f"(sha256 {actual.sha256[:16]}... instead of {expected.sha256[:16]}...): "
                              "the file was damaged after it was saved (disk or copy error); "
                              "restore it or load an earlier checkpoint")
    return True
