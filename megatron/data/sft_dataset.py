"""SFTDataset: chat conversations from JSON lines, tokenized on the fly and packed (--sft).

Input, one JSON value per line (Megatron-LM's SFT format, or an OpenAI-style message list):

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
    [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]

Roles are system, user and assistant; content is a string. A line may hold several
conversations one after the other: each system message starts a new one (Megatron-LM's
rule). Every conversation needs an assistant message, and its first message after the
system one is the user's. Blank lines are skipped. The whole file is checked when it is
opened (open_sft_file, already while the flags are checked): a malformed line stops the run
with `FILE:LINE: reason`.

Sample i is one line (the lines of the split in a seeded shuffle per epoch, as many epochs as
the samples need). Its conversations are tokenized in the data loader's workers through the
chat template (sft_conversation.py) and packed one after the other into sequence_length + 1
tokens:

    key           shape          what
    tokens        [s] int64      the packed ids, then padding (the tokenizer's pad, else eod)
    labels        [s] int64      tokens shifted by one
    loss_mask     [s] float32    1 where the label is an assistant token of the same conversation
    position_ids  [s] int64      restarting at 0 for each conversation (padding continues the last)
    cu_seqlens    [s + 1] int32  conversation boundaries 0, e1, ..., s, then s repeated (Megatron-LM's:
                                 the padding belongs to the last conversation)
    max_seqlen    [] int32       the longest conversation

The model attends within each conversation only (megatron/model/packed_seq.py), so each
conversation of a packed sample gets the loss and gradients it gets alone. Overflow policy
(Megatron-LM's): conversations are packed in the line's order; the one that crosses
sequence_length + 1 tokens is cut on the right and the line's remaining conversations are
dropped (write long conversations one per line, or raise --seq-length).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from megatron.data.dataset_config import GPTDatasetConfig
from megatron.data.indexed_dataset import IndexedDatasetError
from megatron.data.sft_conversation import ROLES, tokenize_conversation
from megatron.data.utils import Split

Conversation = List[Dict[str, str]]


class SFTDataError(IndexedDatasetError):
    """A malformed line of an SFT JSON-lines file; the message is `FILE:LINE: reason`."""


@dataclass(frozen=True)
class SFTDatasetConfig(GPTDatasetConfig):
    """GPTDatasetConfig plus the chat template (a Jinja string) the conversations are rendered with."""

    chat_template: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mock:
            raise ValueError("SFT data has no mock form: give --data-path with JSON-lines files")
        if not isinstance(self.chat_template, str) or not self.chat_template:
            raise ValueError("SFTDatasetConfig needs a chat_template")
        if self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss:
            raise ValueError("SFT data makes its own masks and positions: no reset_position_ids, "
                             "reset_attention_mask or eod_mask_loss")


def split_conversations(messages: Conversation) -> List[Conversation]:
    """A line's messages cut before each system message (Megatron-LM's rule)."""
    conversations: List[Conversation] = []
    for message in messages:
        if message["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append(message)
    return conversations


def parse_line(text: str) -> List[Conversation]:
    """The conversations of one JSON line; ValueError(reason) when it is malformed."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if isinstance(value, dict):
        if "messages" not in value:
            raise ValueError('a JSON object needs a "messages" list')
        value = value["messages"]
    if not isinstance(value, list) or not value:
        raise ValueError('"messages" must be a non-empty list of {"role": ..., "content": ...} objects')
    for n, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ValueError(f"message {n}: needs a role, one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {n} ({message['role']}): content must be a string")
    conversations = split_conversations(value)
    for c, conversation in enumerate(conversations):
        turns = [m["role"] for m in conversation if m["role"] != "system"]
        if "assistant" not in turns:
            raise ValueError(f"conversation {c}: no assistant message (nothing to train on)")
        if turns[0] != "user":
            raise ValueError(f"conversation {c}: the first message after the system prompt must be the user's")
    return conversations


class SFTLowLevelDataset:
    """The lines of a JSON-lines file, checked once, read back by byte offset (os.pread)."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise SFTDataError(f"{path}: no such SFT data file (--data-path names JSON-lines files with --sft)")
        self.path = path
        offsets, lengths = [], []
        with open(path, "rb") as f:
            position = 0
            for number, raw in enumerate(f, start=1):
                if raw.strip():
                    try:  # a UnicodeDecodeError is a ValueError too
                        parse_line(raw.decode("utf-8"))
                    except ValueError as err:
                        raise SFTDataError(f"{path}:{number}: {err}") from None
                    offsets.append(position)
                    lengths.append(len(raw))
                position += len(raw)
        if not offsets:
            raise SFTDataError(f"{path}: no conversations in the file")
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self._fd: Optional[int] = None
        self._pid: Optional[int] = None

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def __getitem__(self, idx: int) -> List[Conversation]:
        if self._fd is None or self._pid != os.getpid():  # each data-loader worker opens its own
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        raw = os.pread(self._fd, int(self.lengths[idx]), int(self.offsets[idx]))
        return parse_line(raw.decode("utf-8"))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None, "_pid": None}


_OPENED: Dict[tuple, SFTLowLevelDataset] = {}  # (path, size, mtime) -> its checked line index


def open_sft_file(path: str) -> SFTLowLevelDataset:
    """The file's SFTLowLevelDataset, checked once per process: validating the flags opens every
    --data-path file (so a malformed line stops the run before the model is built) and the
    dataset builder reuses what it found unless the file changed since."""
    try:
        stat = os.stat(path)
    except OSError:
        return SFTLowLevelDataset(path)  # its own error names the file
    key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    if key not in _OPENED:
        for stale in [k for k in _OPENED if k[0] == key[0]]:  # the file changed: forget its old index
            del _OPENED[stale]
        _OPENED[key] = SFTLowLevelDataset(path)
    return _OPENED[key]


def pack(conversations: List[tuple], sequence_length: int, pad: int) -> Dict[str, torch.Tensor]:
    """Tokenized conversations [(ids, loss flags)] -> one packed sample (the module docstring)."""
    total = sequence_length + 1  # inputs and labels overlap by one token
    ids = np.full(total, pad, dtype=np.int64)
    trained = np.zeros(total, dtype=bool)
    positions = np.zeros(total, dtype=np.int64)
    bounds, filled = [0], 0
    for conversation_ids, conversation_loss in conversations:
        take = min(len(conversation_ids), total - filled)
        if take <= 0:
            break  # the line's remaining conversations do not fit: dropped
        ids[filled:filled + take] = conversation_ids[:take]
        trained[filled:filled + take] = conversation_loss[:take]
        positions[filled:filled + take] = np.arange(take)
        filled += take
        bounds.append(min(filled, sequence_length))
    if filled < total:  # padding continues the last conversation's positions
        positions[filled:] = positions[filled - 1] + 1 + np.arange(total - filled) if filled else np.arange(total)
    bounds[-1] = sequence_length
    bounds = [b for i, b in enumerate(bounds) if i == 0 or b > bounds[i - 1]]  # drop empty tail segments
    loss_mask = trained[1:].astype(np.float32)
    loss_mask[np.asarray(bounds[1:-1], dtype=np.int64) - 1] = 0.0  # no label across a conversation boundary
    cu_seqlens = np.full(sequence_length + 1, sequence_length, dtype=np.int32)
    cu_seqlens[:len(bounds)] = bounds
    return {
        "tokens": torch.from_numpy(ids[:-1].copy()),
        "labels": torch.from_numpy(ids[1:].copy()),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(positions[:-1].copy()),
        "cu_seqlens": torch.from_numpy(cu_seqlens),
        "max_seqlen": torch.tensor(int(np.diff(bounds).max()), dtype=torch.int32),
    }


class SFTDataset(torch.utils.data.Dataset):
    """Packed chat samples of one split of an SFT JSON-lines file (the module docstring).

    Same constructor as GPTDataset, so BlendedMegatronDatasetBuilder builds, splits and blends it.
    """

    def __init__(self, low_level: SFTLowLevelDataset, dataset_path: Optional[str], indices: np.ndarray,
                 num_samples: Optional[int], index_split: Split, config: SFTDatasetConfig) -> None:
        super().__init__()
        self.dataset = low_level
        self.dataset_path = dataset_path
        self.indices = np.asarray(indices, dtype=np.int64)
        self.index_split = Split[index_split] if isinstance(index_split, str) else index_split
        self.config = config
        self.num_samples = len(self.indices) if num_samples is None else int(num_samples)
        self.pad = _pad_id(config.tokenizer)
        self.unique_identifiers = OrderedDict([
            ("class", type(self).__name__), ("dataset_path", dataset_path), ("num_samples", self.num_samples),
            ("index_split", self.index_split.name), ("random_seed", config.random_seed),
            ("sequence_length", config.sequence_length), ("split", config.split),
            ("lines", [int(self.indices[0]), int(self.indices[-1]) + 1] if len(self.indices) else []),
            ("chat_template", config.chat_template)])
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        self.shuffle_index = self._shuffle_index()

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: SFTDatasetConfig) -> SFTLowLevelDataset:
        return open_sft_file(dataset_path)

    @staticmethod
    def numel_low_level_dataset(low_level: SFTLowLevelDataset) -> int:
        return len(low_level)

    def _shuffle_index(self) -> np.ndarray:
        """[num_samples] positions into self.indices: a fresh seeded permutation per epoch."""
        lines = len(self.indices)
        if lines == 0:
            return np.zeros(0, dtype=np.int64)
        rng = np.random.RandomState(self.config.random_seed)
        epochs = -(-self.num_samples // lines)
        return np.concatenate([rng.permutation(lines) for _ in range(epochs)])[:self.num_samples]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        line = int(self.indices[self.shuffle_index[int(idx)]])
        conversations = self.dataset[line]
        tokenizer, template = self.config.tokenizer, self.config.chat_template
        tokenized = [tokenize_conversation(tokenizer, template, c) for c in conversations]
        return pack(tokenized, self.config.sequence_length, self.pad)


def _pad_id(tokenizer: Any) -> int:
    for role in ("pad", "eod"):
        try:
            value = getattr(tokenizer, role)
        except (AttributeError, NotImplementedError, KeyError, ValueError):
            continue
        if isinstance(value, int):
            return value
    raise ValueError("SFT data needs a tokenizer with a pad or an eod token (for the padding)")
