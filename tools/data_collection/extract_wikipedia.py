"""Extract the articles of a MediaWiki XML dump as loose JSON, one article a line.

    python tools/data_collection/extract_wikipedia.py --input enwiki-latest-pages-articles.xml.bz2 \
        --output wiki.jsonl --workers 8 [--split-sentences nltk|regex]

Each line is WikiExtractor's --json record `{"id", "url", "title", "text"}`, with the url
`BASE?curid=ID` (BASE: the siteinfo's <base> up to its last "/"). Only articles are written:
pages in namespace 0 that are not redirects and whose text is not empty after cleaning
(tools/data_collection/wikitext.py says what the cleaning keeps).

The dump (.xml, .xml.bz2 or .xml.gz) is read as a stream with xml.etree's iterparse, each page
element cleared once read, so memory is one page plus the worker queues whatever the dump's
size. Parsing is serial (one process); the wikitext cleaning, most of the work, runs on
--workers processes, in order. The XML parser is expat: no external entity or DTD is fetched,
and expat >= 2.4.1 caps entity amplification.

--split-sentences puts each sentence on its own line (Megatron's nltk cleaning step):
  nltk   NLTK's punkt (the punkt_tab data must be installed: NLTK_DATA, or
         `python -c "import nltk; nltk.download('punkt_tab')"`; its absence is a one-line error);
  regex  a fallback without data: a split after . ! or ? followed by a space and an upper-case
         letter, a digit or a quote, except after a single capital or a common abbreviation
         (Mr, Dr, St, e.g., i.e., ...); rougher than punkt on abbreviations and numbers.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time
import xml.etree.ElementTree as ET
from typing import Iterator, List, Optional, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.data_collection.common import (DataCollectionError, atomic_output, batched, dump_line, open_input,
                                          ordered_map, positive_int, run_tool)
from tools.data_collection.wikitext import clean_wikitext

Page = Tuple[str, str, str]  # (id, title, wikitext)


class _LineCountingReader:
    """A binary reader that counts the newlines it has handed out: where a compressed stream
    ends early, the line it ends on."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self.lines = 1

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.lines += data.count(b"\n")
        return data


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def iter_pages(path: str, stats: dict) -> Iterator[Page]:
    """(id, title, wikitext) of each article page of the dump; sets stats['url_base'] from the
    siteinfo and counts what it skips. DataCollectionError names FILE:LINE of bad XML."""
    with open_input(path) as raw:
        reader = _LineCountingReader(raw)
        try:
            yield from _parse(reader, stats)
        except ET.ParseError as error:
            line, column = error.position
            reason = re.sub(r":? line \d+, column \d+$", "", str(error))
            raise DataCollectionError(f"{path}:{line}: bad XML ({reason}, column {column + 1})") from None
        except (EOFError, OSError) as error:
            raise DataCollectionError(f"{path}:{reader.lines}: the compressed data is damaged or truncated "
                                      f"({error})") from None


def _parse(reader, stats: dict) -> Iterator[Page]:
    context = ET.iterparse(reader, events=("start", "end"))
    root = None
    for event, element in context:
        if root is None:
            root = element
            if _local(root.tag) != "mediawiki":
                error = ET.ParseError(f"the root element is <{_local(root.tag)}>, not <mediawiki>")
                error.position = (1, 0)
                raise error
        if event != "end":
            continue
        tag = _local(element.tag)
        if tag == "base" and "url_base" not in stats:
            stats["url_base"] = (element.text or "").rsplit("/", 1)[0]
        elif tag == "namespace" and element.get("key", "0") != "0" and element.text:
            stats.setdefault("namespaces", set()).add(element.text.strip())
        elif tag == "page":
            page = _page(element, stats)
            root.clear()  # drop this page (and the siteinfo) from the tree: memory stays flat
            if page is not None:
                yield page


def _page(element, stats: dict) -> Optional[Page]:
    fields = {"ns": None, "id": None, "title": "", "text": "", "redirect": False}
    for child in element:
        tag = _local(child.tag)
        if tag in ("ns", "id", "title"):
            fields[tag] = (child.text or "").strip()
        elif tag == "redirect":
            fields["redirect"] = True
        elif tag == "revision":
            for part in child:
                if _local(part.tag) == "text":
                    fields["text"] = part.text or ""
    stats["pages"] = stats.get("pages", 0) + 1
    if fields["ns"] is None:  # dumps before export-0.6 have no <ns>: the title's prefix says
        prefix, colon, _ = fields["title"].partition(":")
        fields["ns"] = "other" if colon and prefix in stats.get("namespaces", ()) else "0"
    if fields["ns"] != "0":
        stats["skipped_namespace"] = stats.get("skipped_namespace", 0) + 1
        return None
    if fields["redirect"] or re.match(r"\s*#redirect", fields["text"], re.I):
        stats["skipped_redirect"] = stats.get("skipped_redirect", 0) + 1
        return None
    return fields["id"] or "", fields["title"], fields["text"]


# ----------------------------------------------------------------------------- sentences

_ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "st", "jr", "sr", "prof", "vs", "etc", "e.g", "i.e", "no", "fig",
                  "inc", "ltd", "co", "mt", "ft", "approx", "c", "ca"}
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+(?=[A-Z0-9\"'(])")


def regex_sentences(paragraph: str) -> List[str]:
    """The fallback splitter (see the module docstring)."""
    sentences: List[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(paragraph):
        before = paragraph[start:match.start()].rstrip("\"')]")
        last_word = before.rsplit(None, 1)[-1] if before.split() else ""
        stem = last_word.rstrip(".!?").lower()
        if last_word.endswith(".") and (stem in _ABBREVIATIONS or re.fullmatch(r"[a-z]", stem)):
            continue
        sentences.append(paragraph[start:match.start() + len(match.group().rstrip())].strip())
        start = match.end()
    sentences.append(paragraph[start:].strip())
    return [s for s in sentences if s]


def check_punkt() -> None:
    try:
        import nltk
        nltk.data.find("tokenizers/punkt_tab/english/")
    except (ImportError, LookupError):
        raise DataCollectionError("--split-sentences nltk: NLTK's punkt_tab data is not installed (set NLTK_DATA, "
                                  "or run python -c \"import nltk; nltk.download('punkt_tab')\"), or use "
                                  "--split-sentences regex") from None


def split_sentences(text: str, how: Optional[str]) -> str:
    if how is None:
        return text
    if how == "nltk":
        import nltk
        split = nltk.sent_tokenize
    else:
        split = regex_sentences
    return "\n".join(s for paragraph in text.split("\n") for s in split(paragraph))


# ----------------------------------------------------------------------------- main


def _clean_batch(batch: List[Tuple[str, str, str, str]], split: Optional[str]) -> List[Optional[bytes]]:
    out = []
    for page_id, title, url_base, wikitext in batch:
        text = split_sentences(clean_wikitext(wikitext), split)
        out.append(dump_line({"id": page_id, "url": f"{url_base}?curid={page_id}", "title": title, "text": text})
                   if text else None)
    return out


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="MediaWiki XML dump: .xml, .xml.bz2 or .xml.gz")
    parser.add_argument("--output", required=True, help="Loose JSON output, one article a line")
    parser.add_argument("--workers", type=int, default=1, help="Processes that clean the wikitext")
    parser.add_argument("--split-sentences", choices=("nltk", "regex"), default=None,
                        help="One sentence a line: NLTK punkt (needs its data) or the regex fallback")
    parser.add_argument("--batch-size", type=int, default=64, help="Pages sent to a worker at a time")
    args = parser.parse_args(argv)
    positive_int("--workers", args.workers)
    positive_int("--batch-size", args.batch_size)
    return args


def main(argv: Optional[List[str]] = None) -> dict:
    """Extract the dump; returns the counts it prints."""
    args = get_args(argv)
    if args.split_sentences == "nltk":
        check_punkt()
    stats: dict = {}
    start = time.time()
    pages = ((page_id, title, stats.get("url_base", ""), text) for page_id, title, text in iter_pages(args.input, stats))
    written = 0
    with atomic_output(args.output) as out:
        work = functools.partial(_clean_batch, split=args.split_sentences)
        for lines in ordered_map(work, batched(pages, args.batch_size), args.workers):
            for line in lines:
                if line is None:
                    stats["skipped_empty"] = stats.get("skipped_empty", 0) + 1
                else:
                    out.write(line)
                    written += 1
    stats["articles"] = written
    stats["input_bytes"] = os.path.getsize(args.input)
    stats["seconds"] = round(time.time() - start, 3)
    stats.pop("url_base", None)
    stats.pop("namespaces", None)
    print(f"extract_wikipedia: {written} articles of {stats.get('pages', 0)} pages "
          f"({stats.get('skipped_redirect', 0)} redirects, {stats.get('skipped_namespace', 0)} other namespaces, "
          f"{stats.get('skipped_empty', 0)} empty) in {stats['seconds']:.2f} s -> {args.output}", file=sys.stderr)
    return stats


if __name__ == "__main__":
    run_tool(main, "extract_wikipedia.py")
