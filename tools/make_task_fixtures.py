"""Write small MNLI, QQP and RACE data sets in the real file formats from a JSON-lines corpus.

    python tools/make_task_fixtures.py --corpus corpus.jsonl --output-dir data/tasks [--train 512] [--dev 128]

writes OUTPUT/MNLI/{train,dev_matched,dev_mismatched,test_matched}.tsv (GLUE's columns: 12 in
train, 16 in dev, 10 in test), OUTPUT/QQP/{train,dev,test}.tsv (6 columns, test 3) and
OUTPUT/RACE/{train,dev,test}/{high,middle}/*.txt (one JSON document per file, RACE's keys), for
examples and tests: there is no offline copy of the real sets. The sentences are the corpus's
(its "text" fields cut at sentence ends); the labels follow rules a small BERT learns quickly:

    MNLI    sentence2 is a span of sentence1 with one word inserted at a random place: "indeed"
            (entailment), "never" (contradiction) or "perhaps" (neutral)
    QQP     question2 is a span of question1 with "likewise" (is_duplicate 1) or "instead" (0) inserted
    RACE    the 4 options are spans of the article; the answer's has "truly" inserted

Chance is 1/3 (MNLI), 1/2 (QQP) and 1/4 (RACE). The same corpus and --seed give the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from typing import List, Optional

MNLI_LABELS = {"entailment": "indeed", "contradiction": "never", "neutral": "perhaps"}
QQP_MARKERS = ("instead", "likewise")  # by is_duplicate
RACE_MARKER = "truly"
MNLI_HEAD = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
             "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]


def corpus_sentences(corpus: str, limit: int, min_words: int = 6, max_words: int = 16) -> List[List[str]]:
    """Up to `limit` sentences (lists of lower-case words) of the corpus's "text" fields."""
    sentences: List[List[str]] = []
    with open(corpus, "r", encoding="utf-8") as f:
        for line in f:
            for piece in re.split(r"[.!?;:]", json.loads(line).get("text", "")):
                words = re.findall(r"[a-z]+", piece.lower())
                if min_words <= len(words) <= max_words:
                    sentences.append(words)
                    if len(sentences) >= limit:
                        return sentences
    if len(sentences) < 8:
        raise ValueError(f"{corpus}: only {len(sentences)} usable sentences")
    return sentences


def _span(rng: random.Random, words: List[str], marker: Optional[str]) -> str:
    n = rng.randint(3, min(6, len(words)))
    start = rng.randint(0, len(words) - n)
    span = words[start:start + n]
    if marker is not None:
        span.insert(rng.randint(0, len(span)), marker)
    return " ".join(span)


def write_mnli(path: str, rng: random.Random, sentences, rows: int, kind: str) -> None:
    """kind: train (12 columns), dev (16) or test (10, no labels)."""
    head = MNLI_HEAD + {"train": ["label1", "gold_label"], "dev": [f"label{i}" for i in range(1, 6)] + ["gold_label"],
                        "test": []}[kind]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\t".join(head) + "\n")
        for i in range(rows):
            words = rng.choice(sentences)
            label = rng.choice(sorted(MNLI_LABELS))
            a, b = " ".join(words), _span(rng, words, MNLI_LABELS[label])
            row = [str(i), str(1000 + i), f"{1000 + i}e", "fiction", f"( {a} )", f"( {b} )", f"(ROOT {a})",
                   f"(ROOT {b})", a, b]
            row += {"train": [label, label], "dev": [label] * 6, "test": []}[kind]
            f.write("\t".join(row) + "\n")


def write_qqp(path: str, rng: random.Random, sentences, rows: int, test: bool) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("id\tquestion1\tquestion2\n" if test else "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n")
        for i in range(rows):
            words = rng.choice(sentences)
            label = rng.randint(0, 1)
            q1, q2 = " ".join(words) + " ?", _span(rng, words, QQP_MARKERS[label]) + " ?"
            f.write(f"{i}\t{q1}\t{q2}\n" if test else f"{i}\t{2 * i}\t{2 * i + 1}\t{q1}\t{q2}\t{label}\n")


def write_race(directory: str, rng: random.Random, sentences, documents: int) -> None:
    """documents JSON files under directory/{high,middle}, two questions each."""
    for level in ("high", "middle"):
        os.makedirs(os.path.join(directory, level), exist_ok=True)
    for d in range(documents):
        article = [rng.choice(sentences) for _ in range(3)]
        questions, options, answers = [], [], []
        for q in range(2):
            answer = rng.randrange(4)
            options.append([_span(rng, rng.choice(article), RACE_MARKER if c == answer else None) for c in range(4)])
            questions.append("which words are from the text ?" if q == 0 else "the text says _ .")
            answers.append("ABCD"[answer])
        level = ("high", "middle")[d % 2]
        document = {"article": ". ".join(" ".join(s) for s in article) + ".", "questions": questions,
                    "options": options, "answers": answers, "id": f"{level}{d}.txt"}
        with open(os.path.join(directory, level, f"{d}.txt"), "w", encoding="utf-8") as f:
            f.write(json.dumps(document) + "\n")


def make_fixtures(corpus: str, output_dir: str, train: int = 512, dev: int = 128, seed: int = 1234) -> str:
    """Write the three data sets under output_dir; returns output_dir."""
    sentences = corpus_sentences(corpus, limit=4 * (train + 3 * dev))
    rng = random.Random(seed)
    for task in ("MNLI", "QQP", "RACE"):
        os.makedirs(os.path.join(output_dir, task), exist_ok=True)
    mnli, qqp, race = (os.path.join(output_dir, task) for task in ("MNLI", "QQP", "RACE"))
    write_mnli(os.path.join(mnli, "train.tsv"), rng, sentences, train, "train")
    write_mnli(os.path.join(mnli, "dev_matched.tsv"), rng, sentences, dev, "dev")
    write_mnli(os.path.join(mnli, "dev_mismatched.tsv"), rng, sentences, dev, "dev")
    write_mnli(os.path.join(mnli, "test_matched.tsv"), rng, sentences, dev, "test")
    write_qqp(os.path.join(qqp, "train.tsv"), rng, sentences, train, test=False)
    write_qqp(os.path.join(qqp, "dev.tsv"), rng, sentences, dev, test=False)
    write_qqp(os.path.join(qqp, "test.tsv"), rng, sentences, dev, test=True)
    for split, documents in (("train", train // 4), ("dev", dev // 4), ("test", dev // 4)):
        write_race(os.path.join(race, split), rng, sentences, documents)
    return output_dir


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="JSON lines with a 'text' field")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--train", type=int, default=512, help="training rows (RACE: a quarter as documents)")
    parser.add_argument("--dev", type=int, default=128, help="rows of each dev/test file")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    make_fixtures(args.corpus, args.output_dir, args.train, args.dev, args.seed)
    print(f"> wrote MNLI, QQP and RACE under {args.output_dir}")


if __name__ == "__main__":
    main()
