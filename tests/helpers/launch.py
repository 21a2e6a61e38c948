"""Running the project's scripts in subprocesses: `python ...` from the repository root, torchrun, free ports."""
import os
import socket
import subprocess
import sys

from tests.helpers.paths import ROOT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cli(args, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, **kwargs)


def torchrun(nproc, flags):
    """`torchrun --nproc-per-node nproc pretrain_gpt.py *flags` on a free port (run_cli's result)."""
    return run_cli(["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                    str(free_port()), "pretrain_gpt.py", *flags])
