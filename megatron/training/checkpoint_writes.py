"""The writes of a checkpoint save, made so that no rank is left waiting on a failed one.

Each write's exception is caught as a Failure (a one-line message naming the file and the errno,
and the exception itself on the rank that raised it); the failures are exchanged with every rank
in the collective that also marks every file complete, so all ranks raise the same
CheckpointError instead of some of them blocking in the next barrier.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from megatron.core import communication
from megatron.core.atomic_io import Checksum

# A failed write: (one-line message, the exception on the rank that raised it, else None).
Failure = Tuple[str, Optional[BaseException]]


def describe_write_error(path: str, error: BaseException) -> str:
    """'cannot write PATH: ENOSPC (No space left on device)' (the exception type when not an OSError)."""
    if isinstance(error, OSError):
        code = errno.errorcode.get(error.errno, "") if error.errno else ""
        why = f"{code} ({error.strerror})" if code and error.strerror else (error.strerror or str(error))
    else:
        why = f"{type(error).__name__}: {error}"
    return f"cannot write {path}: {why}"


def attempt(path: str, base_dir: str, files: Optional[Dict[str, Checksum]],
            write: Callable[[], Optional[Checksum]]) -> Optional[Failure]:
    """Run write() (which writes `path`); record its checksum in `files` under the path
    relative to base_dir; return the failure instead of raising it."""
    try:
        checksum = write()
    except Exception as error:  # noqa: BLE001 -- reported on every rank, or the others wait forever
        return describe_write_error(path, error), error
    if checksum is not None and files is not None:
        files[os.path.relpath(path, base_dir).replace(os.sep, "/")] = checksum
    return None


def gather_results(files: Dict[str, Checksum], failure: Optional[Failure]
                   ) -> Tuple[Dict[str, Checksum], List[Failure]]:
    """Every rank's checksums and failures, on every rank (a collective: it also waits until
    every rank's files are complete)."""
    if not dist.is_initialized():
        return dict(files), [failure] if failure else []
    results: List[Any] = [None] * dist.get_world_size()
    communication.all_gather_object(results, (files, failure[0] if failure else None))
    merged: Dict[str, Checksum] = {}
    failures: List[Failure] = []
    for rank, (rank_files, message) in enumerate(results):
        merged.update(rank_files)
        if message is not None:
            own = failure[1] if rank == dist.get_rank() and failure else None
            failures.append((f"rank {rank}: {message}" if len(results) > 1 else message, own))
    return merged, failures


def broadcast_from_rank_0(failure: Optional[Failure]) -> List[Failure]:
    """Rank 0's failure (of the manifest or tracker write), on every rank."""
    if not dist.is_initialized():
        return [failure] if failure else []
    message = [failure[0] if failure else None]
    communication.broadcast_object_list(message, src=0)
    if message[0] is None:
        return []
    return [(message[0], failure[1] if failure else None)]


def local_error(failures: List[Failure]) -> Optional[BaseException]:
    """This rank's own exception among `failures` (to chain the CheckpointError to), or None."""
    return next((error for _, error in failures if error is not None), None)
