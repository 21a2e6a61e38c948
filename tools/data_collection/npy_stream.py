"""Write a .npy file row by row without knowing its length in advance (the header, written last,
holds the final shape), under a temporary name renamed when complete."""

from __future__ import annotations

import os
import tempfile

import numpy as np

_HEADER_BYTES = 128  # magic (6) + version (2) + length (2) + the dict, padded to 64; fits any shape here


def _header(dtype: np.dtype, shape: tuple) -> bytes:
    fields = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    text = repr(fields).encode("latin1")
    body = text + b" " * (_HEADER_BYTES - 10 - len(text) - 1) + b"\n"
    if len(body) + 10 != _HEADER_BYTES:
        raise ValueError(f"shape {shape} does not fit a {_HEADER_BYTES}-byte .npy header")
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body


class NpyRowWriter:
    """Append rows (arrays of shape [k, *row_shape]) to `path`; close() writes the header and renames."""

    def __init__(self, path: str, dtype, row_shape: tuple = ()) -> None:
        self.path, self.dtype, self.row_shape, self.rows = path, np.dtype(dtype), tuple(row_shape), 0
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
        self.file = os.fdopen(fd, "wb")
        self.file.write(b"\0" * _HEADER_BYTES)

    def append(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.shape[1:] != self.row_shape:
            raise ValueError(f"rows of shape {rows.shape[1:]}, expected {self.row_shape}")
        self.file.write(rows.tobytes())
        self.rows += len(rows)

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(_header(self.dtype, (self.rows, *self.row_shape)))
        self.file.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.file.close()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

