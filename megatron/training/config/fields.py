"""Typed settings that generate their command-line flags.

A setting is a dataclass field: its name is the argparse dest, its default the flag's default, its
annotation the flag's type and action, the string literal written under it (an attribute
docstring) the flag's help:

    @dataclass
    class TrainingConfig(ConfigGroup, title="training"):
        micro_batch_size: int | None = None
        \"\"\"Batch size per model instance (local batch size).\"\"\"
        add_bias_linear: bool = setting(True, flags=("--disable-bias-linear",))
        \"\"\"Disable the bias of the linear layers.\"\"\"

How a field becomes a flag:
  flag      "--" + name with "-" for "_", unless `flags=` spells it (aliases after the first);
  action    bool fields: store_false when the default is True, else store_true (`action=` overrides);
            other fields: store;
  type      the annotation's int / float / str (None for lists, whose items stay strings),
            unless `type=` says otherwise (None included);
  the rest  `choices=`, `nargs=`, `metavar=` pass through to add_argument; `also=` adds more flags
            for the same dest (a --no-X beside an --X), each a dict of add_argument keywords with
            its "flags" and "help".

add_group(parser, cls) adds the class's argparse group (its `title`, fields in order); the Namespace
argparse returns is read back with cls.from_namespace(args).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import types
import typing
from functools import lru_cache
from typing import Any, ClassVar

_MISSING = dataclasses.MISSING


def setting(default: Any = _MISSING, *, flags: tuple[str, ...] | None = None, action: str | None = None,
            type: Any = _MISSING, choices: Any = None, nargs: Any = None, metavar: Any = None,
            also: tuple[dict, ...] = (), default_factory: Any = _MISSING) -> Any:
    """A dataclass field with how its flag differs from the one its name, annotation and default give."""
    metadata = {"flags": flags, "action": action, "type": type, "choices": choices, "nargs": nargs,
                "metavar": metavar, "also": also}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class ConfigGroup:
    """Base of the typed setting groups: `title` is the argparse group's (and --help's) title."""

    title: ClassVar[str] = ""

    def __init_subclass__(cls, title: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if title:
            cls.title = title

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> "ConfigGroup":
        """The group's fields read from a Namespace that has them (a parsed command line)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def flag(cls, name: str) -> str:
        """The flag a field is given by (its first one): what a message about its value names."""
        spelt = {f.name: f.metadata.get("flags") for f in dataclasses.fields(cls)}[name]
        return (spelt or ("--" + name.replace("_", "-"),))[0]

    def problems(self) -> list[str]:
        """What the command line would refuse in these values, one line each naming the flag: first
        each value alone (value_problems); when every value is of its field's type, the group's rules."""
        return self.value_problems() or self.rules()

    def value_problems(self) -> list[str]:
        """Each value alone: of another type than the field's (an int is a float; None is allowed, as
        the flag's default can be), or not one of the flag's choices."""
        out = []
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            flag = self.flag(field.name)
            base, is_list = _base_type(hints[field.name])
            kind = field.metadata.get("type", _MISSING)
            items = list(value) if is_list and isinstance(value, (list, tuple)) else [value]
            if base in (int, float, str, bool) and kind is _MISSING and not is_list:
                allowed = (int, float) if base is float else (base,)
                if not isinstance(value, allowed) or (base is not bool and isinstance(value, bool)):
                    out.append(f"{flag}: {value!r} is not {'an' if base is int else 'a'} {base.__name__}")
                    continue
            choices = field.metadata.get("choices")
            wrong = [item for item in items if choices is not None and item not in choices]
            if wrong:
                out.append(f"{flag}: {wrong[0]!r} is not one of {', '.join(map(str, choices))}")
        return out

    def rules(self) -> list[str]:
        """The group's rules between its values (each value of its field's type), the first broken one
        first, each a line naming the flag. Written here once: validate_args refuses a command line
        with the same line (megatron/training/arguments_validation.py), check() a config."""
        return []

    def not_positive(self, names: tuple[str, ...], allow_zero: bool = False) -> list[str]:
        """The first of these fields whose value (unless None) is not a finite number > 0 (>= 0 with
        allow_zero), as a problem naming its flag."""
        for name in names:
            problem = not_positive(self.flag(name), getattr(self, name), allow_zero)
            if problem:
                return [problem]
        return []

    def not_fraction(self, names: tuple[str, ...]) -> list[str]:
        """The first of these fields whose value (unless None) is not in [0, 1) (a probability that
        cannot be 1, Adam's betas; NaN is not), as a problem naming its flag."""
        for name in names:
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                return [f"{self.flag(name)} must be in [0, 1), got {value}"]
        return []



def not_positive(flag: str, value: Any, allow_zero: bool = False) -> str | None:
    """What is wrong with a value that must be a finite number > 0 (>= 0 with allow_zero); None when
    nothing is (None, the flag left out, included)."""
    if value is None:
        return None
    if not math.isfinite(value):
        return f"{flag} must be a finite number, got {value}"
    if value < 0 or (value == 0 and not allow_zero):
        return f"{flag} must be {'>= 0' if allow_zero else '> 0'}, got {value}"
    return None


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field name: the string literal written under it} for cls and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            tree = ast.parse(inspect.getsource(klass).lstrip())
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, following in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = " ".join(following.value.value.split())  # one line, as help
    return docs


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(int / float / str / bool / other, whether it is a list) of an annotation, None removed."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(options[0]) if len(options) == 1 else (None, False)
    if origin in (list, tuple):
        return None, True
    return annotation, False


def _default(field: dataclasses.Field) -> Any:
    if field.default is not _MISSING:
        return field.default
    if field.default_factory is not _MISSING:
        return field.default_factory()
    return None


def flag_kwargs(cls: type) -> list[tuple[tuple[str, ...], dict]]:
    """[(flags, add_argument keywords)] of every flag cls's fields generate, in field order."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for field in dataclasses.fields(cls):
        meta = field.metadata
        flags = meta.get("flags") or ("--" + field.name.replace("_", "-"),)
        base, is_list = _base_type(hints[field.name])
        default = _default(field)
        kwargs: dict[str, Any] = {"dest": field.name, "help": docs.get(field.name)}
        if base is bool:
            kwargs["action"] = meta.get("action") or ("store_false" if default is True else "store_true")
            kwargs["default"] = default
        else:
            kwargs["action"] = meta.get("action") or "store"
            kwargs["default"] = default
            kind = meta.get("type", _MISSING)
            kwargs["type"] = (None if is_list else base) if kind is _MISSING else kind
            for key in ("choices", "nargs", "metavar"):
                if meta.get(key) is not None:
                    kwargs[key] = meta[key]
        out.append((tuple(flags), kwargs))
        for extra in meta.get("also", ()):
            extra = dict(extra)
            out.append((tuple(extra.pop("flags")), {"dest": field.name, **extra}))
    return out


def add_group(parser: argparse.ArgumentParser, cls: type) -> argparse._ArgumentGroup:
    """The argparse group of cls (title cls.title), one flag (or more) per field."""
    group = parser.add_argument_group(title=cls.title)
    for flags, kwargs in flag_kwargs(cls):
        kwargs = dict(kwargs)
        if kwargs.get("action") in ("store_true", "store_false"):
            kwargs.pop("type", None)
        group.add_argument(*flags, **kwargs)
    return group
