"""Megatron-LM's legacy model classes over megatron.model (their constructors read the global args).

    legacy class (megatron.legacy.model)       built as / subclass of
    GPTModel(config, num_tokentypes=0, ...)     megatron.model.GPTModel, as pretrain_gpt.py builds it
    BertModel(config, num_tokentypes=2, ...)    megatron.model.BertModel, as pretrain_bert.py builds it
    T5Model(config, num_tokentypes=0, ...)      megatron.model.T5Model, as pretrain_t5.py builds it
    classification.Classification(config, num_classes, ...)
                                                megatron.model.classification.Classification
    Float16Module(config, module)               megatron.model.Float16Module (the same class)
"""

from megatron.legacy.model.bert_model import BertModel
from megatron.legacy.model.classification import Classification
from megatron.legacy.model.gpt_model import GPTModel
from megatron.legacy.model.t5_model import T5Model
from megatron.model.module import Float16Module

__all__ = ["BertModel", "Classification", "Float16Module", "GPTModel", "T5Model"]
