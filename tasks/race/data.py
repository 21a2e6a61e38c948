"""RACE: a directory of JSON files, as Megatron's tasks/race/data.py reads it.

    RACE/{train,dev,test}/{high,middle}/*.txt   each line of a file one JSON object:
        {"article": str, "questions": [str], "options": [[4 x str]], "answers": ["A".."D"], "id": str}

A --train-data / --valid-data entry is one such directory (e.g. RACE/train/middle); its *.txt files
are read in sorted order (Megatron's glob order is the file system's). Each question gives one
sample of NUM_CHOICES rows: [CLS] question+choice [SEP] article [SEP], the question's "_" replaced by
the choice (else question and choice joined by a space), question+choice cut to max_qa_length
tokens, the article cut by the sequence length. A bad line raises TaskDataError naming FILE:LINE.
"""

from __future__ import annotations

import glob
import json
import os
import time
from typing import Dict, List, Sequence

from torch.utils.data import Dataset

from megatron.training.utils import print_rank_0
from tasks.data_utils import TaskDataError, build_sample, build_tokens_types_paddings_from_ids, clean_text

NUM_CHOICES = 4
MAX_QA_LENGTH = 128
KEYS = ("article", "questions", "options", "answers")


class RaceDataset(Dataset):
    """The questions of the RACE directories `datapaths`, tokenized when read (samples hold
    [NUM_CHOICES, seq_length] arrays; sample_multiplier tells finetune the rows per sample)."""

    def __init__(self, dataset_name: str, datapaths: Sequence[str], tokenizer, max_seq_length: int,
                 max_qa_length: int = MAX_QA_LENGTH) -> None:
        self.dataset_name = dataset_name
        print_rank_0(f" > building RACE dataset for {dataset_name}:")
        print_rank_0("  > paths: " + " ".join(datapaths))
        self.samples: List[Dict[str, object]] = []
        for path in datapaths:
            self.samples.extend(process_single_datapath(path, tokenizer, max_qa_length, max_seq_length))
        print_rank_0(f"  >> total number of samples: {len(self.samples)}")
        self.sample_multiplier = NUM_CHOICES  # each sample is NUM_CHOICES rows of the batch

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> Dict[str, object]:
        return self.samples[idx]


def _check_document(data, filename: str, line: int) -> None:
    if not isinstance(data, dict):
        raise TaskDataError(filename, line, f"a RACE line is a JSON object, got {type(data).__name__}")
    missing = [key for key in KEYS if key not in data]
    if missing:
        raise TaskDataError(filename, line, f"no {', '.join(repr(k) for k in missing)} (a RACE document has "
                            f"{', '.join(KEYS)})")
    if not isinstance(data["article"], str):
        raise TaskDataError(filename, line, "'article' is not a string")
    lists = [data[key] for key in KEYS[1:]]
    if not all(isinstance(value, list) for value in lists) or len({len(value) for value in lists}) != 1:
        raise TaskDataError(filename, line, "'questions', 'options' and 'answers' must be lists of one length, "
                            f"got {[len(v) if isinstance(v, list) else type(v).__name__ for v in lists]}")
    for i, (options, answer) in enumerate(zip(data["options"], data["answers"])):
        if not isinstance(options, list) or len(options) != NUM_CHOICES or not all(isinstance(o, str) for o in options):
            raise TaskDataError(filename, line, f"question {i}: 'options' must be {NUM_CHOICES} strings")
        if not isinstance(answer, str) or len(answer) != 1 or not 0 <= ord(answer) - ord("A") < NUM_CHOICES:
            raise TaskDataError(filename, line, f"question {i}: answer {answer!r} is not one of A-D")


def process_single_datapath(datapath: str, tokenizer, max_qa_length: int, max_seq_length: int) -> List[Dict]:
    """The samples of one RACE directory (its *.txt files)."""
    print_rank_0(f"   > working on {datapath}")
    if not os.path.isdir(datapath):
        raise FileNotFoundError(f"RACE data {datapath} is not a directory (give e.g. RACE/train/middle)")
    start = time.time()
    filenames = sorted(glob.glob(os.path.join(datapath, "*.txt")))
    if not filenames:
        raise FileNotFoundError(f"RACE data {datapath} holds no *.txt files")
    samples: List[Dict] = []
    num_docs = num_questions = 0
    for filename in filenames:
        with open(filename, "r", encoding="utf-8") as f:
            for line, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    data = json.loads(text)
                except json.JSONDecodeError as error:
                    raise TaskDataError(filename, line, f"not JSON: {error.msg} (column {error.colno})") from None
                _check_document(data, filename, line)
                num_docs += 1
                context_ids = tokenizer.tokenize(clean_text(data["article"]))
                for question, choices, answer in zip(data["questions"], data["options"], data["answers"]):
                    num_questions += 1
                    rows = [_choice_row(question, choice, context_ids, tokenizer, max_qa_length, max_seq_length)
                            for choice in choices]
                    samples.append(build_sample([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                                                ord(answer) - ord("A"), len(samples)))
    print_rank_0(f"    > processed {num_docs} document, {num_questions} questions, and {len(samples)} samples"
                 f" in {time.time() - start:.2f} seconds")
    return samples


def _choice_row(question: str, choice: str, context_ids: List[int], tokenizer, max_qa_length: int,
                max_seq_length: int):
    qa = question.replace("_", choice) if "_" in question else " ".join([question, choice])
    qa_ids = tokenizer.tokenize(clean_text(qa))[:max_qa_length]
    return build_tokens_types_paddings_from_ids(qa_ids, context_ids, max_seq_length, tokenizer.cls, tokenizer.sep,
                                                tokenizer.pad)
