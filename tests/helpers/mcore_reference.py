"""Run code in megatron-core from PyPI, the numerical reference, and get its result back.

megatron-core's package is called `megatron`, like ours, so it cannot be imported into the test
process. `make setup-test` installs it with --no-deps into .venv/peers/megatron_core (the
MEGATRON_CORE_PATH environment variable overrides the folder); `run_mcore` runs a Python
snippet in a process whose PYTHONPATH is that folder alone, and the snippet hands its result back
by calling `emit(obj)` (JSON). Each snippet gets a process of its own, forked from one server
interpreter that imported megatron-core once for the session. `patch_for_cpu()` (megatron-core's
CUDA-only helpers redone on CPU, bench/mcore_cpu_patches.py) and `init_one_rank(seed)` (a one-process
gloo group and megatron-core's parallel state) are defined in every snippet. Tests
that need the reference skip, with the install command, when it is missing.

    from tests.helpers.mcore_reference import run_mcore

    def test_blend_matches_megatron_core(tmp_path):
        ref = run_mcore('''
            from megatron.core.datasets.utils import normalize
            emit(normalize([1, 3]))
        ''')
        assert ref == [0.25, 0.75]

A snippet may also write files (e.g. a checkpoint) under a folder the test passes in.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

from tests.helpers.paths import ROOT

MCORE_PATH = Path(os.environ.get("MEGATRON_CORE_PATH", ROOT / ".venv" / "peers" / "megatron_core"))
INSTALL_HINT = (f"{sys.executable} -m pip install --no-deps --target {MCORE_PATH} megatron-core==0.16.1 "
                "(make setup-test does this)")

_PRELUDE = '''
import json, os, sys, warnings
warnings.filterwarnings("ignore")
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != {root!r}]
import megatron.core
assert os.path.realpath(megatron.core.__file__).startswith({mcore!r}), megatron.core.__file__

def emit(obj):
    print("\\n@@MCORE@@" + json.dumps(obj), flush=True)


def init_one_rank(seed):
    """A one-process gloo group, megatron-core's parallel state and its model-parallel RNG seed
    (call after patch_for_cpu())."""
    import tempfile
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    rendezvous = tempfile.mktemp(prefix="mcore-pg-")
    torch.distributed.init_process_group("gloo", init_method="file://" + rendezvous, rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(seed)

'''


def mcore_available() -> bool:
    """True when megatron-core's package is installed at MCORE_PATH."""
    return (MCORE_PATH / "megatron" / "core" / "__init__.py").is_file()


def require_mcore() -> None:
    """Skip the calling test, naming the install command, when megatron-core is missing."""
    if not mcore_available():
        pytest.skip(f"megatron-core (the reference) is not installed at {MCORE_PATH}: {INSTALL_HINT}")


_SERVER = '''
import os, signal, traceback
_reply_fd = os.dup(1)  # the protocol's channel; snippets' output goes to files


def _reply(obj):
    os.write(_reply_fd, (json.dumps(obj) + "\\n").encode())


def _run(request):
    out = os.open(request["out"] + ".stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(request["out"] + ".stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.update(request["env"])
    status = 0
    try:
        # the prelude's names (json, os, sys, emit, patch_for_cpu...) as in a script of its own; this
        # process is the snippet's alone, so its globals are the snippet's to change
        exec(compile(request["code"], "<megatron-core snippet>", "exec"), globals())
    except SystemExit as exit:
        status = exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


_reply({"ready": True})
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        _run(request)
    _reply({"pid": pid})
    _, status = os.waitpid(pid, 0)
    _reply({"status": os.waitstatus_to_exitcode(status)})
'''


class _Server:
    """One interpreter that imports megatron-core once and forks a child per snippet.

    Importing megatron-core takes ~4 s (it imports torch's compiler stack); a forked child starts
    with it imported, and with nothing else the previous snippets did (process groups, patches,
    environment), as a fresh interpreter would.
    """

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="mcore-server-"))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE",
                                                                 "LOCAL_RANK", "MASTER_PORT")}
        # one thread, and torch.compile without Inductor's worker pool (see tests/conftest.py): a pool
        # started in one forked snippet does not belong in the next
        env.update({"PYTHONPATH": str(MCORE_PATH), "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"})
        patches = (ROOT / "bench" / "mcore_cpu_patches.py").read_text()
        script = (_PRELUDE.format(root=os.path.realpath(ROOT), mcore=os.path.realpath(MCORE_PATH)) + patches
                  + _SERVER)
        self.stderr = open(self.folder / "server.stderr", "w")
        self.process = subprocess.Popen([sys.executable, "-c", script], cwd=str(MCORE_PATH), env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        text=True, bufsize=1, start_new_session=True)
        self.ready = False
        self.count = 0
        atexit.register(self.close)

    def _read(self, deadline: float) -> Dict[str, Any]:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
            self.close()
            raise AssertionError("megatron-core snippet timed out")
        line = self.process.stdout.readline()
        if not line:
            self.close()
            raise AssertionError("the megatron-core server died:\n"
                                 + (self.folder / "server.stderr").read_text()[-4000:])
        return json.loads(line)

    def run(self, code: str, timeout: float, cwd: Path, env: Dict[str, str]) -> subprocess.CompletedProcess:
        deadline = time.monotonic() + timeout
        if not self.ready:
            self._read(deadline)
            self.ready = True
        self.count += 1
        out = str(self.folder / f"snippet{self.count}")
        self.process.stdin.write(json.dumps({"code": code, "out": out, "cwd": str(cwd), "env": env}) + "\n")
        self.process.stdin.flush()
        child = self._read(deadline)["pid"]
        try:
            status = self._read(deadline)["status"]
        except AssertionError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
            raise
        return subprocess.CompletedProcess([], status, Path(out + ".stdout").read_text(),
                                           Path(out + ".stderr").read_text())

    def close(self) -> None:
        global _server
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        if _server is self:
            _server = None


_server: Optional[_Server] = None


def start_server() -> None:
    """Start the megatron-core interpreter now (it imports in the background while other tests
    run); a no-op when megatron-core is missing or the server runs already."""
    global _server
    if _server is None and mcore_available():
        _server = _Server()


def run_mcore(code: str, timeout: float = 900.0, cwd: Optional[Path] = None,
              env: Optional[Dict[str, str]] = None) -> Any:
    """Run `code` (dedented) under megatron-core; return what it passed to emit() (None if nothing).

    Skips when megatron-core is missing; raises AssertionError with the output when the
    snippet fails. Each snippet runs in a process of its own, forked from one that has
    imported megatron-core (start_server).
    """
    require_mcore()
    start_server()
    done = _server.run(textwrap.dedent(code), timeout, cwd or MCORE_PATH, dict(env or {}))
    if done.returncode != 0:
        raise AssertionError(f"megatron-core snippet failed (exit {done.returncode}):\n"
                             f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    marker = done.stdout.rfind("@@MCORE@@")
    if marker < 0:
        return None
    return json.loads(done.stdout[marker + len("@@MCORE@@"):].splitlines()[0])
