"""The typed settings of a training run, one dataclass per `--help` group: the one place each
command-line flag is declared (megatron/training/config/fields.py says how a field becomes a flag).
The groups live in three modules by theme (the table's last column); this module gathers them, so
`from megatron.training.config.groups import X` reads any of them.

| class | --help group | module |
|---|---|---|
| ModelConfig | network size | groups_model.py |
| RegularizationConfig | regularization | groups_training.py |
| TrainingConfig | training | groups_training.py |
| InitializationConfig | initialization | groups_training.py |
| LearningRateConfig | learning rate | groups_training.py |
| CheckpointConfig | checkpointing | groups_run.py |
| MixedPrecisionConfig | mixed precision | groups_training.py |
| DistributedConfig | distributed | groups_run.py |
| ValidationConfig | validation | groups_training.py |
| DataConfig | data and dataloader | groups_run.py |
| TokenizerConfig | tokenizer | groups_run.py |
| LoggingConfig | logging | groups_run.py |
| MoEConfig | moe | groups_model.py |
| LoRAConfig | lora | groups_model.py |
| HybridConfig | hybrid models | groups_model.py |
| InferenceConfig | inference | groups_run.py |

To add a setting: add a field to the group it belongs to, with its default and, under it, the help
string; its flag, dest and type follow from the name and annotation (setting(...) for anything
else). The Namespace a command line parses to carries it under the field's name. A rule between a
group's values goes in the group's rules() (one line per problem, naming the flags), a rule between
two groups' values in between.py: validate_args refuses a command line with it, MegatronConfig.check
a config built in Python.
"""

from megatron.training.config.groups_model import (
    ATTENTION_BACKENDS,
    POSITION_EMBEDDING_TYPES,
    HybridConfig,
    LoRAConfig,
    ModelConfig,
    MoEConfig,
    moe_freq_type,
)
from megatron.training.config.groups_run import (
    PER_SPLIT_DATA_PATHS,
    TOKENIZER_TYPES,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    InferenceConfig,
    LoggingConfig,
    TokenizerConfig,
)
from megatron.training.config.groups_training import (
    InitializationConfig,
    LearningRateConfig,
    MixedPrecisionConfig,
    RegularizationConfig,
    TrainingConfig,
    ValidationConfig,
    rampup_batch_sizes,
)

__all__ = ["ATTENTION_BACKENDS", "PER_SPLIT_DATA_PATHS", "POSITION_EMBEDDING_TYPES", "TOKENIZER_TYPES",
           "CheckpointConfig", "DataConfig", "DistributedConfig", "HybridConfig", "InferenceConfig",
           "InitializationConfig", "LearningRateConfig", "LoggingConfig", "LoRAConfig", "MixedPrecisionConfig",
           "ModelConfig", "MoEConfig", "RegularizationConfig", "TokenizerConfig", "TrainingConfig",
           "ValidationConfig", "moe_freq_type", "rampup_batch_sizes"]
