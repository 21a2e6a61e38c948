"""The package layout (Megatron-LM core_v0.13+'s names): the framework layer is megatron/training,
the lower layers (core, model, data) never import it, and the framework's modules import one another
without circles. The import graph is read from the source (every import statement, at the top of a
module or inside a function), so an import deferred into a function to dodge a circle still counts."""

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOWER_LAYERS = ("megatron.core", "megatron.model", "megatron.data")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=None)
def _import_graph() -> dict:
    """module -> the set of megatron modules its import statements name (a `from P import N`
    names P, and P.N too where that is a module)."""
    paths = {_module_name(path): path for path in sorted((ROOT / "megatron").rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1 packages
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {target for target in targets if target in paths and target != name}
    return graph


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_loose_framework_files_at_the_package_root():
    assert sorted(path.name for path in (ROOT / "megatron").glob("*.py")) == ["__init__.py"]


def test_lower_layers_never_import_the_framework_layer():
    graph = _import_graph()
    found = {module: sorted(target for target in targets if target.startswith("megatron.training"))
             for module, targets in graph.items() if module.startswith(LOWER_LAYERS)}
    assert {module: targets for module, targets in found.items() if targets} == {}


def test_the_framework_layer_has_no_import_circles_through_arguments_checkpointing_or_data():
    watched = ("megatron.training.argument", "megatron.training.checkpoint", "megatron.dist_checkpointing",
               "megatron.data")
    circles = [circle for circle in _circles(_import_graph())
               if any(module.startswith(watched) for module in circle)]
    assert circles == []


def test_the_graph_sees_imports_inside_functions():
    # The circles this layout removed were all deferred imports: the reader must see them.
    graph = _import_graph()
    assert "megatron.training.checkpointing" in graph["megatron.training.arguments_validation"]
    assert "megatron.dist_checkpointing" in graph["megatron.training.checkpointing"]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_megatron_core_names():
    """The megatron.core names Megatron-LM's scripts and Accelerate import."""
    from torch import nn

    from megatron.core import mpu, parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
    from megatron.core.utils import get_model_config

    assert mpu is parallel_state
    assert get_forward_backward_func(1) is schedules.forward_backward_no_pipelining
    assert get_forward_backward_func(2) is schedules.forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(2, 2) is schedules.forward_backward_pipelining_with_interleaving

    inner = nn.Linear(2, 2)
    inner.config = {"hidden_size": 2}
    wrapper = nn.Module()  # as DistributedDataParallel: the model in .module, its own config beside it
    wrapper.module, wrapper.config = inner, {"bucket_size": 40}
    assert get_model_config([wrapper]) is inner.config and get_model_config(wrapper) is inner.config
    assert get_model_config(inner) is inner.config
    with pytest.raises(AttributeError, match="Linear has no config"):
        get_model_config(nn.Linear(2, 2))


def test_the_num_microbatches_calculator_is_core_state():
    from megatron.core import num_microbatches_calculator as calc
    from megatron.training import global_vars

    calc.init_num_microbatches_calculator(0, None, 16, 2, 2)  # 16 / (2 x 2)
    try:
        assert (calc.get_num_microbatches(), calc.get_current_global_batch_size(), calc.get_micro_batch_size()) == (4, 16, 2)
        assert global_vars.get_num_microbatches() == 4  # the framework reads the same calculator
        # Ramp 4 -> 16 by 4 over 64 samples (3 steps, one per 64 / 3 samples), micro-batch 1 x DP 2.
        calc.init_num_microbatches_calculator(0, [4, 4, 64], 16, 1, 2)
        seen = []
        for consumed in (0, 21, 22, 43, 64, 65):
            calc.update_num_microbatches(consumed)
            seen.append((calc.get_current_global_batch_size(), calc.get_num_microbatches()))
        assert seen == [(4, 2), (4, 2), (8, 4), (12, 6), (16, 8), (16, 8)]
    finally:
        calc.unset_num_microbatches_calculator()
    with pytest.raises(RuntimeError, match="micro-batch calculator is not initialized"):
        calc.get_num_microbatches()


def test_megatron_training_names():
    import megatron.training as training
    from megatron.training import global_vars, initialize, training as loop, utils

    assert (training.get_args, training.get_tokenizer, training.get_timers) == (
        global_vars.get_args, global_vars.get_tokenizer, global_vars.get_timers)
    assert (training.pretrain, training.get_model, training.initialize_megatron) == (
        loop.pretrain, loop.get_model, initialize.initialize_megatron)
    assert (training.print_rank_0, training.print_rank_last, training.is_last_rank) == (
        utils.print_rank_0, utils.print_rank_last, utils.is_last_rank)
