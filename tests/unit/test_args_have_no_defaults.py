"""A run's Namespace has a fixed set of attributes (every flag's dest, and arguments.RUN_STATE), so the
library reads them as attributes: `getattr(args, "name", default)` would hide a misspelt name or a
setting that no longer exists behind its default. The exceptions are readers of args that another
release or program wrote, each named here with why."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (path prefix, function or "*"): where a getattr with a default on `args` is the point
ALLOWED = {
    ("megatron/convert/", "*"): "the checkpoint converter reads the args a checkpoint stored, whatever "
                                "release (Megatron-LM's, ours) saved them",
    ("megatron/training/tokenizer/tokenizer.py", "*"): "build_tokenizer also takes a tool's own Namespace "
                                                        "(tools/preprocess_data.py: the tokenizer group alone)",
    ("megatron/training/arguments_validation.py", "_apply_defaults"): "Megatron's args_defaults may name "
                                                                       "any key, flag or not",
    ("megatron/training/arguments_validation.py", "_apply_flag_aliases"): "an alias's dest is removed once "
                                                                           "applied; validation may run again",
}


def _sites():
    """(file, innermost function, line, source) of every getattr(args, name, default) in megatron/."""
    for path in sorted((ROOT / "megatron").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        owners = {}
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):  # outer functions first: inner ones overwrite
                    owners[node] = function.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) == 3 and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"):
                yield name, owners.get(node, "<module>"), node.lineno, ast.unparse(node)


def test_no_reader_of_a_runs_args_needs_a_default():
    found = {(name, line, text) for name, owner, line, text in _sites()
             if not any(name.startswith(prefix) and where in ("*", owner) for prefix, where in ALLOWED)}
    assert not found, "\n".join(f"{name}:{line}: {text}" for name, line, text in sorted(found))


def test_the_allowed_readers_exist():
    sites = list(_sites())
    for prefix, where in ALLOWED:
        assert any(name.startswith(prefix) and where in ("*", owner) for name, owner, _, _ in sites), (prefix, where)
