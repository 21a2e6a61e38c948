"""Typed configuration: the settings of a training run as dataclasses that generate the flags.

    from megatron.training.config import GROUPS, ModelConfig, ...

GROUPS lists the setting groups in `--help` order; fields.add_group(parser, cls) adds one to an
argparse parser (megatron/training/arguments.py builds the whole parser from them). MegatronConfig
(container.py) holds one of each, and reads and writes Namespaces, dicts, JSON and YAML.
"""

from megatron.training.config.container import ConfigError, MegatronConfig
from megatron.training.config.fields import ConfigGroup, add_group, flag_kwargs, setting
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

GROUPS = (ModelConfig, RegularizationConfig, TrainingConfig, InitializationConfig, LearningRateConfig,
          CheckpointConfig, MixedPrecisionConfig, DistributedConfig, ValidationConfig, DataConfig,
          TokenizerConfig, LoggingConfig, MoEConfig, LoRAConfig, HybridConfig, InferenceConfig)

__all__ = ["GROUPS", "CheckpointConfig", "ConfigError", "ConfigGroup", "MegatronConfig", "DataConfig",
           "DistributedConfig", "HybridConfig", "InferenceConfig", "InitializationConfig", "LearningRateConfig",
           "LoggingConfig", "LoRAConfig", "MixedPrecisionConfig", "MoEConfig", "ModelConfig",
           "RegularizationConfig", "TokenizerConfig", "TrainingConfig", "ValidationConfig", "add_group",
           "flag_kwargs", "setting"]
