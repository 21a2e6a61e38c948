"""The command-line parser, grouped and named as in Megatron-LM, and the builders of the configs.

The flags are declared once, as typed settings (megatron/training/config/groups.py, one dataclass
per --help group); Megatron's flags without effect here or refused are tables in
arguments_megatron.py; the planner's device flags are megatron/planner's.

| function | what |
|---|---|
| parse_args(extra_args_provider, ignore_unknown_args, argv) | the Namespace; RANK / WORLD_SIZE from the environment |
| args_from_config(config, extra_args_provider) | the Namespace of a MegatronConfig (megatron/training/config) |
| argv_from_config(config, extra_args_provider) | the command line of a MegatronConfig (what megatron.training.api runs) |
| validate_args(args, defaults) | checks and derived values (megatron/training/arguments_validation.py) |
| parse_and_validate_args(...) | both |
| print_args(args) | Megatron's "---- arguments ----" block on rank 0 |
| core_transformer_config_from_args(args), gpt_model_kwargs, optimizer_config_from_args, gpt_dataset_config_from_args | the configs of validated args (megatron/training/config_builders.py) |

Flag names, dests and defaults are Megatron's (v0.13), quirks included: the underscore in
--override-opt_param-scheduler, dest add_bias_linear for --disable-bias-linear, None (not False)
as the default of --no-save-optim / --no-load-optim / --no-save-rng / --no-load-rng.
Deviations: --distributed-backend defaults to
None (chosen by megatron.core.device), --transformer-impl to 'local' (Transformer Engine is optional).
"""

from __future__ import annotations

import argparse
import copy
import sys
from argparse import Namespace
from collections.abc import Callable
from typing import Any

from megatron.training.arguments_validation import (
    ArgsError,
    env_rank_and_world_size,
    print_args,
    validate_args,
    with_run_state,
)
from megatron.training.argument_utils import flag
from megatron.training.config_builders import (  # noqa: F401  (Megatron's names, re-exported)
    core_transformer_config_from_args,
    gpt_dataset_config_from_args,
    gpt_model_kwargs,
    optimizer_config_from_args,
)
from megatron.training.arguments_megatron import add_megatron_flags
from megatron.training.config import (
    GROUPS,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DistributedConfig,
    InitializationConfig,
    LearningRateConfig,
    LoggingConfig,
    MegatronConfig,
    MixedPrecisionConfig,
    ModelConfig,
    MoEConfig,
    RegularizationConfig,
    TrainingConfig,
    ValidationConfig,
    add_group,
)

__all__ = [
    "ArgsError",
    "args_from_config",
    "argv_from_config",
    "core_transformer_config_from_args",
    "gpt_model_kwargs",
    "gpt_dataset_config_from_args",
    "optimizer_config_from_args",
    "parse_and_validate_args",
    "parse_args",
    "print_args",
    "validate_args",
]

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser | None]


def _group_adder(group: type, name: str) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    def add(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        add_group(parser, group)
        return parser

    add.__name__ = add.__qualname__ = name
    add.__doc__ = f"Megatron's helper: adds the {group.title!r} group ({group.__name__}'s flags); returns parser."
    return add


# Megatron-LM's per-group helpers, which Accelerate's integration imports (_add_data_args,
# _add_validation_args) and scripts' extra_args_provider functions call.
_add_network_size_args = _group_adder(ModelConfig, "_add_network_size_args")
_add_regularization_args = _group_adder(RegularizationConfig, "_add_regularization_args")
_add_training_args = _group_adder(TrainingConfig, "_add_training_args")
_add_initialization_args = _group_adder(InitializationConfig, "_add_initialization_args")
_add_learning_rate_args = _group_adder(LearningRateConfig, "_add_learning_rate_args")
_add_checkpointing_args = _group_adder(CheckpointConfig, "_add_checkpointing_args")
_add_mixed_precision_args = _group_adder(MixedPrecisionConfig, "_add_mixed_precision_args")
_add_distributed_args = _group_adder(DistributedConfig, "_add_distributed_args")
_add_validation_args = _group_adder(ValidationConfig, "_add_validation_args")
_add_data_args = _group_adder(DataConfig, "_add_data_args")
_add_logging_args = _group_adder(LoggingConfig, "_add_logging_args")
_add_moe_args = _group_adder(MoEConfig, "_add_moe_args")


def _add_planner_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Ours: pretrain_gpt.py --dry-run prints the pre-flight plan (megatron/planner) and exits."""
    from megatron.planner.plan import add_device_args

    parser.add_argument("--dry-run", action="store_true",
                        help="Validate the flags, print the plan per rank (memory, communication, step time, "
                             "MFU on the --device-* description) and exit 0 before building the model.")
    add_device_args(parser)
    return parser


def build_parser(extra_args_provider: ExtraArgsProvider | None = None) -> argparse.ArgumentParser:
    """The parser with every group, then the script's own flags from extra_args_provider."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    for group in GROUPS:  # the typed settings' groups (megatron/training/config), in --help order
        add_group(parser, group)
    add_megatron_flags(parser)
    _add_planner_args(parser)
    if extra_args_provider is not None:
        # Megatron's providers return the parser; accept one that only adds to it, too.
        parser = extra_args_provider(parser) or parser
    return parser


def parse_args(extra_args_provider: ExtraArgsProvider | None = None, ignore_unknown_args: bool = False,
               argv: list[str] | None = None) -> Namespace:
    """Parse argv (sys.argv[1:] when None); rank and world_size come from RANK / WORLD_SIZE."""
    parser = build_parser(extra_args_provider)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    if args.yaml_cfg is not None:
        _apply_yaml_cfg(args, parser, argv)
    args.rank, args.world_size = env_rank_and_world_size()
    return with_run_state(args)


def given_dests(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The dests argv sets explicitly (whatever the value, the parser's default included)."""
    unset = object()
    # an append / extend / count action adds to its default, so it starts from None (given: not None)
    accumulating = {a.dest for a in parser._actions if type(a).__name__ in ("_AppendAction", "_ExtendAction",
                                                                              "_AppendConstAction", "_CountAction")}
    probe = copy.deepcopy(parser)
    probe.set_defaults(**{a.dest: None if a.dest in accumulating else unset for a in probe._actions
                          if a.dest != "help"})
    parsed, _ = probe.parse_known_args(sys.argv[1:] if argv is None else argv)
    return {dest for dest, value in vars(parsed).items()
            if (value is not None if dest in accumulating else value is not unset)}


def _apply_yaml_cfg(args: Namespace, parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """--yaml-cfg: the file's values (megatron/training/config/megatron_yaml.py) under the flags the
    command line gives, checked as the flags check them; one ArgsError line naming file and key."""
    from megatron.training.config.megatron_yaml import read_megatron_yaml

    try:
        values = read_megatron_yaml(args.yaml_cfg, parser)
        # each value alone: the rules between values are validate_args', on the file and the command line
        MegatronConfig.from_values(values, where=f"--yaml-cfg {args.yaml_cfg}", partial=True)
    except ConfigError as error:
        raise ArgsError(str(error)) from None
    given = given_dests(parser, argv)
    for dest, value in values.items():
        if dest not in given:
            setattr(args, dest, value)


def args_from_config(config: MegatronConfig, extra_args_provider: ExtraArgsProvider | None = None) -> Namespace:
    """The Namespace parse_args returns for a command line giving `config`'s values: the parser's
    defaults (the script's extra flags too), then the config's groups and `extra`."""
    args = config.apply_to(build_parser(extra_args_provider).parse_args([]))
    args.rank, args.world_size = env_rank_and_world_size()
    return with_run_state(args)


def argv_from_config(config: MegatronConfig, extra_args_provider: ExtraArgsProvider | None = None) -> list[str]:
    """The command line that parses to `config`: a flag for every value that differs from the parser's
    default (`extra` included; keys that are no flag's dest, such as rank, are skipped), checked by
    parsing it back. A value no flag can give (None where the default is not) is a one-line ArgsError."""
    parser = build_parser(extra_args_provider)
    values = {**{k: v for group in config.groups() for k, v in vars(getattr(config, group)).items()},
              **config.extra}
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        if action.dest != "help":
            by_dest.setdefault(action.dest, []).append(action)
    argv: list[str] = []
    for dest, actions in by_dest.items():
        if dest not in values or values[dest] == actions[0].default:
            continue
        value = values[dest]
        argv += _flag_for(dest, value, actions)
    parsed = vars(parser.parse_args(argv))
    wrong = [dest for dest in by_dest if dest in values and parsed[dest] != values[dest]]
    if wrong:
        raise ArgsError(f"{flag(wrong[0])}: the value {values[wrong[0]]!r} does not survive the command line "
                        f"(it parses back as {parsed[wrong[0]]!r})")
    return argv


def _flag_for(dest: str, value: Any, actions: list[argparse.Action]) -> list[str]:
    for action in actions:
        kind = type(action).__name__
        if kind in ("_StoreTrueAction", "_StoreFalseAction"):
            if value is action.const:
                return [action.option_strings[0]]
            continue
        if value is None:
            continue
        if action.nargs in ("*", "+") or isinstance(action.nargs, int):
            return [action.option_strings[0], *(str(v) for v in value)]
        return [action.option_strings[0], str(value) if not isinstance(value, list) else repr(value)]
    raise ArgsError(f"{flag(dest)}: {value!r} cannot be given on the command line "
                    f"(its default is {actions[0].default!r})")


def parse_and_validate_args(extra_args_provider: ExtraArgsProvider | None = None,
                            args_defaults: dict[str, Any] | None = None,
                            argv: list[str] | None = None, ignore_unknown_args: bool = False) -> Namespace:
    """parse_args then validate_args(args, args_defaults)."""
    args = parse_args(extra_args_provider, ignore_unknown_args, argv)
    return validate_args(args, args_defaults)
