"""Layer specs: which module fills each slot of a layer, said as data (Megatron-Core's ModuleSpec).

    ModuleSpec(module, params={...}, submodules=<a dataclass of specs>)

A slot holds a ModuleSpec, a bare class (built with the slot's arguments), or None (the slot is
empty). build_module(spec, *args, **kwargs) constructs it with the slot's arguments, the spec's
params on top (a param overrides the caller's keyword of the same name: a spec can say
bias=False for one slot), and `submodules=` when the spec has some. The classes that take
submodules (TransformerLayer, SelfAttention, MLP) build their own slots the same way, so one
builder makes the GPT layer, the Llama layer and any layer a user writes
(megatron/model/layer_specs.py, docs/model.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class ModuleSpec:
    """`module` (a class or a function returning a module), its extra keyword `params`, and the
    specs of its own slots (`submodules`, a dataclass the module's constructor takes)."""

    module: type | Callable[..., nn.Module]
    params: dict[str, Any] = field(default_factory=dict)
    submodules: Any = None


def build_module(spec: ModuleSpec | type | Callable[..., nn.Module] | None, *args: Any, **kwargs: Any) -> nn.Module | None:
    """The module `spec` describes, built with the slot's arguments; None for an empty slot."""
    if spec is None:
        return None
    if not isinstance(spec, ModuleSpec):
        if not callable(spec):
            raise TypeError(f"a layer-spec slot holds a ModuleSpec, a module class or None, got {spec!r}")
        return spec(*args, **kwargs)
    params = {**kwargs, **spec.params}
    if spec.submodules is not None:
        params["submodules"] = spec.submodules
    return spec.module(*args, **params)
