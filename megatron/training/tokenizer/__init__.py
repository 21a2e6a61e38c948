"""Megatron's tokenizers, chosen by --tokenizer-type (see build_tokenizer).

| --tokenizer-type | inputs | class |
|---|---|---|
| GPT2BPETokenizer | --vocab-file vocab.json, --merge-file merges.txt | GPT2BPETokenizer |
| BertWordPieceLowerCase / BertWordPieceCase | --vocab-file vocab.txt | BertWordPieceTokenizer |
| SentencePieceTokenizer | --tokenizer-model x.model, --vocab-extra-ids | SentencePieceTokenizer |
| GPTSentencePieceTokenizer / Llama2Tokenizer | --tokenizer-model x.model | same names |
| HuggingFaceTokenizer | --tokenizer-model tokenizer.json or folder | HuggingFaceTokenizer |
| NullTokenizer | --vocab-size N | NullTokenizer |

The tokenizer classes are imported lazily by build_tokenizer; import them from their modules.
"""
from megatron.training.tokenizer.arguments import TOKENIZER_TYPES, add_tokenizer_args
from megatron.training.tokenizer.base import MegatronTokenizer, UnsupportedSpecialToken
from megatron.training.tokenizer.tokenizer import (
    TokenizerConfigError,
    build_tokenizer,
    vocab_size_with_padding,
)

__all__ = [
    "MegatronTokenizer",
    "TOKENIZER_TYPES",
    "TokenizerConfigError",
    "UnsupportedSpecialToken",
    "add_tokenizer_args",
    "build_tokenizer",
    "vocab_size_with_padding",
]
