"""Remove training documents that share an n-gram with evaluation data (Megatron's filter_ngrams).

    python tools/data_collection/decontaminate.py --input docs.jsonl --output clean.jsonl \
        --task LAMBADA:lambada_test.jsonl --task WIKITEXT103:wiki.test.tokens \
        --task RACE:RACE/test --task MNLI:MNLI/dev_matched.tsv --task QQP:QQP/dev.tsv \
        --workers 8 [--ngram 13] [--mode remove|split]

The evaluation texts are read from the files the project's tasks read (tasks/):
  LAMBADA      JSON lines with a "text"                     -> each text
  WIKITEXT103  the raw token file (wiki.test.tokens)        -> each non-blank, non-heading line
  RACE         a folder (searched recursively) of *.txt, one JSON document each
                                                             -> the article, each question + options
  MNLI         a GLUE TSV with a header                     -> the sentence1 and sentence2 columns
  QQP          a GLUE TSV with a header                     -> the question1 and question2 columns
Texts and documents are compared as lower-case words (regex \\w+: punctuation, case and spacing
do not matter). Every n consecutive words of an evaluation text is a contaminating n-gram; a
text shorter than n words but at least --min-ngram words is one whole (Megatron's rule).

--mode remove (default) drops every document containing such an n-gram. --mode split does what
Megatron's filter_ngrams does: cuts the n-gram and --cut-chars characters on each side out of the
document, keeps the pieces of at least --min-piece-chars characters as documents of their own,
and drops the document when it would fall into more than --max-pieces pieces.

N-grams are matched through 64-bit hashes of word spans (vectorised with numpy, see minhash.py)
and every hit is confirmed on the words themselves, so a hash collision never removes a document.
A report (OUTPUT.report.json, or --report) counts the documents removed or split, per task.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
from collections import Counter
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.data_collection import minhash
from tools.data_collection.common import (DataCollectionError, Line, atomic_output, atomic_write_json, batched,
                                          check_inputs, dump_line, numbered_lines, ordered_map, parse_document,
                                          positive_int, run_tool)

TASKS = ("LAMBADA", "WIKITEXT103", "RACE", "MNLI", "QQP")
_WORD = re.compile(r"\w+")
_WIKITEXT_HEADING = re.compile(r"^\s*=( =)*\s.*\s=( =)*\s*$")


# ----------------------------------------------------------------------------- task files


def _text_lines(path: str) -> Iterator[Tuple[int, str]]:
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise DataCollectionError(f"{path}:{number}: not valid UTF-8 "
                                              f"(byte {error.start} of the line)") from None
    except (FileNotFoundError, IsADirectoryError, PermissionError) as error:
        raise DataCollectionError(f"--task {path}: {error.strerror}") from None


def _json_object(path: str, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataCollectionError(f"{path}:{number}: not valid JSON ({error.msg}, column {error.colno})") from None
    if not isinstance(record, dict):
        raise DataCollectionError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
    return record


def lambada_texts(path: str) -> Iterator[str]:
    for number, line in _text_lines(path):
        if line.strip():
            record = _json_object(path, number, line)
            if not isinstance(record.get("text"), str):
                raise DataCollectionError(f"{path}:{number}: no \"text\" string (a LAMBADA line is {{\"text\": ...}})")
            yield record["text"]


def wikitext_texts(path: str) -> Iterator[str]:
    for _, line in _text_lines(path):
        if line.strip() and not _WIKITEXT_HEADING.match(line):
            yield line


def race_texts(path: str) -> Iterator[str]:
    if not os.path.isdir(path):
        raise DataCollectionError(f"--task RACE:{path}: not a folder (give RACE/test or a folder under it)")
    files = sorted(glob.glob(os.path.join(path, "**", "*.txt"), recursive=True))
    if not files:
        raise DataCollectionError(f"--task RACE:{path}: no *.txt files")
    for name in files:
        for number, line in _text_lines(name):
            if not line.strip():
                continue
            record = _json_object(name, number, line)
            if not isinstance(record.get("article"), str) or not isinstance(record.get("questions"), list):
                raise DataCollectionError(f"{name}:{number}: a RACE document has an \"article\" string and "
                                          "\"questions\" and \"options\" lists")
            yield record["article"]
            for question, options in zip(record["questions"], record.get("options") or []):
                yield " ".join([str(question)] + [str(o) for o in (options if isinstance(options, list) else [])])


def tsv_columns(path: str, names: Sequence[str], task: str) -> Iterator[str]:
    columns: List[int] = []
    for number, line in _text_lines(path):
        row = line.rstrip("\r\n").split("\t")
        if number == 1:
            header = [c.strip() for c in row]
            missing = [n for n in names if n not in header]
            if missing:
                raise DataCollectionError(f"{path}:1: the header has no {', '.join(missing)} column (a {task} TSV "
                                          f"names its columns: {', '.join(names)})")
            columns = [header.index(n) for n in names]
            continue
        if not line.strip():
            continue
        if len(row) <= max(columns):
            raise DataCollectionError(f"{path}:{number}: {len(row)} columns, the header has more")
        for column in columns:
            yield row[column]


def task_texts(task: str, path: str) -> Iterator[str]:
    if task == "LAMBADA":
        return lambada_texts(path)
    if task == "WIKITEXT103":
        return wikitext_texts(path)
    if task == "RACE":
        return race_texts(path)
    if task == "MNLI":
        return tsv_columns(path, ("sentence1", "sentence2"), task)
    return tsv_columns(path, ("question1", "question2"), task)


# ----------------------------------------------------------------------------- n-grams


class NgramIndex:
    """The contaminating n-grams of the tasks: sorted uint64 hashes per length, and the words
    of each (to confirm hits), with the task each came from."""

    def __init__(self, ngram: int, min_ngram: int) -> None:
        self.ngram, self.min_ngram = ngram, min_ngram
        self.grams: Dict[str, str] = {}  # "w1 w2 ... wn" -> task
        self.hashes: Dict[int, np.ndarray] = {}  # length -> sorted uint64
        self._pending: Dict[int, List[np.ndarray]] = {}

    def add_task(self, task: str, texts: Iterator[str]) -> int:
        """Add the n-grams of a task's texts; returns how many were new."""
        added = 0
        for text in texts:
            words = _WORD.findall(text.lower())
            if len(words) >= self.ngram:
                length = self.ngram
            elif len(words) >= self.min_ngram:
                length = len(words)
            else:
                continue
            self._pending.setdefault(length, []).append(minhash.span_hashes(" ".join(words), "word", length))
            for i in range(len(words) - length + 1):
                gram = " ".join(words[i:i + length])
                if gram not in self.grams:
                    self.grams[gram] = task
                    added += 1
        return added

    def freeze(self) -> None:
        self.hashes = {length: np.unique(np.concatenate(parts)) for length, parts in sorted(self._pending.items())}
        self._pending = {}

    def matches(self, normalised: str) -> List[Tuple[int, int, str]]:
        """(first word, word count, task) of each contaminating n-gram in a normalised text."""
        words = None
        found = []
        for length, table in self.hashes.items():
            hashes = minhash.span_hashes(normalised, "word", length)
            position = np.minimum(np.searchsorted(table, hashes), len(table) - 1)
            hit = np.flatnonzero(table[position] == hashes)
            if len(hit) == 0:
                continue
            words = words if words is not None else normalised.split(" ")
            for i in hit.tolist():
                gram = " ".join(words[i:i + length])
                if len(words) >= length and gram in self.grams:
                    found.append((i, length, self.grams[gram]))
        return found


def split_around(text: str, spans: List[Tuple[int, int]], cut_chars: int, min_piece_chars: int) -> List[str]:
    """Pieces of text outside the word spans (first word, count), each widened by cut_chars."""
    offsets = [(m.start(), m.end()) for m in _WORD.finditer(text)]
    cuts = sorted((max(offsets[i][0] - cut_chars, 0), min(offsets[i + n - 1][1] + cut_chars, len(text)))
                  for i, n in spans)
    pieces, position = [], 0
    for start, end in cuts:
        if start > position:
            pieces.append(text[position:start])
        position = max(position, end)
    pieces.append(text[position:])
    return [p.strip() for p in pieces if len(p.strip()) >= min_piece_chars]


class Decontaminator:
    """Called on batches of lines in the worker processes."""

    def __init__(self, path: str, index: NgramIndex, mode: str, cut_chars: int, min_piece_chars: int,
                 max_pieces: int) -> None:
        self.path, self.index, self.mode = path, index, mode
        self.cut_chars, self.min_piece_chars, self.max_pieces = cut_chars, min_piece_chars, max_pieces

    def __call__(self, lines: List[Line]) -> List[Tuple[int, List[bytes], Counter]]:
        """(line, the output lines, matches per task) of each input line."""
        out = []
        for number, raw in lines:
            record = parse_document(self.path, number, raw)
            text = record["text"]
            found = self.index.matches(minhash.normalise(text))
            tasks = Counter(task for _, _, task in found)
            if not found:
                out.append((number, [raw if raw.endswith(b"\n") else raw + b"\n"], tasks))
            elif self.mode == "remove":
                out.append((number, [], tasks))
            else:
                pieces = split_around(text, [(i, n) for i, n, _ in found], self.cut_chars, self.min_piece_chars)
                if len(pieces) > self.max_pieces:
                    pieces = []
                out.append((number, [dump_line({**record, "text": piece}) for piece in pieces], tasks))
        return out


# ----------------------------------------------------------------------------- main


def parse_task(value: str) -> Tuple[str, str]:
    task, colon, path = value.partition(":")
    if not colon or task.upper() not in TASKS or not path:
        raise DataCollectionError(f"--task {value}: expected TASK:PATH with TASK one of {', '.join(TASKS)}")
    return task.upper(), path


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="Loose JSON input with a \"text\" key")
    parser.add_argument("--output", required=True, help="Loose JSON output without the contaminated documents")
    parser.add_argument("--report", default=None, help="JSON report (default: OUTPUT.report.json)")
    parser.add_argument("--task", action="append", required=True, help="TASK:PATH of evaluation data (repeat)")
    parser.add_argument("--ngram", type=int, default=13, help="Words of a contaminating n-gram")
    parser.add_argument("--min-ngram", type=int, default=8,
                        help="An evaluation text shorter than --ngram words but at least this long counts whole")
    parser.add_argument("--mode", choices=("remove", "split"), default="remove")
    parser.add_argument("--cut-chars", type=int, default=200, help="split: characters cut on each side of a match")
    parser.add_argument("--min-piece-chars", type=int, default=200, help="split: shortest piece kept")
    parser.add_argument("--max-pieces", type=int, default=10, help="split: drop a document cut into more pieces")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    positive_int("--workers", args.workers)
    positive_int("--ngram", args.ngram)
    positive_int("--batch-size", args.batch_size)
    args.task = [parse_task(value) for value in args.task]
    check_inputs([args.input])
    return args


def main(argv: Optional[List[str]] = None) -> dict:
    args = get_args(argv)
    start = time.time()
    index = NgramIndex(args.ngram, min(args.min_ngram, args.ngram))
    ngrams = {}
    for task, path in args.task:
        ngrams[f"{task}:{path}"] = index.add_task(task, task_texts(task, path))
    if not index.grams:
        raise DataCollectionError("--task: the evaluation files hold no text of --min-ngram words or more")
    index.freeze()
    work = Decontaminator(args.input, index, args.mode, args.cut_chars, args.min_piece_chars, args.max_pieces)
    documents = written = removed = split = 0
    by_task: Counter = Counter()
    examples: List[str] = []
    with atomic_output(args.output) as out:
        for results in ordered_map(work, batched(numbered_lines(args.input), args.batch_size), args.workers):
            for number, lines, tasks in results:
                documents += 1
                for line in lines:
                    out.write(line)
                written += len(lines)
                if tasks:
                    by_task.update(tasks.keys())
                    removed += not lines
                    split += bool(lines)
                    if len(examples) < 20:
                        examples.append(f"{args.input}:{number} ({', '.join(sorted(tasks))})")
        report = {"input": args.input, "output": args.output, "documents": documents, "removed": removed,
                  "split": split, "written": written, "contaminated_by_task": dict(by_task),
                  "task_ngrams": ngrams, "examples": examples,
                  "settings": {"ngram": args.ngram, "min_ngram": args.min_ngram, "mode": args.mode},
                  "input_bytes": os.path.getsize(args.input), "seconds": round(time.time() - start, 3)}
        atomic_write_json(args.report or args.output + ".report.json", report)
    print(f"decontaminate: {removed} of {documents} documents removed, {split} split "
          f"({', '.join(f'{t} {c}' for t, c in sorted(by_task.items())) or 'no matches'}) -> {args.output}",
          file=sys.stderr)
    return report


if __name__ == "__main__":
    run_tool(main, "decontaminate.py")
