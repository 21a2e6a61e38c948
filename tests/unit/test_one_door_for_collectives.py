"""Every collective and point-to-point call goes through megatron/core/communication.py.

That module is where --log-communication-stats counts traffic and the hang watchdog puts its
deadline; a call straight to torch.distributed elsewhere is invisible to both. The check reads the
source of the package, tools/, tasks/ and the root scripts: a call `X.op(...)` where X is
torch.distributed (`torch.distributed`, or a name bound to it by `import torch.distributed as X`),
or a name imported from torch.distributed, is refused outside communication.py.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
THE_DOOR = ROOT / "megatron" / "core" / "communication.py"
OPERATIONS = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all",
    "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list",
}


def _sources():
    for folder in ("megatron", "tools", "tasks"):
        yield from sorted((ROOT / folder).rglob("*.py"))
    yield from sorted(ROOT.glob("*.py"))


def _direct_calls(path: Path) -> list:
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    aliases, imported = set(), set()  # names bound to torch.distributed; operations imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name == "torch.distributed" and a.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch":
                aliases.update(a.asname or a.name for a in node.names if a.name == "distributed")
            elif node.module == "torch.distributed":
                imported.update(a.asname or a.name for a in node.names if a.name in OPERATIONS)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        function = node.func
        if isinstance(function, ast.Attribute) and function.attr in OPERATIONS:
            owner = function.value
            is_dist = (isinstance(owner, ast.Name) and owner.id in aliases) or (
                isinstance(owner, ast.Attribute) and owner.attr == "distributed"
                and isinstance(owner.value, ast.Name) and owner.value.id == "torch")
            if is_dist:
                found.append(f"{where}:{node.lineno} {ast.unparse(function)}")
        elif isinstance(function, ast.Name) and function.id in imported:
            found.append(f"{where}:{node.lineno} {function.id}")
    return found


def test_no_collective_bypasses_communication_py():
    found = [call for path in _sources() if path != THE_DOOR for call in _direct_calls(path)]
    assert found == [], "call these through megatron.core.communication:\n" + "\n".join(found)


def test_the_reader_sees_every_spelling(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
        "from torch.distributed import all_gather_object as ago\n"
        "def f(t):\n    dist.all_reduce(t)\n    torch.distributed.barrier()\n    d2.send(t, 1)\n    ago([], 1)\n"
        "    dist.get_rank()\n    dist.P2POp(dist.isend, t, 1)\n")
    calls = [line.split(" ", 1)[1] for line in _direct_calls(source)]
    assert sorted(calls) == sorted(["dist.all_reduce", "torch.distributed.barrier", "d2.send", "ago"])
