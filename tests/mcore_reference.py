"""Run code in megatron-core from PyPI, the numerical reference, and get its result back.

megatron-core's package is called `megatron`, like ours, so it cannot be imported into the test
process. `make setup-test` installs it with --no-deps into .venv/peers/megatron_core (the
MEGATRON_CORE_PATH environment variable overrides the folder); `run_mcore` runs a Python
snippet in a fresh interpreter whose PYTHONPATH is that folder alone, and the snippet hands its
result back by calling `emit(obj)` (JSON). Tests that need the reference skip, with the
install command, when it is missing.

    from tests.mcore_reference import run_mcore

    def test_blend_matches_megatron_core(tmp_path):
        ref = run_mcore('''
            from megatron.core.datasets.utils import normalize
            emit(normalize([1, 3]))
        ''')
        assert ref == [0.25, 0.75]

A snippet may also write files (e.g. a checkpoint) under a folder the test passes in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
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

'''


def mcore_available() -> bool:
    """True when megatron-core's package is installed at MCORE_PATH."""
    return (MCORE_PATH / "megatron" / "core" / "__init__.py").is_file()


def require_mcore() -> None:
    """Skip the calling test, naming the install command, when megatron-core is missing."""
    if not mcore_available():
        pytest.skip(f"megatron-core (the reference) is not installed at {MCORE_PATH}: {INSTALL_HINT}")


def run_mcore(code: str, timeout: float = 300.0, cwd: Optional[Path] = None,
              env: Optional[Dict[str, str]] = None) -> Any:
    """Run `code` (dedented) under megatron-core; return what it passed to emit() (None if nothing).

    Skips when megatron-core is missing; raises AssertionError with the output when the
    snippet fails.
    """
    require_mcore()
    # patch_for_cpu() and MCORE_CPU_PATCHES come with every snippet (bench/mcore_cpu_patches.py)
    patches = (ROOT / "bench" / "mcore_cpu_patches.py").read_text()
    script = (_PRELUDE.format(root=os.path.realpath(ROOT), mcore=os.path.realpath(MCORE_PATH)) + patches
              + textwrap.dedent(code))
    child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE",
                                                                  "LOCAL_RANK", "MASTER_PORT")}
    child_env.update({"PYTHONPATH": str(MCORE_PATH), "OMP_NUM_THREADS": "1"})
    child_env.update(env or {})
    done = subprocess.run([sys.executable, "-c", script], cwd=str(cwd or MCORE_PATH), env=child_env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"megatron-core snippet failed (exit {done.returncode}):\n"
                             f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    marker = done.stdout.rfind("@@MCORE@@")
    if marker < 0:
        return None
    return json.loads(done.stdout[marker + len("@@MCORE@@"):].splitlines()[0])
