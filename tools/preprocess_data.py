"""Tokenize a loose-JSON corpus into Megatron's indexed dataset files.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix my-gpt2 \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 2

Every line of the input is a JSON object; the text under each --json-keys key becomes one
document of `{output_prefix}_{key}_document.bin/.idx` (`_sentence` with --split-sentences,
where each sentence is one sequence). Files with a `.gz` suffix are read through gzip. The input
may also be a pipe, read once as a stream (`--input <(zstdcat corpus.jsonl.zst)`, one partition).

Differences from Megatron-LM's script, all in the direction of safety:
  * the output never exists half-written: every file is written under a temporary name and
    renamed when complete; a failure or Ctrl-C removes the temporaries;
  * a malformed JSON line, a line that is not UTF-8 or a missing key stops the run with
    `FILE:LINE: reason` (--skip-bad-lines skips such lines and reports how many); blank lines
    are skipped; an input with no document at all is an error, and writes nothing;
  * --partitions cuts the input into contiguous line ranges, so the merged output is
    byte-identical to a single-partition run whatever --workers and --partitions are
    (Megatron cuts round-robin unless --keep-sequential-samples); partition files live in a
    temporary folder beside the output, not beside the input.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.cli import run_cli
from megatron.data.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.training.tokenizer import add_tokenizer_args, build_tokenizer


class PreprocessError(RuntimeError):
    """Bad input or settings; the message names the flag, file or line."""


# ----------------------------------------------------------------------------- arguments


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True, help="Path to the input JSON lines file (.gz allowed)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="Keys to extract from each JSON line")
    group.add_argument("--split-sentences", action="store_true", help="Split documents into sentences (NLTK punkt)")
    group.add_argument("--keep-newlines", action="store_true",
                       help="Keep the whitespace and newlines between sentences when splitting")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="Skip malformed JSON lines and lines without a key (counted), instead of stopping")

    add_tokenizer_args(parser)
    group = parser.add_argument_group(title="tokenization process")
    group.add_argument("--append-eod", action="store_true", help="Append an <eod> token to the end of a document")
    group.add_argument("--lang", type=str, default="english", help="Language of the NLTK punkt sentence splitter")

    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True, help="Path prefix of the binary output files")

    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, required=True, help="Number of worker processes to launch")
    group.add_argument("--partitions", type=int, default=1, help="Number of file partitions")
    group.add_argument("--log-interval", type=int, default=1000, help="Interval between progress updates")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="Accepted for compatibility: partitions are always contiguous here")
    args = parser.parse_args(argv)
    _validate_args(args)
    # As in Megatron: no tensor parallelism, and a rank that keeps the tokenizer quiet.
    args.rank = 1
    args.tensor_model_parallel_size = 1
    return args


def is_pipe(path: str) -> bool:
    """A named pipe or a shell's process substitution (`--input <(zstdcat corpus.jsonl.zst)`):
    read once, as a stream, by a single partition."""
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def _validate_args(args: argparse.Namespace) -> None:
    if args.tokenizer_type is None:
        raise PreprocessError("--tokenizer-type is required")
    if not os.path.isfile(args.input):
        if not is_pipe(args.input):
            raise PreprocessError(f"--input {args.input}: no such file")
        if args.partitions > 1:
            raise PreprocessError(f"--input {args.input} is a pipe, which can be read once: "
                                  f"--partitions {args.partitions} needs a file (use --partitions 1)")
    if args.workers < 1:
        raise PreprocessError(f"--workers must be at least 1 (got {args.workers})")
    if args.partitions < 1:
        raise PreprocessError(f"--partitions must be at least 1 (got {args.partitions})")
    if args.workers < args.partitions:
        raise PreprocessError(
            f"--workers ({args.workers}) must be at least --partitions ({args.partitions}): "
            "each partition needs a worker"
        )
    if args.log_interval < 1:
        raise PreprocessError(f"--log-interval must be at least 1 (got {args.log_interval})")
    if args.keep_newlines and not args.split_sentences:
        raise PreprocessError("--keep-newlines only applies with --split-sentences")
    if args.tokenizer_type.lower().startswith("bert") and not args.split_sentences:
        print("Bert tokenizer detected, are you sure you don't want to split sentences?", file=sys.stderr)


def output_prefixes(args: argparse.Namespace, output_prefix: Optional[str] = None) -> dict:
    """{key: `{prefix}_{key}_{document|sentence}`} for every --json-keys key."""
    level = "sentence" if args.split_sentences else "document"
    prefix = output_prefix or args.output_prefix
    return {key: f"{prefix}_{key}_{level}" for key in args.json_keys}


# ----------------------------------------------------------------------------- sentences


def check_punkt(lang: str) -> None:
    """Fail early, with the fix, when NLTK or its punkt data is missing."""
    try:
        import nltk
    except ImportError:
        raise PreprocessError("--split-sentences needs NLTK: pip install nltk") from None
    try:
        nltk.data.find(f"tokenizers/punkt_tab/{lang}/")
    except LookupError:
        raise PreprocessError(
            f"--split-sentences needs NLTK's punkt_tab data for --lang {lang}, which was not found in "
            f"{nltk.data.path}. Fetch it once with: python -c \"import nltk; nltk.download('punkt_tab')\" "
            "or point NLTK_DATA at a folder holding tokenizers/punkt_tab(.zip)"
        ) from None


class SentenceSplitter:
    """NLTK punkt; with keep_newlines each sentence keeps the whitespace that follows it,
    so the sentences of a document concatenate back to the document."""

    def __init__(self, lang: str, keep_newlines: bool) -> None:
        from nltk.tokenize.punkt import PunktTokenizer

        self._punkt = PunktTokenizer(lang)
        self._keep_newlines = keep_newlines

    def split(self, text: str) -> List[str]:
        if not self._keep_newlines:
            return self._punkt.tokenize(text)
        starts = [start for start, _ in self._punkt.span_tokenize(text)]
        if not starts:
            return [text] if text else []
        starts[0] = 0
        return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


# ----------------------------------------------------------------------------- encoding


@dataclass
class EncodedLine:
    line_number: int
    num_bytes: int
    documents: dict = field(default_factory=dict)  # key -> (token ids, sentence lengths)
    error: Optional[str] = None
    blank: bool = False


class Encoder:
    """Tokenizes one JSON line; one instance per worker process (built in initializer)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def initializer(self) -> None:
        Encoder.tokenizer = build_tokenizer(self.args)
        Encoder.splitter = (
            SentenceSplitter(self.args.lang, self.args.keep_newlines) if self.args.split_sentences else None
        )

    def encode(self, numbered_line: Tuple[int, bytes]) -> EncodedLine:
        line_number, raw = numbered_line
        result = EncodedLine(line_number, len(raw))
        try:  # decoded line by line (not by the file object) so that the error names its line
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            result.error = f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)"
            return result
        if not line.strip():
            result.blank = True
            return result
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            result.error = f"malformed JSON ({e})"
            return result
        if not isinstance(data, dict):
            result.error = f"expected a JSON object, got {type(data).__name__}"
            return result
        for key in self.args.json_keys:
            if key not in data:
                result.error = f"missing key '{key}' (keys present: {', '.join(sorted(data)) or 'none'})"
                return result
            text = data[key]
            if isinstance(text, str):
                sentences = self.splitter.split(text) if self.splitter else [text]
            elif isinstance(text, list) and all(isinstance(s, str) for s in text):
                sentences = text  # already split, as Megatron accepts
            else:
                result.error = f"key '{key}' holds {type(text).__name__}, not text"
                return result
            result.documents[key] = self._tokenize(sentences)
        return result

    def _tokenize(self, sentences: List[str]) -> Tuple[List[int], List[int]]:
        ids: List[int] = []
        lengths: List[int] = []
        for sentence in sentences:
            sentence_ids = self.tokenizer.tokenize(sentence)
            if sentence_ids:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if ids and self.args.append_eod:
            # the EOD token belongs to the document's last sentence
            ids.append(self.tokenizer.eod)
            lengths[-1] += 1
        return ids, lengths


# ----------------------------------------------------------------------------- one partition


def _open_lines(path: str):
    """The input as binary lines; the encoder decodes each line, naming the one that is not UTF-8."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _numbered_lines(path: str, first_line_number: int) -> Iterator[Tuple[int, bytes]]:
    with _open_lines(path) as f:
        for i, line in enumerate(f):
            yield first_line_number + i, line


@dataclass
class PartitionResult:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    blank_lines: int = 0
    skipped_lines: int = 0
    skipped_examples: List[Tuple[int, str]] = field(default_factory=list)  # (line number, message)


def process_partition(
    args: argparse.Namespace,
    input_path: str,
    first_line_number: int,
    output_prefix: str,
    workers: int,
    display_name: str,
    allow_empty: bool = False,
) -> PartitionResult:
    """Tokenize one input file into `{output_prefix}_{key}_{level}` datasets.

    Without allow_empty an input with no document raises PreprocessError and writes nothing.
    """
    encoder = Encoder(args)
    encoder.initializer()
    dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)
    builders = {}
    pool = None
    try:
        for key, prefix in output_prefixes(args, output_prefix).items():
            builders[key] = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
        lines = _numbered_lines(input_path, first_line_number)
        if workers > 1:
            pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
            encoded = pool.imap(encoder.encode, lines, chunksize=32)
        else:
            encoded = map(encoder.encode, lines)
        result = _write_encoded(args, encoded, builders, display_name)
        if not allow_empty:
            check_not_empty(result, display_name)
        for key, prefix in output_prefixes(args, output_prefix).items():
            builders[key].finalize(get_idx_path(prefix))
        return result
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()


def _write_encoded(args, encoded, builders, display_name: str) -> PartitionResult:
    result = PartitionResult()
    start = time.time()
    for item in encoded:
        result.bytes += item.num_bytes
        if item.blank:
            result.blank_lines += 1
            continue
        if item.error is not None:
            message = f"{display_name}:{item.line_number}: {item.error}"
            if not args.skip_bad_lines:
                raise PreprocessError(message + " (use --skip-bad-lines to skip such lines)")
            result.skipped_lines += 1
            if len(result.skipped_examples) < 5:
                result.skipped_examples.append((item.line_number, message))
            continue
        for key, (ids, lengths) in item.documents.items():
            builders[key].add_document(ids, lengths)
            result.tokens += len(ids)
        result.documents += 1
        if result.documents % args.log_interval == 0:
            elapsed = max(time.time() - start, 1e-9)
            print(f"Processed {result.documents} documents "
                  f"({result.documents / elapsed:.2f} docs/s, {result.bytes / elapsed / 1024 / 1024:.2f} MB/s).",
                  file=sys.stderr, flush=True)
    return result


# ----------------------------------------------------------------------------- partitions


def split_input(input_path: str, partitions: int, work_dir: str) -> List[Tuple[str, int]]:
    """Cut the input into contiguous line ranges: [(partition file, its first line number)]."""
    with _open_lines(input_path) as f:
        num_lines = sum(1 for _ in f)
    per_partition = -(-num_lines // partitions)  # ceil
    parts = []
    with _open_lines(input_path) as f:
        for p in range(partitions):
            path = os.path.join(work_dir, f"partition_{p}.jsonl")
            with open(path, "wb") as out:
                for _ in range(per_partition):
                    line = f.readline()
                    if not line:
                        break
                    out.write(line)
            parts.append((path, 1 + p * per_partition))
    return parts


def check_not_empty(result: PartitionResult, display_name: str) -> None:
    """An input without a single document is a mistake (wrong file, wrong --json-keys, all lines
    skipped): say so rather than write a 0-document dataset over a good one."""
    if result.documents:
        return
    seen = [f"{count} {what}" for count, what in ((result.blank_lines, "blank lines"),
                                                   (result.skipped_lines, "bad lines skipped")) if count]
    found = f"only {' and '.join(seen)}" if seen else "the file is empty"
    raise PreprocessError(f"--input {display_name}: no documents to write ({found}); nothing was written")


def _partition_entry(queue, *partition_args) -> None:
    """Body of one partition process: report a result or the error text, never hang."""
    try:
        queue.put(("ok", process_partition(*partition_args, allow_empty=True)))
    except PreprocessError as e:
        queue.put(("error", str(e)))
    except BaseException as e:  # noqa: BLE001 - report anything to the parent, then fail
        queue.put(("error", f"{type(e).__name__}: {e}"))
        raise


def _run_partitions(args: argparse.Namespace, work_dir: str) -> PartitionResult:
    parts = split_input(args.input, args.partitions, work_dir)
    workers_per_partition = args.workers // args.partitions
    queue = multiprocessing.Queue()
    processes = []
    for p, (path, first_line) in enumerate(parts):
        process = multiprocessing.Process(
            target=_partition_entry,
            args=(queue, args, path, first_line, os.path.join(work_dir, f"part_{p}"),
                  workers_per_partition, args.input),
        )
        process.start()
        processes.append(process)
    try:
        outcomes = [queue.get() for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
    errors = [message for status, message in outcomes if status == "error"]
    if errors:
        raise PreprocessError(errors[0])

    total = PartitionResult()
    for _, part in outcomes:
        for name in ("documents", "tokens", "bytes", "blank_lines", "skipped_lines"):
            setattr(total, name, getattr(total, name) + getattr(part, name))
        total.skipped_examples.extend(part.skipped_examples)
    total.skipped_examples = sorted(total.skipped_examples)[:5]
    check_not_empty(total, args.input)
    _merge_partitions(args, [os.path.join(work_dir, f"part_{p}") for p in range(len(parts))])
    return total


def _merge_partitions(args: argparse.Namespace, partition_prefixes: List[str]) -> None:
    tokenizer = build_tokenizer(args)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    for key, final_prefix in output_prefixes(args).items():
        with IndexedDatasetBuilder(get_bin_path(final_prefix), dtype=dtype) as builder:
            for part_prefix in partition_prefixes:
                builder.add_index(output_prefixes(args, part_prefix)[key])
            builder.finalize(get_idx_path(final_prefix))


# ----------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> PartitionResult:
    """Run the whole preprocessing; raises PreprocessError (or FileNotFoundError) on bad input."""
    args = get_args(argv)
    if args.split_sentences:
        check_punkt(args.lang)
    build_tokenizer(args)  # fail now on a missing vocabulary, before any worker starts
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(output_dir, exist_ok=True)

    start = time.time()
    if args.partitions == 1:
        result = process_partition(args, args.input, 1, args.output_prefix, args.workers, args.input)
    else:
        work_dir = tempfile.mkdtemp(prefix=".preprocess-partitions-", dir=output_dir)
        try:
            result = _run_partitions(args, work_dir)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
    _print_summary(args, result, time.time() - start)
    return result


def _print_summary(args: argparse.Namespace, result: PartitionResult, elapsed: float) -> None:
    elapsed = max(elapsed, 1e-9)
    for _, message in result.skipped_examples:
        print(f"skipped {message}", file=sys.stderr)
    if result.skipped_lines:
        print(f"Skipped {result.skipped_lines} bad lines (--skip-bad-lines).", file=sys.stderr)
    if result.blank_lines:
        print(f"Skipped {result.blank_lines} blank lines.", file=sys.stderr)
    print(f"Done: {result.documents} documents, {result.tokens} tokens, {result.bytes / 1024 / 1024:.2f} MB "
          f"in {elapsed:.2f} s ({result.documents / elapsed:.2f} docs/s, {result.tokens / elapsed:.0f} tokens/s, "
          f"{result.bytes / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr)
    for prefix in output_prefixes(args).values():
        print(f"Wrote {get_bin_path(prefix)} and {get_idx_path(prefix)}", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main, "preprocess_data.py", errors=(PreprocessError,), interrupted="interrupted: no output was written")
