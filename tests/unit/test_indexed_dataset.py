"""The MMIDIDX `.bin/.idx` format, checked byte for byte against ../shared/FORMATS.md section 1."""
import os
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
)

# three documents: two sentences, an empty document, one sentence
DOCS = [[[5, 6, 7], [8]], [], [[9, 10]]]


def build(prefix, docs=DOCS, dtype=np.uint16, multimodal=False):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype, multimodal=multimodal)
    for doc in docs:
        for i, sentence in enumerate(doc):
            builder.add_item(np.array(sentence), mode=i % 2)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def expected_idx_bytes(dtype_code, lengths, doc_indices, itemsize):
    """The .idx written by hand from the spec table (independent of the writer)."""
    pointers, offset = [], 0
    for n in lengths:
        pointers.append(offset)
        offset += n * itemsize
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_indices))
    out += struct.pack(f"<{len(lengths)}i", *lengths)
    out += struct.pack(f"<{len(pointers)}q", *pointers)
    out += struct.pack(f"<{len(doc_indices)}q", *doc_indices)
    return out


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5), (np.uint8, 1)])
def test_bytes_match_the_format_spec(tmp_path, dtype, code):
    prefix = build(str(tmp_path / "ds"), dtype=dtype)
    idx = (tmp_path / "ds.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    assert idx[9:17] == (1).to_bytes(8, "little")
    assert idx[17] == code
    # 3 sequences; document_count is the length of document_indices = documents + 1
    assert struct.unpack("<QQ", idx[18:34]) == (3, 4)
    itemsize = np.dtype(dtype).itemsize
    assert idx == expected_idx_bytes(code, [3, 1, 2], [0, 2, 2, 3], itemsize)
    tokens = [5, 6, 7, 8, 9, 10]
    assert (tmp_path / "ds.bin").read_bytes() == np.array(tokens, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)


def test_reader_arrays_and_access(tmp_path):
    ds = IndexedDataset(build(str(tmp_path / "ds")))
    assert len(ds) == 3 and ds.num_documents == 3
    assert ds.sequence_lengths.tolist() == [3, 1, 2]
    assert ds.sequence_pointers.tolist() == [0, 6, 8]
    assert ds.document_indices.tolist() == [0, 2, 2, 3]
    assert ds.document_lengths().tolist() == [4, 0, 2]
    assert ds[0].tolist() == [5, 6, 7] and ds[-1].tolist() == [9, 10]
    assert [a.tolist() for a in ds[0:2]] == [[5, 6, 7], [8]]
    assert ds.get(0, offset=1).tolist() == [6, 7]
    assert ds.get(0, offset=1, length=1).tolist() == [6]
    assert ds.get(2, offset=2, length=0).tolist() == []
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)
    with pytest.raises(IndexError):
        ds[3]
    unmapped = IndexedDataset(str(tmp_path / "ds"), mmap=False)
    assert [unmapped[i].tolist() for i in range(3)] == [ds[i].tolist() for i in range(3)]
    assert IndexedDataset.exists(str(tmp_path / "ds")) and not IndexedDataset.exists(str(tmp_path / "nope"))


def test_optimal_dtype_follows_megatron():
    assert DType.optimal_dtype(50257) == np.uint16
    assert DType.optimal_dtype(65499) == np.uint16
    assert DType.optimal_dtype(65500) == np.int32
    assert DType.optimal_dtype(128256) == np.int32
    assert DType.code_from_dtype(np.uint16) == 8 and DType.dtype_from_code(7) == np.float32


def test_add_document_and_add_index_give_the_same_bytes(tmp_path):
    build(str(tmp_path / "direct"), docs=DOCS + DOCS)
    builder = IndexedDatasetBuilder(str(tmp_path / "by_document.bin"), dtype=np.uint16)
    for doc in DOCS + DOCS:
        builder.add_document(sum(doc, []), [len(s) for s in doc])
    builder.finalize(str(tmp_path / "by_document.idx"))
    half = build(str(tmp_path / "half"))
    merged = IndexedDatasetBuilder(str(tmp_path / "merged.bin"), dtype=np.uint16)
    merged.add_index(half)
    merged.add_index(half)
    merged.finalize(str(tmp_path / "merged.idx"))
    for other in ("by_document", "merged"):
        for ext in (".bin", ".idx"):
            assert (tmp_path / f"{other}{ext}").read_bytes() == (tmp_path / f"direct{ext}").read_bytes()


def test_add_index_refuses_another_dtype(tmp_path):
    small = build(str(tmp_path / "small"), dtype=np.uint16)
    builder = IndexedDatasetBuilder(str(tmp_path / "big.bin"), dtype=np.int32)
    with pytest.raises(IndexedDatasetError, match="dtype"):
        builder.add_index(small)
    builder.abort()


def test_multimodal_modes_round_trip(tmp_path):
    prefix = build(str(tmp_path / "mm"), multimodal=True)
    ds = IndexedDataset(prefix, multimodal=True)
    assert ds.sequence_modes.tolist() == [0, 1, 0]
    # a reader that is not told about modes still reads the file, ignoring them
    assert IndexedDataset(prefix)[2].tolist() == [9, 10]


def test_token_out_of_dtype_range_is_an_error(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "ds.bin"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match="do not fit"):
        builder.add_item([1, 70000])
    builder.abort()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("cut", [0, 8, 20, 33, 40, 60])
def test_truncated_idx_is_a_clear_error(tmp_path, cut):
    prefix = build(str(tmp_path / "ds"))
    data = (tmp_path / "ds.idx").read_bytes()
    (tmp_path / "ds.idx").write_bytes(data[:cut])
    with pytest.raises(IndexedDatasetError, match=r"ds\.idx is truncated"):
        IndexedDataset(prefix)


def test_corrupted_idx_and_bin_are_clear_errors(tmp_path):
    prefix = build(str(tmp_path / "ds"))
    idx = (tmp_path / "ds.idx").read_bytes()
    (tmp_path / "ds.idx").write_bytes(b"TNTIDX\x00\x00\x00" + idx[9:])
    with pytest.raises(IndexedDatasetError, match="bad magic.*legacy"):
        IndexedDataset(prefix)
    (tmp_path / "ds.idx").write_bytes(idx[:9] + struct.pack("<Q", 2) + idx[17:])
    with pytest.raises(IndexedDatasetError, match="version 2"):
        IndexedDataset(prefix)
    (tmp_path / "ds.idx").write_bytes(idx[:17] + b"\x63" + idx[18:])
    with pytest.raises(IndexedDatasetError, match="unknown dtype code 99"):
        IndexedDataset(prefix)
    (tmp_path / "ds.idx").write_bytes(idx + b"junk")
    with pytest.raises(IndexedDatasetError, match="trailing bytes"):
        IndexedDataset(prefix)
    (tmp_path / "ds.idx").write_bytes(idx)
    bin_bytes = (tmp_path / "ds.bin").read_bytes()
    (tmp_path / "ds.bin").write_bytes(bin_bytes[:-2])
    with pytest.raises(IndexedDatasetError, match=r"ds\.bin has 10 bytes .* 12 bytes \(truncated\)"):
        IndexedDataset(prefix)
    os.remove(tmp_path / "ds.bin")
    with pytest.raises(FileNotFoundError, match=r"ds\.bin"):
        IndexedDataset(prefix)


def test_failed_build_leaves_nothing_and_keeps_old_files(tmp_path):
    prefix = build(str(tmp_path / "ds"))
    before = {name: (tmp_path / name).read_bytes() for name in ("ds.bin", "ds.idx")}
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as builder:
            builder.add_item([1, 2, 3])
            raise RuntimeError("interrupted")
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    # until finalize() nothing appears under the final names
    fresh = IndexedDatasetBuilder(str(tmp_path / "new.bin"), dtype=np.uint16)
    fresh.add_item([1])
    assert not (tmp_path / "new.bin").exists()
    fresh.finalize(str(tmp_path / "new.idx"))
    assert IndexedDataset(str(tmp_path / "new"))[0].tolist() == [1]
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx", "new.bin", "new.idx"]
