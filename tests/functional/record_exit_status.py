"""Run `python ARGS...` and write its exit status to $EXIT_STATUS_DIR/rank<RANK>, then exit with it.

A launcher for tests: torchrun starts it in place of the training script so that the test learns
each training process's own exit status (torchrun reports none when it is itself signalled).
It survives SIGTERM (a no-op handler, reset to the default in the child by exec) so that it can
wait for the training process, which gets the signal itself.
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    status = subprocess.call([sys.executable, *sys.argv[1:]])
    Path(os.environ["EXIT_STATUS_DIR"], f"rank{os.environ['RANK']}").write_text(str(status))
    sys.exit(status if status >= 0 else 128 - status)
