"""Build the project's built-in default corpus from what ships with Python itself.

    python tools/make_default_corpus.py --output data/default/corpus.jsonl

Every machine that runs this project has a Python installation, and every Python ships its
language reference (the `pydoc_data` topics that `help()` shows) and the sources of its
standard library. Those become a loose-JSON corpus, one document per line with the fields
`text`, `source` (`python-docs` or `python-stdlib`) and `title`, so that the whole data path
(tokenizer training, preprocessing, training) can run with nothing downloaded.

Test suites, caches, `site-packages` and the machine-generated codec tables under
`encodings/` are left out. The order is sorted, so two runs on one Python give the same file.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import sysconfig
import tempfile
from typing import Dict, Iterator, List, Optional

_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data"}


def documentation_topics() -> Iterator[Dict[str, str]]:
    """The language reference topics that ship with Python (what `help('if')` prints)."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield {"text": topics[name], "source": "python-docs", "title": name}


def stdlib_sources(max_file_bytes: int) -> Iterator[Dict[str, str]]:
    """The standard library's .py sources, by relative path."""
    stdlib = sysconfig.get_path("stdlib")
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _EXCLUDED_DIRS)
        for name in sorted(files):
            path = os.path.join(root, name)
            if not name.endswith(".py") or os.path.getsize(path) > max_file_bytes:
                continue
            try:
                with open(path, "r", encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue  # a few test fixtures are deliberately not UTF-8
            if text.strip():
                yield {"text": text, "source": "python-stdlib", "title": os.path.relpath(path, stdlib)}


def build_corpus(output: str, max_documents: Optional[int] = None, max_file_bytes: int = 256 * 1024) -> int:
    """Write the corpus to `output` (atomically); returns the number of documents."""
    if os.path.isdir(output):  # found now, not by the final rename
        raise IsADirectoryError(errno.EISDIR, "is a folder; give --output the path of the .jsonl file to write",
                                output)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".corpus-", suffix=".tmp", dir=os.path.dirname(os.path.abspath(output)))
    count = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for sources in (documentation_topics(), stdlib_sources(max_file_bytes)):
                for document in sources:
                    if max_documents is not None and count >= max_documents:
                        break
                    f.write(json.dumps(document, ensure_ascii=False) + "\n")
                    count += 1
        os.chmod(tmp, 0o644)
        os.replace(tmp, output)
    except BaseException:
        os.unlink(tmp)
        raise
    return count


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="Path of the JSON lines file to write")
    parser.add_argument("--max-documents", type=int, default=None, help="Stop after this many documents")
    parser.add_argument("--max-file-bytes", type=int, default=256 * 1024,
                        help="Skip source files larger than this (generated tables)")
    args = parser.parse_args(argv)
    count = build_corpus(args.output, args.max_documents, args.max_file_bytes)
    size = os.path.getsize(args.output)
    print(f"Wrote {count} documents ({size / 1024 / 1024:.1f} MB) from Python {sys.version.split()[0]} "
          f"to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron.training.cli import run_cli

    run_cli(main, "make_default_corpus.py")
