"""build_tokenizer(args): pick the tokenizer named by --tokenizer-type, and pad its vocab size.

The tokenizer also gets Megatron-LM's self-description, `unique_identifiers` (its legacy
tokenizers', core_v0.13-0.14 or --legacy-tokenizer): the dataset index caches hash it, so with
the same flags our cache files carry megatron-core's names (docs/data.md).

| --tokenizer-type | class | tokenizer_path | options (as strings) |
|---|---|---|---|
| GPT2BPETokenizer | _GPT2BPETokenizer | [vocab_file, merge_file] | |
| BertWordPieceLowerCase / Case | _BertWordPieceTokenizer | [vocab_file] | lower_case, vocab_extra_ids |
| SentencePieceTokenizer | _SentencePieceTokenizer | [tokenizer_model] | vocab_extra_ids |
| GPTSentencePieceTokenizer | _GPTSentencePieceTokenizer | [tokenizer_model] | vocab_extra_ids = 0 |
| Llama2Tokenizer | _Llama2Tokenizer | [tokenizer_model] | vocab_extra_ids = 0 |
| HuggingFaceTokenizer | _HuggingFaceTokenizer | [tokenizer_model] | |
| NullTokenizer | _NullTokenizer | [None] | vocab_size |
"""
import os
from argparse import Namespace
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron.training.tokenizer.base import MegatronTokenizer, TokenizerConfigError  # noqa: F401 (re-exported)
from megatron.core.utils import print_line


def vocab_size_with_padding(orig_vocab_size: int, args: Namespace, logging_enabled: bool = True) -> int:
    """Round the vocab size up to a multiple of make_vocab_size_divisible_by * TP size.

    Every tensor-parallel rank then holds an equal, GEMM-friendly slice of the embedding
    (GPT-2's 50257 -> 50304 at TP=1, 50432 at TP=2). Prints Megatron's line on rank 0 unless
    logging_enabled is False. Megatron's name is _vocab_size_with_padding (below).
    """
    multiple = (getattr(args, "make_vocab_size_divisible_by", 128)
                * getattr(args, "tensor_model_parallel_size", 1))
    if multiple < 1:
        raise TokenizerConfigError(f"--make-vocab-size-divisible-by must be >= 1, got {multiple}")
    after = -(-orig_vocab_size // multiple) * multiple
    if getattr(args, "rank", 0) == 0 and logging_enabled:
        print_line(" > padded vocab (size: {}) with {} dummy tokens (new size: {})".format(
            orig_vocab_size, after - orig_vocab_size, after))
    return after


# Megatron-LM's name (megatron/training/tokenizer/tokenizer.py), which Accelerate imports.
_vocab_size_with_padding = vocab_size_with_padding


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
    from megatron.training.tokenizer.gpt2_bpe import GPT2BPETokenizer

    return GPT2BPETokenizer(_file_flag(args, "vocab_file"), _file_flag(args, "merge_file"))


def _bert(lower_case: bool) -> Callable[[Namespace], MegatronTokenizer]:
    def build(args: Namespace) -> MegatronTokenizer:
        from megatron.training.tokenizer.bert_wordpiece import BertWordPieceTokenizer

        return BertWordPieceTokenizer(_file_flag(args, "vocab_file"), lower_case=lower_case,
                                      vocab_extra_ids=getattr(args, "vocab_extra_ids", 0))
    return build


def _sentencepiece(args: Namespace) -> MegatronTokenizer:
    from megatron.training.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

    return SentencePieceTokenizer(_file_flag(args, "tokenizer_model"),
                                  vocab_extra_ids=getattr(args, "vocab_extra_ids", 0))


def _gpt_sentencepiece(args: Namespace) -> MegatronTokenizer:
    from megatron.training.tokenizer.sentencepiece_tokenizer import GPTSentencePieceTokenizer

    return GPTSentencePieceTokenizer(_file_flag(args, "tokenizer_model"))


def _llama2(args: Namespace) -> MegatronTokenizer:
    from megatron.training.tokenizer.sentencepiece_tokenizer import Llama2Tokenizer

    return Llama2Tokenizer(_file_flag(args, "tokenizer_model"))


def _huggingface(args: Namespace) -> MegatronTokenizer:
    from megatron.training.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(_file_flag(args, "tokenizer_model", allow_dir=True))


def _null(args: Namespace) -> MegatronTokenizer:
    from megatron.training.tokenizer.null_tokenizer import NullTokenizer

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


# --tokenizer-type -> (Megatron's class name, the path flags, the options: flag -> fixed value or None
# for the flag's own value); see the module docstring.
_MEGATRON_DESCRIPTIONS: Dict[str, Tuple[str, Tuple[str, ...], Tuple[Tuple[str, Any], ...]]] = {
    "GPT2BPETokenizer": ("_GPT2BPETokenizer", ("vocab_file", "merge_file"), ()),
    "BertWordPieceLowerCase": ("_BertWordPieceTokenizer", ("vocab_file",),
                               (("lower_case", True), ("vocab_extra_ids", None))),
    "BertWordPieceCase": ("_BertWordPieceTokenizer", ("vocab_file",),
                          (("lower_case", False), ("vocab_extra_ids", None))),
    "SentencePieceTokenizer": ("_SentencePieceTokenizer", ("tokenizer_model",), (("vocab_extra_ids", None),)),
    "GPTSentencePieceTokenizer": ("_GPTSentencePieceTokenizer", ("tokenizer_model",), (("vocab_extra_ids", 0),)),
    "Llama2Tokenizer": ("_Llama2Tokenizer", ("tokenizer_model",), (("vocab_extra_ids", 0),)),
    "HuggingFaceTokenizer": ("_HuggingFaceTokenizer", ("tokenizer_model",), ()),
    "NullTokenizer": ("_NullTokenizer", (), (("vocab_size", None),)),
}


def megatron_unique_identifiers(args: Namespace) -> "OrderedDict[str, Any]":
    """How Megatron-LM's tokenizer for these flags describes itself: class, the paths exactly as
    given on the command line, then each option as a string (its MegatronTokenizer base class)."""
    name, path_flags, options = _MEGATRON_DESCRIPTIONS[args.tokenizer_type]
    paths: List[Optional[str]] = [getattr(args, flag) for flag in path_flags] or [None]
    identifiers: "OrderedDict[str, Any]" = OrderedDict([("class", name), ("tokenizer_path", paths)])
    for option, fixed in options:
        identifiers[option] = str(getattr(args, option, 0) if fixed is None else fixed)
    return identifiers


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
    tokenizer.unique_identifiers = megatron_unique_identifiers(args)  # the dataset caches hash it
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer
