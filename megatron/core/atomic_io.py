"""Write a file so that its final name only ever holds complete contents.

The bytes go to a fresh temporary file in the same directory, are flushed and fsynced, and the
file is renamed over the final name (os.replace is atomic within a file system). Any failure,
KeyboardInterrupt included, removes the temporary file and leaves the final name untouched:
whatever it held before (an older checkpoint, an index cache) is still there and valid.
"""

from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable


def atomic_write(final_path: str, write: Callable[[BinaryIO], None]) -> None:
    """Call write(binary file) on a temporary file beside final_path, then rename it into place."""
    directory, name = os.path.split(os.path.abspath(final_path))
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
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
