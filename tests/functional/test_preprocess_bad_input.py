"""tools/preprocess_data.py on inputs without documents, or not UTF-8: one error naming the file
(and line), and an existing dataset under the output prefix left as it was."""
import gzip
import os

import pytest

from tests.helpers.data import files_bytes, null_args, read_documents, write_jsonl
from tools import preprocess_data
from tools.preprocess_data import PreprocessError

EMPTY = {
    "empty": ("", r"in\.jsonl: no documents to write \(the file is empty\); nothing was written"),
    "blank": ("\n  \n\n", r"no documents to write \(only 3 blank lines\)"),
    "all_skipped": ('{"body": "1"}\n\n{oops\n', r"no documents to write \(only 1 blank lines and 2 bad lines "
                                                r"skipped\)"),
}


@pytest.mark.parametrize("case", sorted(EMPTY))
@pytest.mark.parametrize("workers,partitions", [(1, 1), (2, 2)])
def test_no_documents_is_an_error_that_keeps_the_existing_dataset(tmp_path, case, workers, partitions):
    write_jsonl(tmp_path / "good.jsonl", ["1 2 3", "4"])
    preprocess_data.main(null_args(tmp_path / "good.jsonl", tmp_path / "x"))
    before = files_bytes(tmp_path / "x_text_document")
    content, message = EMPTY[case]
    (tmp_path / "in.jsonl").write_text(content)
    with pytest.raises(PreprocessError, match="--input .*" + message):
        preprocess_data.main(null_args(tmp_path / "in.jsonl", tmp_path / "x", "--skip-bad-lines",
                                       "--partitions", str(partitions), workers=workers))
    assert files_bytes(tmp_path / "x_text_document") == before
    assert sorted(os.listdir(tmp_path)) == ["good.jsonl", "in.jsonl", "x_text_document.bin", "x_text_document.idx"]


NOT_UTF8 = b'{"text": "1 2"}\n{"text": "3"}\n{"text": "caf\xe9"}\n{"text": "4"}\n'  # latin-1 e-acute


@pytest.mark.parametrize("workers,partitions", [(1, 1), (2, 2)])
def test_non_utf8_line_is_named(tmp_path, workers, partitions):
    (tmp_path / "in.jsonl").write_bytes(NOT_UTF8)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(PreprocessError, match=r"in\.jsonl:3: not valid UTF-8 \(byte 0xe9 at byte 14 of the line\)"):
        preprocess_data.main(null_args(tmp_path / "in.jsonl", out / "x", "--partitions", str(partitions),
                                       workers=workers))
    assert os.listdir(out) == []


def test_non_utf8_lines_can_be_skipped_and_gzip_is_read_the_same(tmp_path, capsys):
    with gzip.open(tmp_path / "in.jsonl.gz", "wb") as f:
        f.write(NOT_UTF8)
    result = preprocess_data.main(null_args(tmp_path / "in.jsonl.gz", tmp_path / "x", "--skip-bad-lines"))
    assert result.skipped_lines == 1 and result.documents == 3
    assert read_documents(tmp_path / "x_text_document") == [[[1, 2]], [[3]], [[4]]]
    assert "in.jsonl.gz:3: not valid UTF-8" in capsys.readouterr().err
