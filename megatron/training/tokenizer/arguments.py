"""Megatron's tokenizer flags, shared by the training arguments and tools/preprocess_data.py."""
import argparse

TOKENIZER_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the 'tokenizer' argument group with Megatron's names and defaults; returns parser.

    Parallel sizes and rank are not added here: build_tokenizer reads them from the
    namespace when present (tensor_model_parallel_size defaults to 1, rank to 0).
    """
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", type=str, default=None, choices=TOKENIZER_TYPES,
                       help="What type of tokenizer to use.")
    group.add_argument("--vocab-file", type=str, default=None,
                       help="Path to the vocab file (GPT-2 vocab.json, BERT vocab.txt).")
    group.add_argument("--merge-file", type=str, default=None,
                       help="Path to the BPE merge file (GPT-2 merges.txt).")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="Size of vocab before EOD or padding (NullTokenizer).")
    group.add_argument("--vocab-extra-ids", type=int, default=0,
                       help="Number of additional vocabulary tokens (T5 sentinels <extra_id_i>).")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="SentencePiece model file, or a HuggingFace tokenizer.json / folder.")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocab size to be divisible by this value (times the "
                            "tensor model parallel size), for computation efficiency.")
    return parser
