"""MegatronConfig: every setting of a run, grouped, from Python, a command line, YAML or JSON.

    config = MegatronConfig()                       # the command line's defaults
    config.model.num_layers = 4                     # typed groups, named as the flags' dests
    config = MegatronConfig.from_namespace(args)    # a parsed command line
    args = args_from_config(config)                 # what parse_args would return for it
                                                    # (megatron.training.arguments)
    MegatronConfig.from_yaml(config.to_yaml())      # == config (also JSON and plain dicts)

`extra` holds the settings of no group: Megatron's flags that have no effect here (their table in
arguments_megatron.py), the planner's device flags and a script's own flags (extra_args_provider);
args_from_config fills everything not given with the parser's default, as a command line would.
Reading refuses, in one line, a key that is no setting, so a typo does not pass silently.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from megatron.training.config import between
from megatron.training.config.groups import (
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    HybridConfig,
    InitializationConfig,
    LearningRateConfig,
    LoggingConfig,
    LoRAConfig,
    MixedPrecisionConfig,
    ModelConfig,
    MoEConfig,
    InferenceConfig,
    RegularizationConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)


# What a run's Namespace holds besides the settings (and rank / world_size): no flag sets them; the run
# does (a recipe's args_defaults, the tokenizer, a loaded checkpoint, Accelerate's plugin). A Namespace
# made by parse_args or validate_args has every one, so readers need no default
# (arguments_validation.with_run_state); they are not settings, so a config leaves them out.
RUN_STATE = {
    "model_family": None,  # "BERT" or "T5": the recipe's args_defaults (the converter's mark as well)
    "padded_vocab_size": None,  # build_tokenizer's (or a checkpoint's, with --use-checkpoint-args)
    "iteration": 0,  # the loaded checkpoint's, then the loop's
    "orig_vocab_size": None,  # Accelerate's MegatronLMPlugin: the vocabulary when it builds no tokenizer
    "return_logits": None,  # Accelerate's MegatronLMPlugin (True): the GPT returns logits beside the loss
    "model_type_name": None,  # Accelerate's MegatronLMPlugin: "gpt", "bert" or "t5"
    "output_bert_embeddings": None,  # Megatron's inference flag, set only through args_defaults here (refused)
    "eos_id": None,  # the text-generation scripts' --eos-id: the token that ends a generation
    "max_tokens_to_oom": None,  # Megatron's inference limit (prompt + generated tokens x batch), if given
    "mean_noise_span_length": None,  # pretrain_t5.py's own flag (T5 through Accelerate has not got it)
    "lora_base": None,  # LoRA: the base checkpoint the adapters point to, once loaded (lora_pointer.py)
    "lora_base_dir": None,  # LoRA: the folder the base weights are read from while they load
}
NOT_SETTINGS = frozenset(("rank", "world_size", *RUN_STATE))


class ConfigError(ValueError):
    """A setting that does not exist or a file that is not a config: one line naming it."""


@dataclass
class MegatronConfig:
    """The groups of settings, each a dataclass whose fields generate the flags of one --help group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    regularization: RegularizationConfig = field(default_factory=RegularizationConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    initialization: InitializationConfig = field(default_factory=InitializationConfig)
    learning_rate: LearningRateConfig = field(default_factory=LearningRateConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    extra: dict[str, Any] = field(default_factory=dict)
    """Settings of no group (see the module docstring), by dest."""

    @classmethod
    def groups(cls) -> dict[str, type]:
        """{attribute: group class}, in --help order."""
        return {f.name: f.default_factory for f in dataclasses.fields(cls) if f.name != "extra"}

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> "MegatronConfig":
        """The config of a parsed command line: each dest into its group, the rest into `extra`."""
        values = {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}
        groups = {}
        for name, group in cls.groups().items():
            names = [f.name for f in dataclasses.fields(group)]
            groups[name] = group(**{n: values.pop(n) for n in names if n in values})
        return cls(**groups, extra=values)

    @classmethod
    def from_values(cls, values: dict[str, Any], where: str = "config", partial: bool = False) -> "MegatronConfig":
        """The config of {dest: value} (any setting left out keeps its default), checked as validate_args
        checks a command line (ConfigError naming the first wrong flag). partial: the values are only
        part of a run's (a --yaml-cfg file, under the command line's flags): each is checked alone, and
        the rules between values are left to the whole run's validation."""
        config = cls.from_namespace(argparse.Namespace(**values))
        config.check(where, rules=not partial)
        return config

    def check(self, where: str = "config", rules: bool = True) -> None:
        """ConfigError (one line: where, if given, then the problem naming the flag) for a value the flag
        would refuse, or (rules) a broken rule of a group (ConfigGroup.rules), then one between groups
        (rules()): the line validate_args gives the same values on a command line."""
        for name in self.groups():
            group = getattr(self, name)
            problems = group.problems() if rules else group.value_problems()
            if problems:
                raise ConfigError(f"{where}: {problems[0]}" if where else problems[0])
        problems = self.rules() if rules else []
        if problems:
            raise ConfigError(f"{where}: {problems[0]}" if where else problems[0])

    def rules(self) -> list[str]:
        """The first broken rule between the values of two or more groups (between.py), each group's own
        rules passing, as a one-line list naming the flag; [] when none is."""
        return between.problems(self)

    def apply_to(self, args: argparse.Namespace) -> argparse.Namespace:
        """args (a Namespace of the parser's defaults) with every group's values, then `extra`, set."""
        for name in self.groups():
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                setattr(args, key, value)
        for key, value in self.extra.items():
            setattr(args, key, value)
        return args

    def to_dict(self) -> dict[str, Any]:
        """{group: {setting: value}} (and "extra" when not empty), JSON- and YAML-ready."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in self.groups()}
        if self.extra:
            out["extra"] = dict(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> "MegatronConfig":
        """The config a to_dict() (or a file of the same layout, any group or setting left out) describes."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping of groups ({', '.join(cls.groups())}), "
                              f"got {type(data).__name__}")
        groups = cls.groups()
        unknown = [key for key in data if key not in groups and key != "extra"]
        if unknown:
            raise ConfigError(f"{where}: unknown group {unknown[0]!r} (groups: {', '.join(groups)}, extra)")
        made = {}
        for name, values in data.items():
            if name == "extra":
                if not isinstance(values, dict):
                    raise ConfigError(f"{where}: 'extra' must be a mapping of settings")
                made[name] = dict(values)
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"{where}: group {name!r} must be a mapping of settings")
            fields = {f.name for f in dataclasses.fields(groups[name])}
            wrong = [key for key in values if key not in fields]
            if wrong:
                raise ConfigError(f"{where}: {name}.{wrong[0]} is not a setting of {groups[name].__name__} "
                                  f"(its flag would be --{wrong[0].replace('_', '-')})")
            made[name] = groups[name](**values)
        config = cls(**made)
        config.check(where)
        return config

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "config") -> "MegatronConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(data, where)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str, where: str = "config") -> "MegatronConfig":
        import yaml

        try:
            data = yaml.safe_load(text)  # plain values only: no tags, nothing that runs code
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{where}: not YAML{line} ({getattr(e, 'problem', None) or e})") from None
        return cls.from_dict(data or {}, where)

    def save(self, path: str) -> None:
        """Write YAML (.yaml / .yml) or JSON (anything else), atomically."""
        from megatron.core.atomic_io import atomic_write

        text = self.to_yaml() if str(path).endswith((".yaml", ".yml")) else self.to_json()
        atomic_write(str(path), lambda f: f.write(text.encode("utf-8")))

    @classmethod
    def load(cls, path: str) -> "MegatronConfig":
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
        return (cls.from_yaml if str(path).endswith((".yaml", ".yml")) else cls.from_json)(text, str(path))
