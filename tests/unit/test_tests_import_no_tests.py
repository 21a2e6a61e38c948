"""No file under tests/ imports a test module (`test_*.py`).

What two test modules share lives in tests/helpers/ (or a conftest.py). Importing a test module
from another one runs its module-level code a second time under another name, drags its fixtures
and `pytestmark` along, and ties the two files together so that editing a test breaks a stranger.
The check reads every tests/**/*.py with `ast` and refuses, anywhere in the file (module level,
inside functions, under `if`), every spelling of such an import:

    from tests.unit.test_x import y        import tests.unit.test_x
    from tests.unit import test_x          from .test_x import y        from . import test_x
    from ..unit.test_x import y            import tests.unit.test_x as x
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _is_test_module(name: str) -> bool:
    return name.startswith("test_")


def imports_of_test_modules(path: Path) -> list:
    """'file:line import ...' for every import of a test_* module in the file at `path`."""
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad = any(_is_test_module(part) for alias in node.names for part in alias.name.split("."))
        elif isinstance(node, ast.ImportFrom):
            module_parts = (node.module or "").split(".")
            # `from package import test_x` imports the module test_x (or a test function: as bad)
            bad = any(_is_test_module(part) for part in module_parts) or any(
                _is_test_module(alias.name) for alias in node.names)
        else:
            continue
        if bad:
            found.append((node.lineno, f"{where}:{node.lineno} {ast.unparse(node)}"))
    return [hit for _, hit in sorted(found)]


def test_no_file_under_tests_imports_a_test_module():
    found = [hit for path in sorted(TESTS.rglob("*.py")) for hit in imports_of_test_modules(path)]
    assert found == [], ("a test module is imported; move what it shares into tests/helpers/ "
                         "(or a conftest.py):\n" + "\n".join(found))


def test_the_reader_sees_every_spelling(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os\nfrom tests.helpers.launch import free_port\nimport tests.helpers\n"
        "from tests.unit.test_a import x\n"
        "import tests.unit.test_b\n"
        "import tests.unit.test_c as c\n"
        "from tests.unit import test_d\n"
        "from .test_e import y\n"
        "from . import test_f\n"
        "from ..unit.test_g import z\n"
        "def f():\n    from tests.functional.test_h import w\n"
        "    if True:\n        import test_i\n"
        "class K:\n    from tests.parallel import test_j as j\n")
    lines = [int(hit.split(" ", 1)[0].rsplit(":", 1)[1]) for hit in imports_of_test_modules(source)]
    assert lines == sorted(lines)
    assert set(lines) == {4, 5, 6, 7, 8, 9, 10, 12, 14, 16}
