"""MNLI (GLUE's TSV files), as Megatron's tasks/glue/mnli.py reads them.

    train.tsv, dev_matched.tsv, dev_mismatched.tsv   12 columns (dev: 16): index, promptID, pairID,
        genre, sentence1_binary_parse, sentence2_binary_parse, sentence1_parse, sentence2_parse,
        sentence1 (8), sentence2 (9), [label1 .. label5,] gold_label (last)
    test_matched.tsv, test_mismatched.tsv            10 columns: no labels (test_label is used)

The header row says which: 10 columns is a test file. text_a is column 8, text_b column 9, the uid
column 0, the label the last column. A bad row raises TaskDataError naming FILE:LINE (Megatron
asserts).
"""

from __future__ import annotations

from typing import Dict, List

from megatron.training.utils import print_rank_0
from tasks.data_utils import TaskDataError, clean_text
from tasks.glue.data import GLUEAbstractDataset, parse_uid, require_text, tsv_rows

LABELS = {"contradiction": 0, "entailment": 1, "neutral": 2}
TEST_COLUMNS = 10


class MNLIDataset(GLUEAbstractDataset):
    task_name = "MNLI"

    def __init__(self, name, datapaths, tokenizer, max_seq_length, test_label: str = "contradiction") -> None:
        self.test_label = test_label
        super().__init__(name, datapaths, tokenizer, max_seq_length)

    def read_rows(self, filename: str) -> List[Dict[str, object]]:
        samples: List[Dict[str, object]] = []
        columns, is_test = 0, False
        for line, row in tsv_rows(filename):
            if line == 1:
                columns, is_test = len(row), len(row) == TEST_COLUMNS
                if columns < TEST_COLUMNS:
                    raise TaskDataError(filename, line, f"the header has {columns} columns; an MNLI file has "
                                        f"{TEST_COLUMNS} (test) or more (index ... sentence1, sentence2, ... gold_label)")
                if is_test:
                    print_rank_0(f"   reading {row[0].strip()}, {row[8].strip()} and {row[9].strip()} columns and "
                                 f"setting labels to {self.test_label}")
                else:
                    print_rank_0(f"    reading {row[0].strip()} , {row[8].strip()}, {row[9].strip()}, and "
                                 f"{row[-1].strip()} columns ...")
                continue
            if len(row) != columns:
                raise TaskDataError(filename, line, f"{len(row)} columns, the header has {columns}")
            label = self.test_label if is_test else row[-1].strip()
            if label not in LABELS:
                raise TaskDataError(filename, line, f"label {label!r} is not one of {', '.join(LABELS)}")
            samples.append({"text_a": require_text(filename, line, clean_text(row[8].strip()), "sentence1"),
                            "text_b": require_text(filename, line, clean_text(row[9].strip()), "sentence2"),
                            "label": LABELS[label], "uid": parse_uid(filename, line, row[0])})
        return samples
