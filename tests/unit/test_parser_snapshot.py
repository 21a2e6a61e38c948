"""The whole command-line parser, action by action, against a snapshot taken before the flags were
generated from typed configs (issue 31): every flag's spellings, dest, default, type, choices,
nargs, const, metavar, help and `--help` group stay as Megatron's users know them.

A deliberate change to a flag regenerates the snapshot and shows in review as a diff of
tests/data/parser_snapshot.json:

    python -m tests.unit.test_parser_snapshot --write
"""

import json
import sys
from pathlib import Path

SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "parser_snapshot.json"
HELP = SNAPSHOT.with_name("parser_help.txt")  # `pretrain_gpt.py --help` at 100 columns


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def describe_parser() -> list:
    from megatron.training.arguments import build_parser

    parser = build_parser()
    group_of = {id(action): group.title for group in parser._action_groups for action in group._group_actions}
    rows = []
    for action in parser._actions:
        rows.append({
            "group": group_of.get(id(action)), "flags": list(action.option_strings), "dest": action.dest,
            "action": type(action).__name__, "default": _plain(action.default),
            "type": getattr(action.type, "__name__", _plain(action.type)), "choices": _plain(action.choices),
            "nargs": _plain(action.nargs), "const": _plain(action.const), "required": action.required,
            "metavar": _plain(action.metavar), "help": action.help})
    return rows


def test_every_flag_default_choice_and_group_is_unchanged():
    expected = json.loads(SNAPSHOT.read_text())
    actual = describe_parser()
    by_flags = {tuple(row["flags"]): row for row in expected}
    for row in actual:  # the first difference, named, before the whole-list comparison
        before = by_flags.get(tuple(row["flags"]))
        assert before is not None, f"new flag {row['flags']}"
        changed = {k: (before[k], row[k]) for k in row if before[k] != row[k]}
        assert not changed, f"{row['flags']}: {changed}"
    assert [tuple(r["flags"]) for r in actual] == [tuple(r["flags"]) for r in expected], "flags added, removed or reordered"
    assert actual == expected


def help_text() -> str:
    import os

    from megatron.training.arguments import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        parser = build_parser()
        parser.prog = "pretrain_gpt.py"
        return parser.format_help()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def test_the_help_text_is_unchanged():
    assert help_text() == HELP.read_text()


if __name__ == "__main__" and "--write" in sys.argv:
    SNAPSHOT.write_text(json.dumps(describe_parser(), indent=1) + "\n")
    HELP.write_text(help_text())
    print(f"wrote {SNAPSHOT} and {HELP}")
