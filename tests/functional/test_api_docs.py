"""docs/api.md's first Python block that calls pretrain( runs as it stands from the repository root."""

import ast
import re
import subprocess
import sys

from tests.helpers.paths import ROOT


def test_the_documented_example_runs_from_the_repository_root(tmp_path):
    text = (ROOT / "docs" / "api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(block for block in blocks if "pretrain(" in block)
    proc = subprocess.run([sys.executable, "-c", example], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = ast.literal_eval(proc.stdout.strip().splitlines()[-1])  # the example's printed list of floats
    assert len(losses) == 3 and all(isinstance(x, float) and 0 < x < 10 for x in losses)
    assert " iteration        3/       3 |" in proc.stdout
