"""Throughput of tools/preprocess_data.py: documents/s and tokens/s with 1 and 2 workers.

    python bench/preprocess.py                 # on the built-in default corpus (make run builds it)
    python bench/preprocess.py --corpus ../shared/data/corpus/kjv_shakespeare.jsonl \
        --vocab-dir ../shared/data/tokenizers/gpt2

Without a built default corpus or tokenizer it makes them in a temporary folder first.
Prints what it measured; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import make_default_corpus, preprocess_data  # noqa: E402


def ensure_inputs(corpus: str, vocab_dir: str, scratch: str):
    """Default corpus and tokenizer, built into `scratch` when they are not there."""
    if not os.path.exists(corpus):
        corpus = os.path.join(scratch, "corpus.jsonl")
        print(f"building the default corpus in {corpus}")
        make_default_corpus.build_corpus(corpus)
    if not os.path.exists(os.path.join(vocab_dir, "vocab.json")):
        from tools import train_tokenizer

        vocab_dir = os.path.join(scratch, "tokenizer")
        print(f"training the default tokenizer in {vocab_dir}")
        train_tokenizer.main(["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer",
                              "--vocab-size", "8192", "--output-dir", vocab_dir])
    return corpus, vocab_dir


def run_once(corpus: str, vocab_dir: str, workers: int, partitions: int, out_dir: str):
    argv = ["--input", corpus, "--output-prefix", os.path.join(out_dir, f"w{workers}p{partitions}"),
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(vocab_dir, "vocab.json"),
            "--merge-file", os.path.join(vocab_dir, "merges.txt"), "--append-eod",
            "--workers", str(workers), "--partitions", str(partitions), "--log-interval", "100000000"]
    start = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):
        result = preprocess_data.main(argv)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default=os.path.join(ROOT, "data", "default", "corpus.jsonl"))
    parser.add_argument("--vocab-dir", default=os.path.join(ROOT, "data", "default", "tokenizer"))
    parser.add_argument("--configs", nargs="+", default=["1x1", "2x1", "2x2"],
                        help="WORKERSxPARTITIONS settings to time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        corpus, vocab_dir = ensure_inputs(args.corpus, args.vocab_dir, scratch)
        print(f"corpus {corpus} ({os.path.getsize(corpus) / 1e6:.1f} MB), GPT2BPETokenizer from {vocab_dir}, "
              f"{os.cpu_count()} CPUs")
        print(f"{'workers':>8} {'partitions':>10} {'seconds':>8} {'docs/s':>10} {'tokens/s':>11} {'MB/s':>7}")
        base = None
        for config in args.configs:
            workers, partitions = (int(x) for x in config.split("x"))
            result, seconds = run_once(corpus, vocab_dir, workers, partitions, scratch)
            base = base or result.tokens / seconds
            print(f"{workers:>8} {partitions:>10} {seconds:>8.2f} {result.documents / seconds:>10.1f} "
                  f"{result.tokens / seconds:>11.0f} {result.bytes / seconds / 1e6:>7.2f}"
                  f"   ({result.tokens / seconds / base:.2f}x the first row)")
        print(f"{result.documents} documents, {result.tokens} tokens per run")


if __name__ == "__main__":
    main()
