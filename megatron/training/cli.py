"""How every entry point ends on bad input: one line `PROG: error: MESSAGE` and exit status 1.

    if __name__ == "__main__":
        run_cli(main, "preprocess_data.py", errors=(PreprocessError,))

| outcome of main() | what the user sees | exit status |
|---|---|---|
| returns | whatever main printed | 0 |
| raises a user-input error (USER_INPUT_ERRORS, `errors=`) | `PROG: error: MESSAGE`, no traceback | 1 |
| raises anything else (a bug) | the traceback, as Python prints it | 1 |
| KeyboardInterrupt (Ctrl-C) | `PROG: interrupted` (or the tool's own line) | 130 |
| SystemExit (argparse's usage error: status 2) | unchanged | unchanged |

`MEGATRON_DEBUG=1` (any value but empty or 0) lets user-input errors raise as well, with their
traceback: the environment variable works the same for every entry point and reaches every
torchrun worker, where a flag would need adding to each tool's parser.

Under torchrun every rank usually fails on the same bad flag. Rank 0 prints the message; another
rank prints its own, prefixed `[rank N]`, only when it differs from rank 0's (or rank 0 reported
none within REPORT_WAIT_S): the ranks compare through the torchrun agent's key-value store
(MASTER_ADDR:MASTER_PORT). Without that store (not under torchrun), each rank above 0 prints
its message prefixed by its rank.
"""

from __future__ import annotations

import datetime
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

DEBUG_ENV = "MEGATRON_DEBUG"
# How long a rank above 0 waits for rank 0's message before printing its own.
REPORT_WAIT_S = 5.0

# The project's user-input errors, by (module, class). A class counts only once its module is
# imported (an error cannot come from a module that never ran), so reporting an error imports
# nothing heavy. Add a row for a new error class whose message names the flag, file or line.
USER_INPUT_ERRORS = (
    ("megatron.training.argument_utils", "ArgsError"),
    ("megatron.training.checkpointing", "CheckpointError"),
    ("megatron.data.indexed_dataset", "IndexedDatasetError"),
    ("megatron.training.tokenizer.tokenizer", "TokenizerConfigError"),
    ("megatron.core.optimizer_param_scheduler", "SchedulerMismatchError"),
    ("megatron.training.training", "NaNLossError"),
    ("tasks.errors", "TaskError"),
)
# OSErrors about a path the user named; their message carries the path.
_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def debug_requested() -> bool:
    """MEGATRON_DEBUG asks for tracebacks of user-input errors too."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def user_input_errors(extra: tuple = ()) -> tuple:
    """The exception classes reported as one line: the project's (of modules already imported),
    the path OSErrors, and `extra` (a tool's own)."""
    classes = list(_PATH_ERRORS) + list(extra)
    for module_name, class_name in USER_INPUT_ERRORS:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if cls is not None:
            classes.append(cls)
    return tuple(classes)


def run_cli(main: Callable[[], Any], prog: str | None = None, errors: tuple = (),
            interrupted: str | None = None) -> NoReturn:
    """Run main() as a program: exit 0 when it returns, 1 with one line on a user-input error.

    prog: the name in the message (default: the script's file name). errors: the tool's own
    user-input exception classes. interrupted: the line printed on Ctrl-C.
    """
    prog = prog or os.path.basename(sys.argv[0])
    try:
        main()
    except KeyboardInterrupt:
        if debug_requested():
            raise
        print(f"{prog}: {interrupted or 'interrupted'}", file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as error:  # noqa: BLE001 - sorted into user errors and bugs just below
        if debug_requested() or not isinstance(error, user_input_errors(errors)):
            raise
        report_error(prog, error_message(error))
        sys.exit(1)
    sys.exit(0)


def error_message(error: BaseException) -> str:
    """The one line for error: its message (an OSError's strerror and path when it has them)."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return str(error) or type(error).__name__


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def report_error(prog: str, message: str, store: Any = None) -> None:
    """Print `prog: error: message` on stderr once per job (see the module docstring).

    store: a key-value store with set/get/wait (tests pass a fake); by default the torchrun
    agent's, or none.
    """
    line = f"{prog}: error: {message}"
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if world_size <= 1:
        print(line, file=sys.stderr, flush=True)
        return
    if store is None:
        store = _agent_store()
    key = "megatron_cli_error/{}/{}/".format(os.environ.get("TORCHELASTIC_RUN_ID", ""),
                                             os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        _store_call(store, "set", key + "0", message)
        print(line, file=sys.stderr, flush=True)
        return
    if _rank0_message(store, key + "0") != message:
        print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)


def _rank0_message(store: Any, key: str) -> str | None:
    if store is None or _store_call(store, "wait", [key], datetime.timedelta(seconds=REPORT_WAIT_S)) is False:
        return None
    value = _store_call(store, "get", key)
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def _store_call(store: Any, method: str, *args: Any) -> Any:
    """store.method(*args), or False when there is no store or it fails (timeout, gone)."""
    if store is None:
        return False
    try:
        result = getattr(store, method)(*args)
    except Exception:  # noqa: BLE001 - reporting must never fail: the caller prints anyway
        return False
    return True if result is None else result


def _agent_store() -> Any:
    """A client of the torchrun agent's TCPStore, or None when not under torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    try:
        distributed = importlib.import_module("torch.distributed")
        return distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=datetime.timedelta(seconds=REPORT_WAIT_S))
    except Exception:  # noqa: BLE001 - no store: every rank reports
        return None
