"""Zero-shot datasets: WikiText-103's sliding windows and LAMBADA's last words (Megatron-LM's).

Every sample is seq_length + 1 token ids (`text`, padded with the EOD id) and a 0/1 mask over its
seq_length targets (`pad_mask`: which next-token predictions count).

| dataset | sample idx | counted targets |
|---|---|---|
| LMDataset (WIKITEXT103), stride o | tokens[idx*o : idx*o + s + 1] | window 0: all of its s; window idx > 0: its last o (each target once, with s - o tokens of context before it); padding never |
| LambadaDataset | context + target, padded | the target's tokens: the last token, or with --strict-lambada every token of the last word |

Windows: len = max(ceil((T - 1 - o) / o) + 1, 1) for T tokens and stride o (Megatron's count;
with o < s the last windows may hold no target left to count, and count nothing).
"""

from __future__ import annotations

import json
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from tasks.errors import TaskError
from tasks.zeroshot_gpt.detokenizer import get_detokenizer, wikitext_detokenizer


class LMDataset:
    """Sliding windows over one token stream; stride None means non-overlapping (stride = seq_len)."""

    def __init__(self, tokens: Sequence[int], seq_len: int, pad_idx: int, num_original_tokens: int,
                 num_tokenized_tokens: int, overlapping_eval: Optional[int] = None) -> None:
        self.tokens = list(tokens)
        self.seq_len = seq_len
        self.pad_idx = pad_idx
        self.stride = max(1, seq_len if overlapping_eval is None else overlapping_eval)
        self.num_original_tokens = num_original_tokens
        self.num_tokenized_tokens = num_tokenized_tokens
        total_targets = len(self.tokens) - 1
        targets = max(total_targets - self.stride, 0)  # the first window's (Megatron subtracts the stride)
        self.total_sequences = max(math.ceil(targets / self.stride) + 1, 1)

    def __len__(self) -> int:
        return self.total_sequences

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        start = idx * self.stride
        tokens = self.tokens[start:start + self.seq_len + 1]
        pad_mask = [1] * len(tokens)
        if len(tokens) < self.seq_len + 1:
            num_pad = self.seq_len + 1 - len(tokens)
            pad_mask += [0] * num_pad
            tokens = tokens + [self.pad_idx] * num_pad
        mask = np.array(pad_mask[1:], dtype=np.int64)  # [s]: one per target (the next token)
        if self.stride != self.seq_len and idx != 0:
            mask[:-self.stride] = 0  # the earlier targets were scored by the previous windows
        return {"text": np.array(tokens, dtype=np.int64), "pad_mask": mask}


class LambadaDataset:
    """LAMBADA JSON lines ({"text": ...}): context tokens, then the target tokens to predict."""

    def __init__(self, path: str, pad_idx: int, tokenizer, seq_len: int, strict: bool = False) -> None:
        self.seq_len = seq_len
        self.pad_idx = pad_idx
        self.tokenizer = tokenizer
        self.strict = strict
        self.tokens: List[List[int]] = []
        self.labels: List[List[int]] = []
        for line_number, text in read_jsonl_texts(path):
            tokens, labels = self.get_tokens(text)
            if not tokens or not labels:
                raise TaskError(f"{path}:{line_number}: the text gives no context before its last "
                                f"{'word' if strict else 'token'}")
            if len(tokens) + len(labels) > seq_len + 1:
                raise TaskError(f"{path}:{line_number}: the text has {len(tokens) + len(labels)} tokens, more "
                                f"than --seq-length + 1 ({seq_len + 1})")
            self.tokens.append(tokens)
            self.labels.append(labels)

    def get_tokens(self, text: str) -> Tuple[List[int], List[int]]:
        """(context, target): the last token, or (strict) the last whitespace word, tokenized after
        a space, and the text before it (stripped)."""
        if not self.strict:
            tokens = self.tokenizer.tokenize(text)
            return tokens[:-1], tokens[-1:]
        last_word = text.split()[-1]
        start = text.rfind(last_word)
        return self.tokenizer.tokenize(text[:start].strip()), self.tokenizer.tokenize(" " + last_word)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        tokens, labels = self.tokens[idx], self.labels[idx]
        pad_mask = [0] * len(tokens) + [1] * len(labels)
        tokens = tokens + labels
        num_pad = self.seq_len + 1 - len(tokens)
        pad_mask += [0] * num_pad
        tokens = tokens + [self.pad_idx] * num_pad
        return {"text": np.array(tokens, dtype=np.int64), "pad_mask": np.array(pad_mask[1:], dtype=np.int64)}


def read_jsonl_texts(path: str) -> List[Tuple[int, str]]:
    """(line number, text) of each non-blank line of a JSON-lines file; TaskError naming FILE:LINE."""
    texts = []
    with open_valid_data(path) as reader:
        for line_number, line in enumerate(reader, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise TaskError(f"{path}:{line_number}: not valid JSON ({error.msg}, column {error.colno})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise TaskError(f"{path}:{line_number}: expected a JSON object with a \"text\" string")
            if not record["text"].split():
                raise TaskError(f"{path}:{line_number}: the \"text\" is empty")
            texts.append((line_number, record["text"]))
    if not texts:
        raise TaskError(f"--valid-data {path}: no examples (every line is blank)")
    return texts


def open_valid_data(path: str, mode: str = "r"):
    try:
        return open(path, mode) if "b" in mode else open(path, mode, encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError, PermissionError) as error:
        raise TaskError(f"--valid-data {path}: {error.strerror}") from None


def one_valid_file(args, task: str) -> str:
    if not args.valid_data or len(args.valid_data) != 1:
        raise TaskError(f"--task {task} needs --valid-data with exactly one file "
                        f"(got {len(args.valid_data or [])})")
    return args.valid_data[0]


def count_original_tokens(text: str) -> int:
    """WikiText's word count as Megatron takes it: the text split on single spaces (after strip)."""
    return len(text.strip().split(" "))


def build_wikitext103_dataset(args, tokenizer, log=print) -> LMDataset:
    path = one_valid_file(args, "WIKITEXT103")
    with open_valid_data(path, "rb") as reader:  # bytes, as Megatron reads it: "\r\n" stays
        data = reader.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TaskError(f"--valid-data {path}: not UTF-8 text (byte {error.start})") from None
    num_original_tokens = count_original_tokens(text)
    detokenizer = get_detokenizer(path)
    if detokenizer is None:  # Megatron fails here; the task's own detokenizer is the useful choice
        log(f" > {path} names no detokenizer (ptb, wiki, lambada): using the wikitext detokenizer")
        detokenizer = wikitext_detokenizer
    tokens = tokenizer.tokenize(detokenizer(text))
    if len(tokens) < 2:
        raise TaskError(f"--valid-data {path}: {len(tokens)} token(s), at least 2 are needed to score one")
    log(f" > number of original tokens: {num_original_tokens}, number of detokenized tokens: {len(tokens)}")
    return LMDataset(tokens, args.seq_length, tokenizer.eod, num_original_tokens, len(tokens), args.overlapping_eval)


def build_lambada_dataset(args, tokenizer, log=print) -> LambadaDataset:
    path = one_valid_file(args, "LAMBADA")
    log(f"> building lambada dataset from {path} ...")
    dataset = LambadaDataset(path, tokenizer.eod, tokenizer, args.seq_length, args.strict_lambada)
    log(f" > found {len(dataset)} samples.")
    return dataset
