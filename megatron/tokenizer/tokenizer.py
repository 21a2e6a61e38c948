"""build_tokenizer(args): pick the tokenizer named by --tokenizer-type, and pad its vocab size."""
import os
from argparse import Namespace
from typing import Callable, Dict

from megatron.tokenizer.base import MegatronTokenizer
from megatron.utils import print_line


class TokenizerConfigError(ValueError):
    """A tokenizer flag is missing or has a bad value."""


def vocab_size_with_padding(orig_vocab_size: int, args: Namespace) -> int:
    """Round the vocab size up to a multiple of make_vocab_size_divisible_by * TP size.

    Every tensor-parallel rank then holds an equal, GEMM-friendly slice of the embedding
    (GPT-2's 50257 -> 50304 at TP=1, 50432 at TP=2). Prints Megatron's line on rank 0.
    """
    multiple = (getattr(args, "make_vocab_size_divisible_by", 128)
                * getattr(args, "tensor_model_parallel_size", 1))
    if multiple < 1:
        raise TokenizerConfigError(f"--make-vocab-size-divisible-by must be >= 1, got {multiple}")
    after = -(-orig_vocab_size // multiple) * multiple
    if getattr(args, "rank", 0) == 0:
        print_line(" > padded vocab (size: {}) with {} dummy tokens (new size: {})".format(
            orig_vocab_size, after - orig_vocab_size, after))
    return after


def _file_flag(args: Namespace, attr: str, allow_dir: bool = False) -> str:
    """The path given by flag --attr, checked to exist; a clear error names flag and path."""
    flag = "--" + attr.replace("_", "-")
    path = getattr(args, attr, None)
    if not path:
        raise TokenizerConfigError(f"--tokenizer-type {args.tokenizer_type} needs {flag}")
    exists = os.path.exists(path) if allow_dir else os.path.isfile(path)
    if not exists:
        raise FileNotFoundError(f"{flag} {path}: no such file")
    return path


def _gpt2(args: Namespace) -> MegatronTokenizer:
    from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

    return GPT2BPETokenizer(_file_flag(args, "vocab_file"), _file_flag(args, "merge_file"))


def _bert(lower_case: bool) -> Callable[[Namespace], MegatronTokenizer]:
    def build(args: Namespace) -> MegatronTokenizer:
        from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer

        return BertWordPieceTokenizer(_file_flag(args, "vocab_file"), lower_case=lower_case,
                                      vocab_extra_ids=getattr(args, "vocab_extra_ids", 0))
    return build


def _sentencepiece(args: Namespace) -> MegatronTokenizer:
    from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

    return SentencePieceTokenizer(_file_flag(args, "tokenizer_model"),
                                  vocab_extra_ids=getattr(args, "vocab_extra_ids", 0))


def _gpt_sentencepiece(args: Namespace) -> MegatronTokenizer:
    from megatron.tokenizer.sentencepiece_tokenizer import GPTSentencePieceTokenizer

    return GPTSentencePieceTokenizer(_file_flag(args, "tokenizer_model"))


def _llama2(args: Namespace) -> MegatronTokenizer:
    from megatron.tokenizer.sentencepiece_tokenizer import Llama2Tokenizer

    return Llama2Tokenizer(_file_flag(args, "tokenizer_model"))


def _huggingface(args: Namespace) -> MegatronTokenizer:
    from megatron.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(_file_flag(args, "tokenizer_model", allow_dir=True))


def _null(args: Namespace) -> MegatronTokenizer:
    from megatron.tokenizer.null_tokenizer import NullTokenizer

    if getattr(args, "vocab_size", None) is None:
        raise TokenizerConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
    return NullTokenizer(args.vocab_size)


_BUILDERS: Dict[str, Callable[[Namespace], MegatronTokenizer]] = {
    "BertWordPieceLowerCase": _bert(lower_case=True),
    "BertWordPieceCase": _bert(lower_case=False),
    "GPT2BPETokenizer": _gpt2,
    "SentencePieceTokenizer": _sentencepiece,
    "GPTSentencePieceTokenizer": _gpt_sentencepiece,
    "Llama2Tokenizer": _llama2,
    "HuggingFaceTokenizer": _huggingface,
    "NullTokenizer": _null,
}


def build_tokenizer(args: Namespace) -> MegatronTokenizer:
    """Build the --tokenizer-type tokenizer and set ``args.padded_vocab_size``.

    As in Megatron, a padded_vocab_size already on ``args`` (e.g. from a checkpoint) is kept.
    """
    tokenizer_type = getattr(args, "tokenizer_type", None)
    if tokenizer_type not in _BUILDERS:
        raise TokenizerConfigError(f"--tokenizer-type {tokenizer_type} is not supported; "
                                   f"choose one of {', '.join(_BUILDERS)}")
    if getattr(args, "rank", 0) == 0:
        print_line(f"> building {tokenizer_type} tokenizer ...")
    tokenizer = _BUILDERS[tokenizer_type](args)
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer
