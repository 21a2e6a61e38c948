"""pretrain_gpt.py as a command: under torchrun, bad input ends with its one line once (not once
per rank) and exit status 1; with MEGATRON_DEBUG=1 the traceback is shown. (In-process cases of
every entry point: tests/unit/test_cli_errors.py.)"""

import os
import socket

from tests.helpers.launch import run_cli
from tests.helpers.training import MOCK, TINY

BAD = [*TINY, *MOCK, "--train-iters", "1", "--adam-beta1", "1.5"]
MESSAGE = "pretrain_gpt.py: error: --adam-beta1 must be in [0, 1), got 1.5"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_megatron_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("MEGATRON_DEBUG", "1")
    proc = run_cli(["pretrain_gpt.py", *BAD])
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("megatron.training.argument_utils.ArgsError: "
                                                    "--adam-beta1 must be in [0, 1), got 1.5")


def test_under_torchrun_the_message_appears_once(monkeypatch):
    monkeypatch.delenv("MEGATRON_DEBUG", raising=False)
    proc = run_cli(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
                    "pretrain_gpt.py", *BAD])
    assert proc.returncode == 1
    output = proc.stdout + proc.stderr
    assert output.count("--adam-beta1 must be in [0, 1)") == 1, output
    assert MESSAGE in proc.stderr.splitlines()  # the whole line, from rank 0
    # torchrun's own failure report follows; no worker printed a traceback of ours
    assert "megatron/training/arguments_validation.py" not in output and os.sep + "pretrain_gpt.py\", line" not in output
