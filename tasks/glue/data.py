"""GLUEAbstractDataset: the rows of one or more GLUE TSV files, tokenized on access (Megatron's
tasks/glue/data.py). A subclass reads one file (read_rows) into {'text_a', 'text_b', 'label', 'uid'}."""

from __future__ import annotations

from typing import Dict, Iterator, List, Sequence, Tuple

from torch.utils.data import Dataset

from megatron.training.utils import print_rank_0
from tasks.data_utils import TaskDataError, build_sample, build_tokens_types_paddings_from_text


def tsv_rows(filename: str) -> Iterator[Tuple[int, List[str]]]:
    """(line number from 1, the stripped line split at tabs) of every line of a TSV file."""
    with open(filename, "r", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            yield number, line.strip().split("\t")


def parse_uid(filename: str, line: int, text: str) -> int:
    try:
        uid = int(text.strip())
    except ValueError:
        raise TaskDataError(filename, line, f"the id column is {text.strip()!r}, not an integer") from None
    if uid < 0:
        raise TaskDataError(filename, line, f"the id {uid} is negative")
    return uid


class GLUEAbstractDataset(Dataset):
    """The samples of `datapaths` (a list of TSV files), each tokenized to seq_length when read."""

    task_name = ""

    def __init__(self, dataset_name: str, datapaths: Sequence[str], tokenizer, max_seq_length: int) -> None:
        self.dataset_name = dataset_name
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        print_rank_0(f" > building {self.task_name} dataset for {dataset_name}:")
        print_rank_0("  > paths: " + " ".join(datapaths))
        self.samples: List[Dict[str, object]] = []
        for path in datapaths:
            print_rank_0(f" > Processing {path} ...")
            samples = self.read_rows(path)
            print_rank_0(f" >> processed {len(samples)} samples.")
            self.samples.extend(samples)
        print_rank_0(f"  >> total number of samples: {len(self.samples)}")

    def read_rows(self, filename: str) -> List[Dict[str, object]]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> Dict[str, object]:
        raw = self.samples[idx]
        ids, types, paddings = build_tokens_types_paddings_from_text(raw["text_a"], raw["text_b"], self.tokenizer,
                                                                     self.max_seq_length)
        return build_sample(ids, types, paddings, raw["label"], raw["uid"])


def require_text(filename: str, line: int, text: str, what: str) -> str:
    if not text:
        raise TaskDataError(filename, line, f"{what} is empty")
    return text
