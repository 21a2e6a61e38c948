"""Write small WikiText-103-style and LAMBADA-style evaluation files from a JSON-lines corpus.

    python tasks/zeroshot_gpt/make_fixtures.py --format wikitext --input corpus.jsonl --output wiki.valid.tokens
    python tasks/zeroshot_gpt/make_fixtures.py --format lambada --input corpus.jsonl --output lambada.jsonl

No copy of WikiText-103 or LAMBADA can be had offline; these files have their formats, so the
tasks run on any corpus (the built-in default, the shared KJV + Shakespeare one):

| format | what is written |
|---|---|
| wikitext | per document " = TITLE = " and its paragraphs, word-level: spaces around punctuation, hyphens and digit separators as " @-@ ", " @,@ ", " @.@ " (what wikitext_detokenizer undoes) |
| lambada | one {"text": ...} per line: a passage of --words words ending at a sentence's last word (the target) |
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Iterator, List

_PUNCTUATION = re.compile(r"([,;:!?()\[\]\"])")
_WORD_END = re.compile(r"[A-Za-z]+$")


def wikitext_words(text: str) -> str:
    """One paragraph in WikiText's word-level form."""
    text = re.sub(r"(?<=\d)([,.])(?=\d)", lambda m: f" @{m.group(1)}@ ", text)
    text = re.sub(r"(?<=\w)-(?=\w)", " @-@ ", text)
    text = _PUNCTUATION.sub(r" \1 ", text)
    text = re.sub(r"\.(\s|$)", r" . ", text)
    text = re.sub(r"(\w)'s\b", r"\1 's", text)
    return " ".join(text.split())


def _documents(path: str, limit: int) -> Iterator[dict]:
    with open(path, encoding="utf-8") as reader:
        for line_number, line in enumerate(reader, start=1):
            if limit and line_number > limit:
                return
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as error:
                    raise SystemExit(f"make_fixtures.py: error: {path}:{line_number}: not valid JSON ({error.msg})")


def write_wikitext(corpus: str, output: str, documents: int, max_chars: int) -> None:
    parts: List[str] = []
    for number, document in enumerate(_documents(corpus, documents)):
        title = wikitext_words(str(document.get("title") or f"Document {number + 1}"))
        parts.append(f" = {title} = \n \n")
        text = document.get("text", "")
        if len(text) > max_chars:
            text = text[:max_chars].rsplit(" ", 1)[0]  # whole words only
        for paragraph in re.split(r"\n\s*\n|\n", text):
            if paragraph.strip():
                parts.append(f" {wikitext_words(paragraph)} \n")
        parts.append(" \n")
    _write(output, "".join(parts))


def write_lambada(corpus: str, output: str, documents: int, words: int, per_document: int) -> None:
    lines = []
    for document in _documents(corpus, documents):
        tokens = document.get("text", "").split()
        taken = 0
        for end in range(words, len(tokens)):
            if taken == per_document:
                break
            last = tokens[end - 1]
            if last.endswith((".", "!", "?", ";")) and _WORD_END.search(last.rstrip(".!?;")):
                passage = " ".join(tokens[end - words:end - 1] + [last.rstrip(".!?;")])
                lines.append(json.dumps({"text": passage}) + "\n")
                taken += 1
    _write(output, "".join(lines))


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as writer:
        writer.write(text)
    os.replace(temporary, path)  # a complete file or none


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--format", choices=["wikitext", "lambada"], required=True)
    parser.add_argument("--input", required=True, help="JSON lines with a \"text\" (and \"title\") field.")
    parser.add_argument("--output", required=True)
    parser.add_argument("--documents", type=int, default=4, help="How many documents to read (0: all).")
    parser.add_argument("--max-chars", type=int, default=4000, help="wikitext: characters taken per document.")
    parser.add_argument("--words", type=int, default=40, help="lambada: words per passage.")
    parser.add_argument("--per-document", type=int, default=8, help="lambada: passages per document.")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        raise SystemExit(f"make_fixtures.py: error: --input {args.input}: no such file")
    if args.format == "wikitext":
        write_wikitext(args.input, args.output, args.documents, args.max_chars)
    else:
        write_lambada(args.input, args.output, args.documents, args.words, args.per_document)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
