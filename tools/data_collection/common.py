"""What every data-collection stage shares: reading JSON lines with FILE:LINE errors, compressed
inputs, atomic outputs and an order-keeping map over worker processes.

Nothing here unpickles data or runs code from it: inputs are parsed with json, xml.etree and
numpy (allow_pickle=False); the only pickling is of our own work batches between our own
processes.
"""

from __future__ import annotations

import bz2
import gzip
import json
import multiprocessing
import os
import sys
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class DataCollectionError(ValueError):
    """Bad input or settings; the message names the flag, or the FILE:LINE of the bad record."""


_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def run_tool(main: Callable[[], Any], prog: str, interrupted: str = "interrupted: no output was written") -> None:
    """megatron.training.cli.run_cli's contract without importing torch (2-3 s a start, and these
    tools need none): `PROG: error: MESSAGE` and status 1 on a DataCollectionError or an OSError
    naming a path, the traceback for a bug or with MEGATRON_DEBUG=1, status 130 on Ctrl-C."""
    debug = os.environ.get("MEGATRON_DEBUG", "") not in ("", "0")
    try:
        main()
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: {interrupted}", file=sys.stderr, flush=True)
        sys.exit(130)
    except (DataCollectionError, *_PATH_ERRORS) as error:
        if debug:
            raise
        message = f"{error.filename}: {error.strerror}" if isinstance(error, OSError) and error.filename else str(error)
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(0)


Line = Tuple[int, bytes]  # (line number from 1, the raw line)


def open_input(path: str):
    """A binary reader of `path`, through bz2 or gzip by suffix; a missing file is a one-line error."""
    try:
        if path.endswith(".bz2"):
            return bz2.open(path, "rb")
        if path.endswith(".gz"):
            return gzip.open(path, "rb")
        return open(path, "rb")
    except (FileNotFoundError, IsADirectoryError, PermissionError) as error:
        raise DataCollectionError(f"{path}: {error.strerror}") from None


def numbered_lines(path: str) -> Iterator[Line]:
    """(line number, raw bytes) of every non-blank line; a truncated or corrupt compressed file
    is reported at the line where its data ends."""
    number = 0
    with open_input(path) as f:
        try:
            for number, raw in enumerate(f, start=1):
                if raw.strip():
                    yield number, raw
        except (EOFError, OSError) as error:  # bz2/gzip: truncated stream, bad CRC, not compressed
            raise DataCollectionError(f"{path}:{number + 1}: the compressed data is damaged or truncated "
                                      f"({error})") from None


def batched(items: Iterable[Any], size: int) -> Iterator[List[Any]]:
    batch: List[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def parse_document(path: str, number: int, raw: bytes, key: str = "text") -> dict:
    """The JSON object on one line, with a `key` string; DataCollectionError naming FILE:LINE."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataCollectionError(f"{path}:{number}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at byte "
                                  f"{error.start} of the line)") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataCollectionError(f"{path}:{number}: not valid JSON ({error.msg}, column {error.colno})") from None
    if not isinstance(record, dict):
        raise DataCollectionError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
    if not isinstance(record.get(key), str):
        raise DataCollectionError(f"{path}:{number}: no {key!r} string in the object")
    return record


def dump_line(record: dict) -> bytes:
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


@contextmanager
def atomic_output(path: str, mode: str = "wb"):
    """A file object writing to a temporary name beside `path`, renamed to `path` only when the
    block ends without an exception (otherwise removed): `path` never exists half-written."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_json(path: str, value: Any) -> None:
    with atomic_output(path, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.write("\n")


_WORKER_FN: Optional[Callable] = None


def _init_worker(fn: Callable) -> None:
    global _WORKER_FN
    _WORKER_FN = fn


def _call_worker(item: Any) -> Any:
    return _WORKER_FN(item)


def ordered_map(fn: Callable, items: Iterable[Any], workers: int) -> Iterator[Any]:
    """fn over items, results in input order, on `workers` processes (in this process when 1).

    fn is sent once to each worker (a module-level function or functools.partial of one); items
    stream through: at most a few batches per worker are in flight, so memory does not grow with
    the input.
    """
    if workers <= 1:
        for item in items:
            yield fn(item)
        return
    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(fn,)) as pool:
        # imap reads its input eagerly; feed it through a window so memory stays bounded.
        window = 4 * workers
        pending: List[Any] = []
        iterator = iter(items)
        for item in iterator:
            pending.append(pool.apply_async(_call_worker, (item,)))
            if len(pending) >= window:
                yield pending.pop(0).get()
        while pending:
            yield pending.pop(0).get()


def positive_int(flag: str, value: int) -> int:
    if value < 1:
        raise DataCollectionError(f"{flag} must be at least 1, got {value}")
    return value


def check_inputs(paths: Sequence[str], flag: str = "--input") -> None:
    for path in paths:
        if not os.path.isfile(path):
            raise DataCollectionError(f"{flag} {path}: no such file")
