"""Write a file so that its final name only ever holds complete contents.

The bytes go to a fresh temporary file `.<name>.<random>.tmp` in the same directory, are flushed
and fsynced, and the file is renamed over the final name (os.replace is atomic within a file
system). Any failure, KeyboardInterrupt included, removes the temporary file and leaves the final
name untouched: whatever it held before (an older checkpoint, an index cache) is still there and
valid. A process killed mid-write leaves its temporary file behind; `remove_stale_temporaries`
clears those before the next write of that name.

With checksum=True the bytes are hashed (sha256) as they are written, so a checksum manifest
costs no second read of the file.
"""

from __future__ import annotations

import glob
import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import BinaryIO, Callable, List, Optional


@dataclass(frozen=True)
class Checksum:
    """Size in bytes and sha256 (hex) of a file's contents."""

    size: int
    sha256: str


class _HashingWriter:
    """A write-only binary stream over `raw` that hashes what passes through it.

    It also keeps the first OSError a write raised: torch.save's zip writer swallows it and
    reports an unrelated `unexpected pos ...`, and the real cause (ENOSPC, EROFS...) is what the
    user needs to see.
    """

    def __init__(self, raw: BinaryIO, digest: Optional["hashlib._Hash"]):
        self._raw, self._digest = raw, digest
        self.size = 0
        self.write_error: Optional[OSError] = None

    def write(self, data) -> int:
        try:
            written = self._raw.write(data)
        except OSError as error:
            if self.write_error is None:
                self.write_error = error
            raise
        if self._digest is not None:
            self._digest.update(data)
        self.size += len(memoryview(data).cast("B"))
        return written

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True


def atomic_write(final_path: str, write: Callable[[BinaryIO], None],
                 checksum: bool = False) -> Optional[Checksum]:
    """Call write(binary stream) on a temporary file beside final_path, then rename it into place.

    The stream supports write() and flush() only (writes are sequential). Returns the Checksum of
    what was written when checksum=True, else None. An OSError from the writes is re-raised as
    itself even when `write` turned it into another exception.
    """
    directory, name = os.path.split(os.path.abspath(final_path))
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            stream = _HashingWriter(f, hashlib.sha256() if checksum else None)
            try:
                write(stream)  # type: ignore[arg-type]
            except Exception as error:
                if stream.write_error is not None and stream.write_error is not error:
                    raise stream.write_error from error
                raise
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(temp, final_path)
    except BaseException:
        try:
            os.remove(temp)
        except FileNotFoundError:
            pass
        raise
    if not checksum:
        return None
    return Checksum(stream.size, stream._digest.hexdigest())  # type: ignore[union-attr]


def remove_stale_temporaries(final_path: str) -> List[str]:
    """Delete the temporary files a killed atomic_write of `final_path` left behind.

    Only call it where no other process is writing `final_path` at the same time. Returns the
    paths removed.
    """
    directory, name = os.path.split(os.path.abspath(final_path))
    removed = []
    for temp in glob.glob(os.path.join(glob.escape(directory), glob.escape(f".{name}.") + "*.tmp")):
        try:
            os.remove(temp)
            removed.append(temp)
        except FileNotFoundError:
            pass
    return removed


def file_checksum(path: str, chunk_bytes: int = 8 << 20) -> Checksum:
    """Checksum of an existing file, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    return Checksum(size, digest.hexdigest())
