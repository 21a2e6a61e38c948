"""Clean a loose-JSON corpus: URL blacklist, ftfy text repair, language identification and a
minimum length, with a JSON report of what was dropped and why.

    python tools/data_collection/cleanup.py --input docs.jsonl --output clean.jsonl \
        --report clean.report.json --workers 8 [--languages en] [--min-words 128]

The checks, in order; a document is dropped at the first it fails, under that reason:
  blacklisted_domain     its "url" (when it has one, unless --no-url-filter) is on a blacklisted site: the URL's
                         registered name (www.youtube.com -> youtube) or its whole host is in
                         OpenWebText's list (image, video, social and file hosts), extended
                         by --blacklist-domains FILE (one name a line);
  blacklisted_extension  the URL's path ends in a file extension that is not a web page
                         (images, media, archives, documents, code; OpenWebText's rules);
  bad_url                the URL has no host, is not http(s), or is longer than 2,000 chars;
  too_short              fewer than --min-words words after repair (Megatron: 128);
  language               the language identified (py3langid, whose model ships in its wheel)
                         is not one of --languages, or its probability is below
                         --min-language-probability.
Kept documents have their "text" repaired with ftfy.fix_text (mojibake, HTML entities, odd
line breaks); every other field is kept as it was. The report counts each reason, the languages
seen and the number of texts ftfy changed, with the first few dropped documents of each reason
(by FILE:LINE) as examples.

Install the dependencies with `pip install -e .[data]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import time
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.data_collection.common import (DataCollectionError, Line, atomic_output, atomic_write_json, batched,
                                          check_inputs, dump_line, numbered_lines, ordered_map, parse_document,
                                          positive_int, run_tool)

# Sites whose pages are mostly media, listings or logins, not prose (OpenWebText's blacklist).
BLACKLISTED_DOMAINS = frozenset("""
500px aapks akamaihd amazon apple artifactfire artstation awwni bandcamp battleforthenet coinscalendar
dailymotion deviantart discord discordapp dlapkandroid dropbox e621 ebay edealinfo erome eroshare explosm
facebook fbcdn flickr furaffinity futhead gatopardo gfycat gifsound gifsoup giphy github google gunprime
gyazo hotdealstar imagefap imageshack imgflip imgur instagram karmadecay kryptocal kym-cdn liveleak
livememe lmgtfy magaimg memegenerator minorplanetcenter minus mobafire morejpeg nocookie pcpartpicker
photobucket pinimg pinterest polygonspace pornhub prntscr puu qkme quickmeme radd redd reddit
reddit-stream redditlog redditmedia reddituploads redtube reupp reverb roanoke rollingstone sli
soundcloud soundgasm spankbang spotify strawpoll streamable timeanddate tinypic touhouradio tumblr
twimg twitch twitter vid vimeo vine vkaao vocaroo voyagefusion walmart wciu wikimedia wikipedia
xhamster xkcd xvideos youtu youtube youtubedoubler ytimg zillexplorer
""".split())
# Extensions of files that are not web pages.
BLACKLISTED_EXTENSIONS = frozenset("""
3gp 7z ai aif apk app avi bin bmp bz2 css csv dat deb dmg doc docx exe gif gifv gz iso jar jpeg jpg js
log mid midi mkv mov mp3 mp4 mpeg mpg ogg ogv otf pdf pkg png pps ppt pptx psd py qt ram rar sql svg swf
tar tgz tif tiff ttf txt wav webm webp wma wmv xls xlsx xml xz zip
""".split())
# Second-level labels under which names are registered (bbc.co.uk -> bbc).
_SECOND_LEVEL = {"co", "com", "org", "net", "ac", "gov", "edu", "or", "ne", "go"}
MAX_URL_LENGTH = 2000
REASONS = ("blacklisted_domain", "blacklisted_extension", "bad_url", "too_short", "language")
_EXAMPLES_PER_REASON = 5


def registered_name(host: str) -> str:
    """The name a site is registered under: www.youtube.com -> youtube, news.bbc.co.uk -> bbc."""
    labels = [label for label in host.lower().rstrip(".").split(".") if label]
    if len(labels) >= 3 and labels[-2] in _SECOND_LEVEL and len(labels[-1]) == 2:
        return labels[-3]
    return labels[-2] if len(labels) >= 2 else (labels[0] if labels else "")


def url_verdict(url: str, domains: frozenset = BLACKLISTED_DOMAINS) -> Optional[str]:
    """The reason to drop a document from `url`, or None to keep it."""
    if len(url) > MAX_URL_LENGTH:
        return "bad_url"
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname or ""
    except ValueError:
        return "bad_url"
    if parts.scheme not in ("http", "https") or not host:
        return "bad_url"
    if registered_name(host) in domains or host.lower() in domains:
        return "blacklisted_domain"
    last = parts.path.rstrip("/").rsplit("/", 1)[-1].lower()
    if "." in last:
        extension = last.rsplit(".", 1)[1]
        if extension in BLACKLISTED_EXTENSIONS or last.endswith(".tar.gz"):
            return "blacklisted_extension"
    return None


_WORD = re.compile(r"\w+")


class Cleaner:
    """The checks of one configuration; called on batches of lines in the worker processes."""

    def __init__(self, path: str, languages: Sequence[str], min_words: int, min_probability: float,
                 domains: frozenset, url_filter: bool = True) -> None:
        self.path, self.min_words, self.min_probability, self.domains = path, min_words, min_probability, domains
        self.url_filter = url_filter
        self.languages = frozenset(languages)
        self._identifier = None

    def prepare(self) -> None:
        """Load the language model now (about a second), so forked workers share it."""
        if self.languages:
            self._language("warm up")

    def _language(self, text: str) -> Tuple[str, float]:
        """(language, probability) from the text's first 10,000 characters (py3langid walks
        the text byte by byte in Python: the cap keeps long documents cheap)."""
        if self._identifier is None:
            # py3langid >= 0.4 keeps its model as an .npz (loaded with allow_pickle=False).
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
            self._identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        language, probability = self._identifier.classify(text[:10000])
        return language, float(probability)

    def __call__(self, lines: List[Line]) -> List[Tuple[int, Optional[str], Optional[str], bool, Optional[bytes]]]:
        """(line, reason or None, language, ftfy changed it, the output line) of each line."""
        import ftfy
        out = []
        for number, raw in lines:
            record = parse_document(self.path, number, raw)
            url = record.get("url")
            reason = url_verdict(url, self.domains) if self.url_filter and isinstance(url, str) and url else None
            language, changed, line = None, False, None
            if reason is None:
                text = ftfy.fix_text(record["text"])
                changed = text != record["text"]
                if len(_WORD.findall(text)) < self.min_words:
                    reason = "too_short"
                elif self.languages:
                    language, probability = self._language(text)
                    if language not in self.languages or probability < self.min_probability:
                        reason = "language"
                if reason is None:
                    record["text"] = text
                    line = dump_line(record)
            out.append((number, reason, language, changed, line))
        return out


def read_domain_list(path: str) -> frozenset:
    """Names of --blacklist-domains FILE: one a line, '#' starts a comment."""
    try:
        with open(path, encoding="utf-8") as f:
            names = {line.split("#", 1)[0].strip().lower() for line in f}
    except (OSError, UnicodeDecodeError) as error:
        raise DataCollectionError(f"--blacklist-domains {path}: {getattr(error, 'strerror', None) or error}") from None
    return frozenset(name for name in names if name)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="Loose JSON input with a \"text\" (and maybe \"url\") key")
    parser.add_argument("--output", required=True, help="Loose JSON output: the kept documents, repaired")
    parser.add_argument("--report", default=None, help="JSON report of the drops (default: OUTPUT.report.json)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--languages", nargs="*", default=["en"],
                        help="ISO 639-1 codes to keep (none: no language filter)")
    parser.add_argument("--min-language-probability", type=float, default=0.5)
    parser.add_argument("--min-words", type=int, default=128, help="Drop documents with fewer words")
    parser.add_argument("--blacklist-domains", default=None, help="A file of more domain names to drop")
    parser.add_argument("--no-url-filter", action="store_true",
                        help="Skip the URL rules (Wikipedia's own URLs are on the blacklist)")
    parser.add_argument("--batch-size", type=int, default=64, help="Documents sent to a worker at a time")
    args = parser.parse_args(argv)
    positive_int("--workers", args.workers)
    positive_int("--batch-size", args.batch_size)
    if args.min_words < 0:
        raise DataCollectionError(f"--min-words must be 0 or more, got {args.min_words}")
    check_inputs([args.input])
    return args


def check_dependencies(languages: Sequence[str]) -> None:
    needed = ["ftfy"] + (["py3langid"] if languages else [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise DataCollectionError(f"cleanup needs {' and '.join(missing)}: pip install -e .[data]")


def main(argv: Optional[List[str]] = None) -> dict:
    """Clean the corpus; returns the report it writes."""
    args = get_args(argv)
    check_dependencies(args.languages)
    domains = BLACKLISTED_DOMAINS | (read_domain_list(args.blacklist_domains) if args.blacklist_domains else frozenset())
    cleaner = Cleaner(args.input, args.languages, args.min_words, args.min_language_probability, domains,
                      url_filter=not args.no_url_filter)
    cleaner.prepare()
    dropped: Counter = Counter()
    languages: Counter = Counter()
    examples: Dict[str, List[str]] = {reason: [] for reason in REASONS}
    documents = kept = repaired = 0
    start = time.time()
    with atomic_output(args.output) as out:
        for results in ordered_map(cleaner, batched(numbered_lines(args.input), args.batch_size), args.workers):
            for number, reason, language, changed, line in results:
                documents += 1
                repaired += changed
                if language is not None:
                    languages[language] += 1
                if reason is None:
                    out.write(line)
                    kept += 1
                else:
                    dropped[reason] += 1
                    if len(examples[reason]) < _EXAMPLES_PER_REASON:
                        examples[reason].append(f"{args.input}:{number}")
        report = {"input": args.input, "output": args.output, "documents": documents, "kept": kept,
                  "dropped": {reason: dropped[reason] for reason in REASONS}, "ftfy_repaired": repaired,
                  "languages": dict(languages.most_common()), "examples": examples,
                  "settings": {"languages": args.languages, "min_words": args.min_words,
                               "url_filter": not args.no_url_filter,
                               "min_language_probability": args.min_language_probability},
                  "input_bytes": os.path.getsize(args.input), "seconds": round(time.time() - start, 3)}
        atomic_write_json(args.report or args.output + ".report.json", report)
    print(f"cleanup: kept {kept} of {documents} documents ("
          + ", ".join(f"{reason} {dropped[reason]}" for reason in REASONS) + f") -> {args.output}", file=sys.stderr)
    return report


if __name__ == "__main__":
    run_tool(main, "cleanup.py")
