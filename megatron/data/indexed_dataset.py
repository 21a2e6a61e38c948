"""Megatron's memory-mapped indexed dataset ("MMIDIDX"): a `.bin` token file and its `.idx` index.

A dataset is a path prefix P naming two files, P.bin and P.idx. All numbers are little-endian.

`.idx` layout:

    offset   size   content
    0        9      magic b"MMIDIDX\\x00\\x00"
    9        8      version, uint64, always 1
    17       1      dtype code, uint8 (see DType)
    18       8      sequence_count S, uint64
    26       8      document_count D, uint64 = number of documents + 1 (length of document_indices)
    34       4*S    sequence_lengths, int32: tokens in each sequence
    ..       8*S    sequence_pointers, int64: byte offset of each sequence in .bin
    ..       8*D    document_indices, int64: 0, ..., S; document i is sequences [doc[i], doc[i+1])
    ..       1*S    sequence_modes, int8: only in multimodal datasets, and nothing in the header says so

`.bin` holds the token ids of every sequence back to back in the index dtype, with no header,
separator or padding. A sequence is a sentence (with --split-sentences) or a whole document.

Both the reader and the builder are byte-compatible with Megatron-LM's, so files written by
either tool are read by the other.
"""

from __future__ import annotations

import array as pyarray
import enum
import os
import shutil
import struct
import tempfile
from typing import Iterable, Optional, Sequence, Tuple, Union

import numpy as np
import torch

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_LEGACY_HEADER = b"TNTIDX\x00\x00"  # classic lazy/cached format, no longer supported
_VERSION = 1
_HEADER_SIZE = 34  # 9 magic + 8 version + 1 dtype + 8 sequence count + 8 document count


class IndexedDatasetError(ValueError):
    """A `.bin`/`.idx` pair is missing, truncated or inconsistent; the message names the file."""


class DType(enum.IntEnum):
    """The dtype codes stored in byte 17 of the `.idx` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    # Megatron-Core (v0.13 and later) maps 7 to float32; classic 23.04 mapped it to float64.
    # Token datasets never use it.
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype) -> int:
        try:
            return cls[np.dtype(dtype).name].value
        except KeyError:
            raise IndexedDatasetError(f"dtype {np.dtype(dtype)} cannot be stored in an MMIDIDX dataset") from None

    @classmethod
    def dtype_from_code(cls, code: int) -> np.dtype:
        return np.dtype(cls(code).name)

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> type:
        """uint16 when every token id fits (vocab below 65500, as in Megatron), else int32."""
        if cardinality is not None and cardinality < 65500:
            return np.uint16
        return np.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def _temp_path_beside(final_path: str) -> str:
    """A fresh, unique path in the directory of `final_path`, so os.replace onto it is atomic."""
    directory, name = os.path.split(os.path.abspath(final_path))
    fd, path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    # mkstemp creates mode 0600; give the final file the usual permissions
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    return path


def write_index(
    idx_path: str,
    dtype,
    sequence_lengths: np.ndarray,
    document_indices: np.ndarray,
    sequence_modes: Optional[np.ndarray] = None,
) -> None:
    """Write an `.idx` file (not atomically; the builder writes it to a temporary path)."""
    dtype = np.dtype(dtype)
    sequence_lengths = np.asarray(sequence_lengths, dtype=np.int32)
    document_indices = np.asarray(document_indices, dtype=np.int64)
    # byte offset of each sequence: running sum of length * itemsize, starting at 0
    sequence_pointers = np.zeros(len(sequence_lengths), dtype=np.int64)
    np.cumsum(sequence_lengths[:-1], dtype=np.int64, out=sequence_pointers[1:])
    sequence_pointers *= dtype.itemsize
    with open(idx_path, "wb") as f:
        f.write(_INDEX_HEADER)
        f.write(struct.pack("<Q", _VERSION))
        f.write(struct.pack("<B", DType.code_from_dtype(dtype)))
        f.write(struct.pack("<Q", len(sequence_lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(sequence_lengths.astype("<i4", copy=False).tobytes(order="C"))
        f.write(sequence_pointers.astype("<i8", copy=False).tobytes(order="C"))
        f.write(document_indices.astype("<i8", copy=False).tobytes(order="C"))
        if sequence_modes is not None:
            f.write(np.asarray(sequence_modes, dtype=np.int8).tobytes(order="C"))


class _Index:
    """The parsed, validated contents of an `.idx` file (arrays are views into a memmap)."""

    def __init__(self, idx_path: str, multimodal: bool = False) -> None:
        self.path = idx_path
        if not os.path.exists(idx_path):
            raise FileNotFoundError(f"index file {idx_path} does not exist")
        file_size = os.path.getsize(idx_path)
        if file_size < _HEADER_SIZE:
            raise IndexedDatasetError(
                f"{idx_path} is truncated: {file_size} bytes, shorter than the {_HEADER_SIZE}-byte MMIDIDX header"
            )
        with open(idx_path, "rb") as f:
            header = f.read(_HEADER_SIZE)
        magic = header[:9]
        if magic != _INDEX_HEADER:
            hint = " (it is the legacy lazy/cached format; re-run tools/preprocess_data.py)" if magic[:8] == _LEGACY_HEADER else ""
            raise IndexedDatasetError(f"{idx_path} is not an MMIDIDX index: bad magic {magic!r}{hint}")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != _VERSION:
            raise IndexedDatasetError(f"{idx_path} has index version {version}; only version {_VERSION} is supported")
        (code,) = struct.unpack("<B", header[17:18])
        try:
            self.dtype = DType.dtype_from_code(code)
        except ValueError:
            raise IndexedDatasetError(f"{idx_path} has unknown dtype code {code}") from None
        self.sequence_count, self.document_count = struct.unpack("<QQ", header[18:34])

        S, D = self.sequence_count, self.document_count
        expected = _HEADER_SIZE + 4 * S + 8 * S + 8 * D + (S if multimodal else 0)
        if file_size < expected:
            raise IndexedDatasetError(
                f"{idx_path} is truncated: the header announces {S} sequences and {D - 1 if D else 0} documents "
                f"({expected} bytes) but the file has {file_size} bytes"
            )
        # A unimodal reader of a multimodal file ignores the trailing modes, as Megatron's does.
        if file_size != expected and not (not multimodal and file_size == expected + S):
            raise IndexedDatasetError(
                f"{idx_path} has {file_size - expected} unexpected trailing bytes after its arrays"
            )

        buffer = np.memmap(idx_path, mode="r", order="C")
        offset = _HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buffer, dtype="<i4", count=S, offset=offset)
        offset += 4 * S
        self.sequence_pointers = np.frombuffer(buffer, dtype="<i8", count=S, offset=offset)
        offset += 8 * S
        self.document_indices = np.frombuffer(buffer, dtype="<i8", count=D, offset=offset)
        offset += 8 * D
        self.sequence_modes = (
            np.frombuffer(buffer, dtype=np.int8, count=S, offset=offset) if multimodal else None
        )
        self._check_consistency()

    def _check_consistency(self) -> None:
        doc = self.document_indices
        S = self.sequence_count
        if len(doc) == 0 or doc[0] != 0 or doc[-1] != S:
            raise IndexedDatasetError(
                f"{self.path} is corrupted: document indices must run from 0 to the sequence count {S}"
            )
        if len(doc) > 1 and np.any(np.diff(doc) < 0):
            raise IndexedDatasetError(f"{self.path} is corrupted: document indices are not sorted")
        if S and self.sequence_lengths.min() < 0:
            raise IndexedDatasetError(f"{self.path} is corrupted: a sequence length is negative")
        if S:
            itemsize = self.dtype.itemsize
            if self.sequence_pointers[0] != 0 or np.any(
                np.diff(self.sequence_pointers) != self.sequence_lengths[:-1].astype(np.int64) * itemsize
            ):
                raise IndexedDatasetError(
                    f"{self.path} is corrupted: sequence pointers do not match the sequence lengths"
                )

    @property
    def bin_size(self) -> int:
        """Bytes the `.bin` file must have."""
        if self.sequence_count == 0:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize


class _MMapBinReader:
    def __init__(self, bin_path: str) -> None:
        self._buffer = np.memmap(bin_path, mode="r", order="C") if os.path.getsize(bin_path) else b""

    def read(self, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        return np.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)


class _FileBinReader:
    """Reads with plain file I/O, for file systems where mmap is slow (--no-mmap-bin-files)."""

    def __init__(self, bin_path: str) -> None:
        self._path = bin_path

    def read(self, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        out = np.empty(count, dtype=dtype)
        with open(self._path, "rb", buffering=0) as f:
            f.seek(offset)
            f.readinto(out)
        return out


class IndexedDataset(torch.utils.data.Dataset):
    """Reader of a `.bin`/`.idx` pair; item i is sequence i as a numpy array.

    Args:
        path_prefix: the path without `.bin`/`.idx`.
        multimodal: the index carries per-sequence modes (never announced by the header).
        mmap: memory-map the `.bin` file (False reads with file I/O).
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        super().__init__()
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        if not os.path.exists(bin_path):
            raise FileNotFoundError(f"data file {bin_path} does not exist")
        self.index = _Index(idx_path, multimodal)
        actual = os.path.getsize(bin_path)
        if actual != self.index.bin_size:
            raise IndexedDatasetError(
                f"{bin_path} has {actual} bytes but its index {idx_path} describes {self.index.bin_size} bytes "
                f"({'truncated' if actual < self.index.bin_size else 'trailing data'})"
            )
        self._bin = _MMapBinReader(bin_path) if mmap else _FileBinReader(bin_path)

    def __len__(self) -> int:
        return self.index.sequence_count

    def __getitem__(self, idx: Union[int, np.integer, slice]):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices of an IndexedDataset must be contiguous")
            return [self.get(i) for i in range(start, stop)]
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence idx (to its end when length is None)."""
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {self.path_prefix} ({len(self)} sequences)")
        size = int(self.index.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of length {size}")
        pointer = int(self.index.sequence_pointers[idx]) + offset * self.index.dtype.itemsize
        return self._bin.read(self.index.dtype, length, pointer)

    @property
    def dtype(self) -> np.dtype:
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @property
    def sequence_modes(self) -> Optional[np.ndarray]:
        return self.index.sequence_modes

    @property
    def num_documents(self) -> int:
        return len(self.index.document_indices) - 1

    def token_range(self, begin: int, end: int, chunk: int = 1 << 24) -> Tuple[int, int]:
        """(smallest, largest) token id in sequences [begin, end); (0, -1) when they hold no token.

        The sequences lie back to back in `.bin` (the reader checks the pointers), so this is
        one pass over their bytes, `chunk` tokens at a time.
        """
        lengths = self.sequence_lengths[begin:end]
        count = int(lengths.sum(dtype=np.int64))
        if count == 0:
            return 0, -1
        offset = int(self.sequence_pointers[begin])
        low, high = None, None
        for first in range(0, count, chunk):
            tokens = self._bin.read(self.dtype, min(chunk, count - first), offset + first * self.dtype.itemsize)
            low = int(tokens.min()) if low is None else min(low, int(tokens.min()))
            high = int(tokens.max()) if high is None else max(high, int(tokens.max()))
        return low, high

    def document_lengths(self) -> np.ndarray:
        """Tokens in each document (sum of its sequences' lengths), int64."""
        cumulative = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return cumulative[self.document_indices[1:]] - cumulative[self.document_indices[:-1]]

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.exists(get_idx_path(path_prefix)) and os.path.exists(get_bin_path(path_prefix))


class IndexedDatasetBuilder:
    """Writes a `.bin`/`.idx` pair; nothing appears under the final names until finalize().

    Tokens go to a temporary file beside `bin_path`; finalize() writes the index beside
    `idx_path` and renames both into place, so an interrupted or failed build never leaves
    a half-written dataset (call abort(), or use the builder as a context manager, to remove
    the temporary file).
    """

    def __init__(self, bin_path: str, dtype=np.int32, multimodal: bool = False) -> None:
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        DType.code_from_dtype(self.dtype)  # fail now on an unsupported dtype
        self.multimodal = multimodal
        self._tmp_bin_path = _temp_path_beside(bin_path)
        self._data_file = open(self._tmp_bin_path, "wb")
        # compact typed arrays: merging large datasets appends millions of entries
        self.sequence_lengths = pyarray.array("i")
        self.document_indices = pyarray.array("q", [0])
        self.sequence_modes = pyarray.array("b") if multimodal else None
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._range = (int(info.min), int(info.max))
        else:
            self._range = None

    def _as_array(self, tokens: Union[torch.Tensor, np.ndarray, Sequence[int]]) -> np.ndarray:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        array = np.asarray(tokens)
        if array.ndim != 1:
            array = array.reshape(-1)
        if self._range is not None and array.size and (array.min() < self._range[0] or array.max() > self._range[1]):
            raise IndexedDatasetError(
                f"token ids in [{array.min()}, {array.max()}] do not fit the dataset dtype {self.dtype} "
                f"of {self.bin_path}"
            )
        return array.astype(self.dtype, copy=False)

    def add_item(self, tokens, mode: int = 0) -> None:
        """Append one sequence."""
        array = self._as_array(tokens)
        self._data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(array.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def end_document(self) -> None:
        """Close the current document (an empty one if no sequence was added since the last)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths: Iterable[int], modes: Optional[Iterable[int]] = None) -> None:
        """Append a whole document whose sequences have the given lengths."""
        array = self._as_array(tokens)
        lengths = [int(n) for n in lengths]
        if sum(lengths) != array.size:
            raise IndexedDatasetError(f"sequence lengths sum to {sum(lengths)} but the document has {array.size} tokens")
        self._data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every document of another dataset (used to merge partitions and datasets)."""
        other = _Index(get_idx_path(path_prefix), self.multimodal)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"cannot merge {path_prefix} (dtype {other.dtype}) into a {self.dtype} dataset"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(other.sequence_lengths.astype(np.int32).tobytes())
        self.document_indices.frombytes((offset + other.document_indices[1:]).astype(np.int64).tobytes())
        if self.multimodal:
            self.sequence_modes.frombytes(other.sequence_modes.astype(np.int8).tobytes())
        bin_path = get_bin_path(path_prefix)
        if os.path.getsize(bin_path) != other.bin_size:
            raise IndexedDatasetError(f"{bin_path} does not match its index {get_idx_path(path_prefix)}")
        with open(bin_path, "rb") as f:
            shutil.copyfileobj(f, self._data_file)

    def finalize(self, idx_path: str) -> None:
        """Write the index and move both files to their final names.

        Sequences added since the last end_document() form a last document (Megatron's
        builder would write an index its own reader rejects).
        """
        if self.document_indices[-1] != len(self.sequence_lengths):
            self.end_document()
        self._data_file.close()
        tmp_idx_path = _temp_path_beside(idx_path)
        try:
            write_index(tmp_idx_path, self.dtype, np.frombuffer(self.sequence_lengths, dtype=np.int32),
                        np.frombuffer(self.document_indices, dtype=np.int64),
                        np.frombuffer(self.sequence_modes, dtype=np.int8) if self.multimodal else None)
            os.replace(self._tmp_bin_path, self.bin_path)
            os.replace(tmp_idx_path, idx_path)  # the index last: a reader needs both
        except BaseException:
            _remove_quietly(tmp_idx_path)
            self.abort()
            raise

    def abort(self) -> None:
        """Discard everything written so far."""
        if not self._data_file.closed:
            self._data_file.close()
        _remove_quietly(self._tmp_bin_path)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
