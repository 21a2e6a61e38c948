"""Megatron-LM's `--yaml-cfg FILE`: a run's settings as Megatron-LM's experimental YAML writes them.

Megatron-LM's layout (its examples/gpt3/gpt_config.yaml): the training settings at the top level
under their argparse dest names, the model's under `language_model:` and the parallel layout's under
`model_parallel:` with megatron-core's TransformerConfig / ModelParallelConfig field names, and
`${NAME}` in any string replaced by the environment variable NAME.

    values = read_megatron_yaml("gpt_config.yaml", parser)   # {dest: value}

How a key becomes a setting here:
  - a dest of the parser (most keys, and most TransformerConfig fields, which Megatron names as its
    flags): that setting, a string converted by the flag's own type (YAML reads `1e-4` as a string);
  - a TransformerConfig field named otherwise (RENAMED: num_moe_experts, layernorm_epsilon,
    layernorm_zero_centered_gamma, virtual_pipeline_model_parallel_size; activation_func swiglu /
    squared_relu / gelu);
  - null for a flag whose default is not None: the default (Megatron lists unset switches as null);
  - megatron-core fields with no flag that change nothing here (NO_FLAG: callbacks, debug switches,
    Transformer Engine's overlap knobs) are read and dropped when they hold Megatron's default (or
    null); any other value of them, and any key nobody knows, is one ConfigError naming the file and
    the key.
Reading it runs nothing: yaml.safe_load (plain values, no tags).
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from megatron.training.config.container import ConfigError

SECTIONS = ("language_model", "model_parallel")
_ENV = re.compile(r"\$\{([^}]*)\}")

# TransformerConfig fields whose flag has another name
RENAMED = {"num_moe_experts": "num_experts", "layernorm_epsilon": "norm_epsilon",
           "layernorm_zero_centered_gamma": "apply_layernorm_1p",
           "virtual_pipeline_model_parallel_size": "num_virtual_stages_per_pipeline_rank"}
# activation_func's names and the flag each means (gelu: the default MLP)
ACTIVATIONS = {"swiglu": {"swiglu": True}, "squared_relu": {"squared_relu": True}, "gelu": {}}
ANY = object()  # a kernel or placement switch: any value computes the same here
# megatron-core fields without a flag here, and the value they may hold (Megatron's default, or ANY)
NO_FLAG: dict[str, Any] = {
    "gated_linear_unit": ANY,  # (with activation_func; checked below)
    "bias_activation_fusion": ANY, "init_method": None, "output_layer_init_method": None,
    "memory_efficient_layer_norm": ANY, "params_dtype": ANY, "timers": None, "tp_comm_atomic_ag": True,
    "tp_comm_atomic_rs": True, "finalize_model_grads_func": None, "pipeline_dtype": None, "grad_scale_func": None,
    "enable_autocast": False, "autocast_dtype": None, "variable_seq_lengths": False,
    "num_microbatches_with_partial_activation_checkpoints": None, "batch_p2p_comm": True, "batch_p2p_sync": True,
    "deallocate_pipeline_outputs": False, "no_sync_func": None, "grad_sync_func": None, "param_sync_func": None,
    "cpu_offloading": False, "cpu_offloading_num_layers": 0, "_cpu_offloading_context": None,
    "cpu_offloading_weights": False, "cpu_offloading_activations": True, "window_size": None,
    "moe_token_dropping": False, "adlr_autoresume": False, "adlr_autoresume_interval": 1000,
    "enable_one_logger": True, "one_logger_project": "megatron-lm", "one_logger_run_name": None,
    "step_batch_size_schedule": None, "standalone_embedding_stage": False,
}


def _expand(value: Any, where: str) -> Any:
    """${NAME} in strings (nested too) replaced by the environment's NAME, as Megatron's loader does."""
    if isinstance(value, str):
        def sub(match: re.Match) -> str:
            name = match.group(1)
            if name not in os.environ:
                raise ConfigError(f"{where}: the environment variable {name} is not set")
            return os.environ[name]
        return _ENV.sub(sub, value)
    if isinstance(value, list):
        return [_expand(v, where) for v in value]
    if isinstance(value, dict):
        return {k: _expand(v, f"{where}.{k}") for k, v in value.items()}
    return value


def _converted(value: Any, action: argparse.Action, where: str) -> Any:
    """A string (or a list of strings) through the flag's type, as argparse would convert it."""
    kind = action.type
    if kind is None or not callable(kind):
        return value
    try:
        if isinstance(value, str):
            return kind(value)
        if isinstance(value, list) and action.nargs not in (None, "?"):
            return [kind(v) if isinstance(v, str) else v for v in value]
    except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
        raise ConfigError(f"{where}: {value!r} is not a value of {action.option_strings[0]} ({error})") from None
    return value


def read_megatron_yaml(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """{dest: value} of Megatron-LM's YAML config at `path` for `parser`'s flags (see the module docstring)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as error:
        raise ConfigError(f"--yaml-cfg {path}: cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"--yaml-cfg {path}{line}: not YAML ({getattr(error, 'problem', error)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--yaml-cfg {path}: expected a mapping of settings, got {type(data).__name__}")
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    entries = [(key, value, key) for key, value in data.items() if key not in SECTIONS]
    for section in SECTIONS:
        inner = data.get(section) or {}
        if not isinstance(inner, dict):
            raise ConfigError(f"--yaml-cfg {path}: {section} must be a mapping of settings")
        entries += [(key, value, f"{section}.{key}") for key, value in inner.items()]
    values: dict[str, Any] = {}
    activation = None
    for key, value, where in entries:
        where = f"--yaml-cfg {path}: {where}"
        value = _expand(value, where)
        if key == "activation_func":
            activation = (value, where)
            continue
        dest = RENAMED.get(key, key)
        if dest in actions:
            if value is None and actions[dest].default is not None:
                continue  # null: the flag's default (Megatron's YAML lists store_true flags as null)
            values[dest] = _converted(value, actions[dest], where)
        elif key in NO_FLAG:
            allowed = NO_FLAG[key]
            if allowed is not ANY and value is not None and value != allowed:
                raise ConfigError(f"{where}: {value!r} is not supported here (only Megatron's default "
                                  f"{allowed!r}: the setting has no flag in this framework)")
        else:
            raise ConfigError(f"{where}: not a setting of this framework (no flag --{key.replace('_', '-')})")
    if activation is not None:
        name, where = activation
        if name not in ACTIVATIONS:
            raise ConfigError(f"{where}: {name!r} is not one of {', '.join(ACTIVATIONS)}")
        values.update(ACTIVATIONS[name])
    gated = data.get("language_model", {}) or {}
    if gated.get("gated_linear_unit") and not values.get("swiglu"):
        raise ConfigError(f"--yaml-cfg {path}: language_model.gated_linear_unit: only with activation_func swiglu "
                          "(--swiglu)")
    return values
