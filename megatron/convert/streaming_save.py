"""A torch.save file written one tensor at a time, so a writer never holds the whole state dict.

torch.save pickles the object (data.pkl) and then writes each storage as a zip record data/KEY;
a reader finds the records by name, so their order in the archive does not matter. StreamingFile
writes each tensor's bytes as its record the moment it is added and keeps only a placeholder
(key, dtype, shape); finish(obj) then pickles `obj`, in which the placeholders stand for the
tensors, exactly as torch.save would have pickled the real ones (_rebuild_tensor_v2 over a typed
storage named ("storage", FloatStorage, KEY, "cpu", numel)). The result is read by torch.load,
weights_only or not, mmap or not, and by megatron.training.checkpoint_safety.load_file.

The bytes pass through a sha256 as they are written (the checksum manifest needs no second read).
"""

from __future__ import annotations

import collections
import hashlib
import io
import os
import pickle
import sys
import tempfile
from typing import Any

import torch

from megatron.core.atomic_io import Checksum, _HashingWriter


class TensorPlaceholder:
    """Stands for a tensor already written as record data/KEY."""

    __slots__ = ("key", "dtype", "shape", "numel")

    def __init__(self, key: str, dtype: torch.dtype, shape: torch.Size) -> None:
        self.key, self.dtype, self.shape, self.numel = key, dtype, tuple(shape), shape.numel()


class _StorageRef:
    __slots__ = ("placeholder",)

    def __init__(self, placeholder: TensorPlaceholder) -> None:
        self.placeholder = placeholder


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, TensorPlaceholder):
            args = (_StorageRef(obj), 0, obj.shape, _contiguous_strides(obj.shape), False, collections.OrderedDict())
            return torch._utils._rebuild_tensor_v2, args
        if torch.is_tensor(obj):
            raise TypeError("StreamingFile.finish: a tensor that was not added (add() it first)")
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            p = obj.placeholder
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[p.dtype])
            return "storage", storage_type, p.key, "cpu", p.numel
        return None


class StreamingFile:
    """Write `path` as torch.save(obj) would, one tensor at a time (into a temporary file beside it,
    renamed to `path` by finish()).

        f = StreamingFile(path)
        state = {"model": {name: f.add(tensor) for name, tensor in ...}, "args": args}
        checksum = f.finish(state)
    """

    def __init__(self, path: str) -> None:
        self.path = path
        directory, name = os.path.split(os.path.abspath(path))
        fd, self._temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        self._file = os.fdopen(fd, "wb")
        self._stream = _HashingWriter(self._file, hashlib.sha256())
        self._writer = torch._C.PyTorchFileWriter(self._stream)
        self._keys = 0

    def add(self, tensor: torch.Tensor) -> TensorPlaceholder:
        """Write the tensor's bytes now; the placeholder goes where the tensor would in the object."""
        tensor = tensor.detach().cpu()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        key = str(self._keys)
        self._keys += 1
        # exactly the tensor's own bytes (a view of a larger storage is not copied, nor all of it written)
        self._writer.write_record(f"data/{key}", tensor.data_ptr(), tensor.numel() * tensor.element_size())
        return TensorPlaceholder(key, tensor.dtype, tensor.shape)

    def finish(self, obj: Any) -> Checksum:
        """Pickle obj (placeholders for the added tensors), close and fsync the file."""
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=2).dump(obj)
        data = buffer.getvalue()
        self._writer.write_record("data.pkl", data, len(data))
        self._writer.write_record(".format_version", "1", 1)
        alignment = "64"
        self._writer.write_record(".storage_alignment", alignment, len(alignment))
        self._writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._writer.write_end_of_file()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self._temp, 0o666 & ~umask)  # mkstemp creates 0600; the usual permissions
        os.replace(self._temp, self.path)  # only a complete file ever has the final name
        return Checksum(self._stream.size, self._stream._digest.hexdigest())  # type: ignore[union-attr]

    def abandon(self) -> None:
        """Close and remove a file that will not be finished."""
        try:  # end the archive first: the writer would otherwise end it, on a closed file, when freed
            self._writer.write_end_of_file()
        except Exception:
            pass
        self._writer = None
        self._file.close()
        try:
            os.remove(self._temp)
        except FileNotFoundError:
            pass
