"""The GPT, BERT and T5 models (Megatron-Core naming): config, building blocks, half-precision wrapper.

    TransformerConfig   dataclass of the model's shape, dropout, init and precision
    GPTModel            embedding -> TransformerBlock -> output layer -> per-token loss
    BertModel           embedding (+ tokentypes) -> bidirectional TransformerBlock -> LM head, binary head
    bert_loss           Megatron's pretrain_bert loss: masked-token lm loss + sentence-order loss
    T5Model             shared embedding -> encoder -> decoder with cross-attention -> tied LM head
    Float16Module       runs a model in fp16/bf16 with fp32 outputs
    MegatronModule      base class holding .config
    unwrap_model        strips Float16Module/DDP wrappers
    get_num_parameters  unique parameter count
"""

from megatron.model.bert_model import BertModel, bert_loss
from megatron.model.gpt_model import GPTModel
from megatron.model.module import Float16Module, MegatronModule, unwrap_model
from megatron.model.t5_model import T5Model
from megatron.model.transformer_config import TransformerConfig
from megatron.model.utils import get_num_parameters

__all__ = [
    "BertModel",
    "Float16Module",
    "GPTModel",
    "MegatronModule",
    "T5Model",
    "TransformerConfig",
    "bert_loss",
    "get_num_parameters",
    "unwrap_model",
]
