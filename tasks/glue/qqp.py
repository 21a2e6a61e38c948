"""QQP (GLUE's TSV files), as Megatron's tasks/glue/qqp.py reads them.

    train.tsv, dev.tsv    6 columns: id, qid1, qid2, question1 (3), question2 (4), is_duplicate (5)
    test.tsv              3 columns: id, question1, question2 (no label: test_label is used)

The header row says which. As Megatron, a training/dev row of another width, or with an empty
question, is skipped with a warning (the real train.tsv has such rows); a bad id or label, and any
malformed test row, raise TaskDataError naming FILE:LINE.
"""

from __future__ import annotations

from typing import Dict, List

from megatron.training.utils import print_rank_0
from tasks.data_utils import TaskDataError, clean_text
from tasks.glue.data import GLUEAbstractDataset, parse_uid, require_text, tsv_rows

LABELS = [0, 1]


class QQPDataset(GLUEAbstractDataset):
    task_name = "QQP"

    def __init__(self, name, datapaths, tokenizer, max_seq_length, test_label: int = 0) -> None:
        self.test_label = test_label
        super().__init__(name, datapaths, tokenizer, max_seq_length)

    def read_rows(self, filename: str) -> List[Dict[str, object]]:
        samples: List[Dict[str, object]] = []
        is_test = False
        for line, row in tsv_rows(filename):
            if line == 1:
                if len(row) not in (3, 6):
                    raise TaskDataError(filename, line, f"the header has {len(row)} columns; a QQP file has 6 "
                                        "(id, qid1, qid2, question1, question2, is_duplicate) or 3 (test: id, "
                                        "question1, question2)")
                is_test = len(row) == 3
                if is_test:
                    print_rank_0(f"   reading {row[0].strip()}, {row[1].strip()}, and {row[2].strip()} columns and "
                                 f"setting labels to {self.test_label}")
                else:
                    print_rank_0(f"    reading {row[0].strip()}, {row[3].strip()}, {row[4].strip()}, and "
                                 f"{row[5].strip()} columns ...")
                continue
            if is_test:
                if len(row) != 3:
                    raise TaskDataError(filename, line, f"{len(row)} columns, a QQP test row has 3")
                uid = parse_uid(filename, line, row[0])
                text_a = require_text(filename, line, clean_text(row[1].strip()), "question1")
                text_b = require_text(filename, line, clean_text(row[2].strip()), "question2")
                label = self.test_label
            else:
                if len(row) != 6:
                    print_rank_0(f"***WARNING*** index error, skipping: {row} ({filename}:{line})")
                    continue
                uid = parse_uid(filename, line, row[0])
                text_a, text_b = clean_text(row[3].strip()), clean_text(row[4].strip())
                if not text_a or not text_b:
                    print_rank_0(f"***WARNING*** zero length {'a' if not text_a else 'b'}, skipping: {row} "
                                 f"({filename}:{line})")
                    continue
                try:
                    label = int(row[5].strip())
                except ValueError:
                    label = row[5].strip()
            if label not in LABELS:
                raise TaskDataError(filename, line, f"is_duplicate is {label!r}, not 0 or 1")
            samples.append({"uid": uid, "text_a": text_a, "text_b": text_b, "label": label})
        return samples
