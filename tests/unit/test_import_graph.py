"""The library's import graph: no circles, no arrows out of the package.

Every `import` and `from ... import` in megatron/ is read, at module level or inside a function
alike (an import deferred into a function still closes a circle; it only hides it until the call).
`from package import name` is an arrow to package.name when that is a module, else to the package.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron"
# what the wheel does not hold: the library must not need it
OUTSIDE = ("tools", "tests", "tasks", "examples", "bench", "pretrain_gpt", "pretrain_bert", "pretrain_t5")


def _modules() -> dict:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict):
    """(imported dotted name, line) of every import in the module, resolved against our modules."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield (submodule if submodule in modules else source), node.lineno


def _graph():
    modules = _modules()
    edges, outside = {name: {} for name in modules}, set()
    for name, path in modules.items():
        for target, line in _imports(name, path, modules):
            top = target.split(".")[0]
            if top in OUTSIDE:
                outside.add(f"{path.relative_to(ROOT)}:{line} imports {target}")
            elif top == "megatron":
                while target and target not in modules:  # megatron.x.y.Name -> megatron.x.y
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].setdefault(target, line)
    return modules, edges, sorted(outside)


def _circles(edges: dict) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(component: list, edges: dict, modules: dict) -> str:
    inside = set(component)
    arrows = [f"  {a} -> {b} ({modules[a].relative_to(ROOT)}:{line})"
              for a in component for b, line in sorted(edges[a].items()) if b in inside]
    return "\n".join(arrows)


def test_no_module_of_the_package_imports_tools_tests_or_the_root_scripts():
    _, _, outside = _graph()
    assert outside == [], "the library must not import what the wheel does not install:\n" + "\n".join(outside)


def test_the_package_has_no_import_circles():
    modules, edges, _ = _graph()
    circles = _circles(edges)
    assert not circles, "import circles (arrows inside each):\n" + "\n\n".join(
        _describe(component, edges, modules) for component in circles)


def test_the_reader_finds_a_circle_and_an_outside_import(tmp_path):
    # the checks above are only as good as the reader: a circle through a function-level import
    # and a package re-export, and an import of tools/, must be seen
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert _circles(edges) == [["a", "b", "c"]]
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from megatron.core import parallel_state\n    import tools.plan\n"
                      "from megatron.model import GPTModel\n")
    modules = {"megatron.core.parallel_state": None, "megatron.model": None}
    found = sorted(_imports("megatron.x.m", source, modules))
    assert found == [("megatron.core.parallel_state", 2), ("megatron.model", 4), ("tools.plan", 3)]
