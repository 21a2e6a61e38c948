"""The data-collection tools are safe by construction: no module that unpickles, runs a shell or
evaluates code is imported, and every np.load says allow_pickle=False (read from the source)."""
import ast
from pathlib import Path

SOURCES = sorted((Path(__file__).resolve().parents[2] / "tools" / "data_collection").glob("*.py"))
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "subprocess", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "system", "popen", "__import__"}


def test_there_are_sources():
    assert {p.name for p in SOURCES} >= {"extract_wikipedia.py", "cleanup.py", "dedup.py", "decontaminate.py"}


def test_no_unpickling_no_shell_no_eval():
    problems = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                problems += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                             if a.name.split(".")[0] in FORBIDDEN_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                problems.append(f"{path.name}:{node.lineno} imports from {node.module}")
            elif isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in FORBIDDEN_CALLS:
                    problems.append(f"{path.name}:{node.lineno} calls {name}")
                if name == "load" and isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", "") == "np":
                    flags = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
                    if flags.get("allow_pickle") is not False:
                        problems.append(f"{path.name}:{node.lineno} np.load without allow_pickle=False")
    assert problems == []
