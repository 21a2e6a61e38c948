"""The fine-tuning tasks' readers: Megatron's [CLS] a [SEP] b [SEP] layout (tasks/data_utils.py),
the GLUE MNLI/QQP TSV shapes (train/dev/test), RACE's JSON directories, Megatron's set names, and
the FILE:LINE message of every malformed row."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tasks.data_utils import TaskDataError, build_tokens_types_paddings_from_ids, clean_text
from tasks.glue.finetune import _name_after
from tasks.glue.mnli import MNLIDataset
from tasks.glue.qqp import QQPDataset
from tasks.race.data import RaceDataset

CLS, SEP, PAD = 1, 2, 0


class WordTokenizer:
    """One id per word: 10 + its index in first-seen order."""

    cls, sep, pad = CLS, SEP, PAD

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def tokenize(self, text: str) -> list[int]:
        return [self.ids.setdefault(word, 10 + len(self.ids)) for word in text.split()]


@pytest.mark.parametrize("a, b, length, ids, types, paddings", [
    ([5, 6], [7], 8, [1, 5, 6, 2, 7, 2, 0, 0], [0, 0, 0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]),
    ([5, 6], [7, 8, 9, 10], 6, [1, 5, 6, 2, 7, 2], [0, 0, 0, 0, 1, 1], [1] * 6),  # b cut, [SEP] kept
    ([5], [7, 8], 5, [1, 5, 2, 7, 2], [0, 0, 0, 1, 1], [1] * 5),  # exactly full: cut by one as Megatron
    ([5, 6], None, 6, [1, 5, 6, 2, 0, 0], [0] * 6, [1, 1, 1, 1, 0, 0]),
    ([5, 6, 7, 8, 9], None, 4, [1, 5, 6, 2], [0, 0, 0, 0], [1] * 4),  # a alone cut: [SEP] of type 0
], ids=["fits", "b-cut", "exactly-full", "no-b", "a-cut"])
def test_layout_is_megatrons(a, b, length, ids, types, paddings):
    assert build_tokens_types_paddings_from_ids(a, b, length, CLS, SEP, PAD) == (ids, types, paddings)


def test_padding_takes_the_pad_id_as_its_type_and_clean_text():
    _, types, _ = build_tokens_types_paddings_from_ids([5], [6], 6, CLS, SEP, 3)
    assert types == [0, 0, 0, 1, 1, 3]  # Megatron's (the pad id, not 0)
    assert clean_text("a\nb   c . d . e") == "a b c. d. e"


MNLI_HEAD = ["index", "promptID", "pairID", "genre", "s1_binary", "s2_binary", "s1_parse", "s2_parse",
             "sentence1", "sentence2"]


def _tsv(path, rows):
    path.write_text("".join("\t".join(row) + "\n" for row in rows))
    return str(path)


def _mnli_row(i, a, b, *labels):
    return [str(i), "1", "1e", "fiction", "(a)", "(b)", "(a)", "(b)", a, b, *labels]


def test_mnli_train_dev_and_test_shapes(tmp_path):
    tok = WordTokenizer()
    train = _tsv(tmp_path / "train.tsv", [MNLI_HEAD + ["label1", "gold_label"],
                                          _mnli_row(7, "a  b", "c", "neutral", "neutral"),
                                          _mnli_row(8, "d", "e", "entailment", "contradiction")])
    dev = _tsv(tmp_path / "dev_matched.tsv", [MNLI_HEAD + [f"label{i}" for i in range(1, 6)] + ["gold_label"],
                                              _mnli_row(3, "a", "b", *["entailment"] * 6)])
    test = _tsv(tmp_path / "test_matched.tsv", [MNLI_HEAD, _mnli_row(0, "x", "y")])
    data = MNLIDataset("training", [train, dev], tok, 8)
    assert [(s["uid"], s["label"], s["text_a"]) for s in data.samples] == [(7, 2, "a b"), (8, 0, "d"), (3, 1, "a")]
    sample = data[0]
    assert sample["text"].tolist() == [CLS, 10, 11, SEP, 12, SEP, PAD, PAD] and sample["text"].dtype == np.int64
    assert sample["padding_mask"].tolist() == [1] * 6 + [0, 0] and sample["label"] == 2
    assert [s["label"] for s in MNLIDataset("test", [test], tok, 8).samples] == [0]  # test_label contradiction


@pytest.mark.parametrize("row, message", [
    (_mnli_row(1, "a", "b", "maybe", "maybe"), "label 'maybe' is not one of contradiction, entailment, neutral"),
    (_mnli_row(1, "a", "b", "neutral"), "11 columns, the header has 12"),
    (_mnli_row("x", "a", "b", "neutral", "neutral"), "the id column is 'x', not an integer"),
    (_mnli_row(1, " ", "b", "neutral", "neutral"), "sentence1 is empty"),
], ids=["label", "columns", "id", "empty"])
def test_mnli_malformed_rows_name_file_and_line(tmp_path, row, message):
    path = _tsv(tmp_path / "train.tsv", [MNLI_HEAD + ["label1", "gold_label"],
                                         _mnli_row(0, "a", "b", "neutral", "neutral"), row])
    with pytest.raises(TaskDataError) as error:
        MNLIDataset("training", [path], WordTokenizer(), 8)
    assert str(error.value) == f"{path}:3: {message}"


def test_qqp_train_skips_short_rows_and_test_has_three_columns(tmp_path, capsys):
    tok = WordTokenizer()
    train = _tsv(tmp_path / "train.tsv", [["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
                                          ["5", "1", "2", "a b", "c", "1"], ["6", "3", "4", "a"],
                                          ["7", "5", "6", "", "c", "0"], ["8", "7", "8", "d", "e", "0"]])
    data = QQPDataset("training", [train], tok, 8)
    assert [(s["uid"], s["label"]) for s in data.samples] == [(5, 1), (8, 0)]
    out = capsys.readouterr().out
    assert f"***WARNING*** index error, skipping: ['6', '3', '4', 'a'] ({train}:3)" in out
    assert f"zero length a, skipping" in out
    test = _tsv(tmp_path / "test.tsv", [["id", "question1", "question2"], ["0", "a", "b"], ["1", "c", "d"]])
    assert [(s["uid"], s["label"], s["text_b"]) for s in QQPDataset("test", [test], tok, 8).samples] == \
        [(0, 0, "b"), (1, 0, "d")]
    bad = _tsv(tmp_path / "bad_test.tsv", [["id", "question1", "question2"], ["0", "a", "b"], ["1", "c"]])
    with pytest.raises(TaskDataError, match=f"^{bad}:3: 2 columns, a QQP test row has 3$"):
        QQPDataset("test", [bad], tok, 8)
    label = _tsv(tmp_path / "bad.tsv", [["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
                                        ["5", "1", "2", "a", "c", "yes"]])
    with pytest.raises(TaskDataError, match=f"^{label}:2: is_duplicate is 'yes', not 0 or 1$"):
        QQPDataset("training", [label], tok, 8)
    header = _tsv(tmp_path / "header.tsv", [["id", "question1"]])
    with pytest.raises(TaskDataError, match=f"^{header}:1: the header has 2 columns"):
        QQPDataset("training", [header], tok, 8)


def _race_dir(tmp_path, lines):
    directory = tmp_path / "RACE" / "dev" / "middle"
    directory.mkdir(parents=True)
    (directory / "1.txt").write_text("".join(lines))
    return str(directory)


def _document(**changes):
    document = {"article": "the cat sat", "questions": ["who sat ?", "the _ sat"],
                "options": [["cat", "dog", "cow", "hen"], ["cat", "dog", "cow", "hen"]], "answers": ["A", "C"],
                "id": "middle1.txt"}
    document.update(changes)
    return json.dumps(document) + "\n"


def test_race_samples_hold_one_row_per_choice(tmp_path):
    tok = WordTokenizer()
    directory = _race_dir(tmp_path, [_document()])
    data = RaceDataset("dev-middle", [directory], tok, 10)
    assert len(data) == 2 and data.sample_multiplier == 4
    first, second = data[0], data[1]
    assert first["text"].shape == (4, 10) and first["label"] == 0 and second["label"] == 2
    assert [first["uid"], second["uid"]] == [0, 1]
    ids = tok.ids
    # [CLS] question+choice [SEP] article [SEP]; "_" replaced by the choice in the second question
    assert first["text"][1].tolist() == [CLS, ids["who"], ids["sat"], ids["?"], ids["dog"], SEP, ids["the"],
                                         ids["cat"], ids["sat"], SEP]
    assert second["text"][2].tolist()[:5] == [CLS, ids["the"], ids["cow"], ids["sat"], SEP]
    assert first["types"][0].tolist() == [0] * 6 + [1] * 4
    assert _name_after("MNLI")("data/MNLI/dev_mismatched.tsv") == "dev-mismatched"
    assert _name_after("QQP")("data/QQP/dev.tsv") == "de"  # Megatron's strip(".tsv") takes the 'v' too


@pytest.mark.parametrize("line, message", [
    ("{not json\n", "not JSON: Expecting property name enclosed in double quotes (column 2)"),
    (_document(answers=["A", "E"]), "question 1: answer 'E' is not one of A-D"),
    (_document(options=[["a", "b", "c"], ["a", "b", "c", "d"]]), "question 0: 'options' must be 4 strings"),
    (_document(answers=["A"]), "'questions', 'options' and 'answers' must be lists of one length, got [2, 2, 1]"),
    (json.dumps({"article": "x"}) + "\n", "no 'questions', 'options', 'answers' (a RACE document has article, "
                                          "questions, options, answers)"),
], ids=["json", "answer", "options", "lengths", "keys"])
def test_race_malformed_lines_name_file_and_line(tmp_path, line, message):
    directory = _race_dir(tmp_path, [_document(), line])
    with pytest.raises(TaskDataError) as error:
        RaceDataset("dev", [directory], WordTokenizer(), 16)
    assert str(error.value) == f"{directory}/1.txt:2: {message}"


def test_race_needs_a_directory_of_txt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        RaceDataset("dev", [str(tmp_path / "nope")], WordTokenizer(), 16)
    with pytest.raises(FileNotFoundError, match=r"holds no \*.txt files"):
        RaceDataset("dev", [str(tmp_path)], WordTokenizer(), 16)
