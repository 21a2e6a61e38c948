"""What the fine-tuning tasks' readers share (Megatron's tasks/data_utils.py): text clean-up, the
[CLS] a [SEP] b [SEP] layout with its types and padding, the sample dict, and TaskDataError.

A sample (numpy int64; RACE's hold one row per choice, [choices, seq_length]):
    text          [CLS] a [SEP] b [SEP] then pad ids        [seq_length]
    types         0 on [CLS] a [SEP], 1 on b [SEP], pad id on the padding (Megatron's)
    padding_mask  1 on the real tokens, 0 on the padding
    label         int; uid: int (the row's id)
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from tasks.errors import TaskError


class TaskDataError(TaskError):
    """A malformed task data file: the message starts with FILE:LINE (megatron/training/cli.py prints it as one line)."""

    def __init__(self, filename: str, line: int, message: str) -> None:
        super().__init__(f"{filename}:{line}: {message}")
        self.filename, self.line = filename, line


def clean_text(text: str) -> str:
    """New lines and runs of whitespace to one space; ' . ' to '. ' (Megatron's clean_text)."""
    text = text.replace("\n", " ")
    text = re.sub(r"\s+", " ", text)
    for _ in range(3):
        text = text.replace(" . ", ". ")
    return text


def build_sample(ids, types, paddings, label: int, unique_id: int) -> Dict[str, object]:
    return {"text": np.array(ids, dtype=np.int64), "types": np.array(types, dtype=np.int64),
            "padding_mask": np.array(paddings, dtype=np.int64), "label": int(label), "uid": int(unique_id)}


def build_tokens_types_paddings_from_text(text_a: str, text_b: Optional[str], tokenizer,
                                          max_seq_length: int) -> Tuple[List[int], List[int], List[int]]:
    """Tokenize a (and b) and lay them out as build_tokens_types_paddings_from_ids does."""
    a_ids = tokenizer.tokenize(text_a)
    b_ids = tokenizer.tokenize(text_b) if text_b is not None else None
    return build_tokens_types_paddings_from_ids(a_ids, b_ids, max_seq_length, tokenizer.cls, tokenizer.sep,
                                                tokenizer.pad)


def build_tokens_types_paddings_from_ids(a_ids: Sequence[int], b_ids: Optional[Sequence[int]], max_seq_length: int,
                                         cls_id: int, sep_id: int, pad_id: int
                                         ) -> Tuple[List[int], List[int], List[int]]:
    """[CLS] a [SEP] b [SEP], cut to max_seq_length - 1 tokens and ended by [SEP] when too long (so the
    cut falls in b, or in a when a alone is too long), then padded; Megatron's exact rules, including
    the pad id as the padding's token type."""
    ids = [cls_id] + list(a_ids) + [sep_id]
    types = [0] * len(ids)
    if b_ids is not None:
        ids += list(b_ids)
        types += [1] * len(b_ids)
    trimmed = len(ids) >= max_seq_length
    if trimmed:
        ids, types = ids[:max_seq_length - 1], types[:max_seq_length - 1]
    if b_ids is not None or trimmed:
        ids.append(sep_id)
        types.append(0 if b_ids is None else 1)
    paddings = [1] * len(ids)
    padding = max_seq_length - len(ids)
    if padding > 0:
        ids += [pad_id] * padding
        types += [pad_id] * padding
        paddings += [0] * padding
    return ids, types, paddings
