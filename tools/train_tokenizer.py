"""Train a tokenizer vocabulary offline from loose JSON or plain text files.

    python tools/train_tokenizer.py --input corpus.jsonl --tokenizer-type GPT2BPETokenizer \
        --vocab-size 32000 --output-dir my-bpe

| --tokenizer-type | trainer | files written |
|---|---|---|
| GPT2BPETokenizer | HF `tokenizers` byte-level BPE (GPT-2 regex) | vocab.json, merges.txt |
| BertWordPieceLowerCase / BertWordPieceCase | HF `tokenizers` WordPiece | vocab.txt |
| SentencePieceTokenizer | `sentencepiece` BPE | tokenizer.model, tokenizer.vocab |

Inputs ending in .json/.jsonl are read as JSON lines (text under each --json-keys key), any
other file as plain text (one line at a time). The files are written to a temporary folder
beside --output-dir, loaded back with this project's tokenizer as a check, then moved into
place, so a failed run leaves no half-written vocabulary.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

Trained = Tuple[List[str], int]  # (file names written, vocab size)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # runnable as `python tools/train_tokenizer.py` from a checkout
    sys.path.insert(0, _ROOT)

from megatron.training.cli import run_cli  # noqa: E402
from megatron.training.tokenizer import build_tokenizer  # noqa: E402

TYPES = (
    "GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer")
GPT2_EOD = "<|endoftext|>"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# sentencepiece silently drops sentences over 4192 bytes; cut lines well below that.
SP_MAX_LINE_BYTES = 4000


class InputError(ValueError):
    """An input file is missing or has a bad line, or a flag a bad value; the message names
    the file and line, or the flag."""


class MissingPackageError(ImportError):
    """An optional package the chosen trainer needs is not installed; the message says how to install it."""


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="jsonl/json or text files")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys to read")
    parser.add_argument("--tokenizer-type", required=True, choices=TYPES)
    parser.add_argument("--vocab-size", type=int, required=True, help="target vocabulary size")
    parser.add_argument("--min-frequency", type=int, default=2,
                        help="minimum pair/word count for a merge (BPE and WordPiece only)")
    parser.add_argument("--output-dir", required=True, help="folder for the vocabulary files")
    parser.add_argument("--special-tokens", nargs="*", default=[],
                        help="extra special tokens to reserve in the vocabulary")
    return parser.parse_args(argv)


# --- reading ----------------------------------------------------------------------------
def _decoded_lines(path: str) -> Iterator[Tuple[int, str]]:
    """(line number, text) of each line; a file that is not UTF-8 is an InputError naming the line."""
    try:
        with open(path, encoding="utf-8") as f:
            yield from enumerate(f, 1)
    except UnicodeDecodeError:
        raise InputError(_first_non_utf8_line(path)) from None


def _first_non_utf8_line(path: str) -> str:
    """`FILE:LINE: not valid UTF-8 ...` for the first bad line (a text-mode file fails somewhere
    in the chunk it was decoding, so the line is found again byte by byte)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return (f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte "
                        f"{err.start + 1} of the line)")
    return f"{path}: not valid UTF-8"


def _json_texts(path: str, keys: List[str]) -> Iterator[str]:
    for lineno, line in _decoded_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{path}:{lineno}: bad JSON line ({err.msg})") from None
        for key in keys:
            value = record.get(key) if isinstance(record, dict) else None
            if not isinstance(value, str):
                raise InputError(f"{path}:{lineno}: no string under JSON key {key!r}")
            yield value


def iter_texts(paths: List[str], keys: List[str]) -> Iterator[str]:
    """Documents (JSON inputs) or lines (text inputs) of all inputs, in order."""
    for path in paths:
        if path.endswith((".json", ".jsonl")):
            yield from _json_texts(path, keys)
        else:
            yield from (line for _, line in _decoded_lines(path))


class _Guarded:
    """Wraps the text iterator: trainers swallow iterator errors, so keep them to re-raise."""

    def __init__(self, texts: Iterator[str]):
        self.texts = texts
        self.error: Optional[BaseException] = None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self.texts
        except Exception as err:  # re-raised by check() once the trainer returns
            self.error = err

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def sentencepiece_lines(texts: Iterator[str]) -> Iterator[str]:
    """Non-empty lines of every text, long ones cut at spaces below SP_MAX_LINE_BYTES."""
    for text in texts:
        for line in text.split("\n"):
            line = line.strip()
            while len(line.encode("utf-8")) > SP_MAX_LINE_BYTES:
                cut = line.rfind(" ", 0, SP_MAX_LINE_BYTES // 4)
                cut = cut if cut > 0 else SP_MAX_LINE_BYTES // 4
                yield line[:cut]
                line = line[cut:].strip()
            if line:
                yield line


# --- trainers ---------------------------------------------------------------------------
def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as err:
        raise MissingPackageError("training BPE/WordPiece vocabularies needs the 'tokenizers' package: "
                          "pip install -e .[tokenizers]") from err
    return tokenizers


def train_gpt2_bpe(texts: Iterator[str], args: argparse.Namespace, out: str) -> Trained:
    """Byte-level BPE like GPT-2's; writes vocab.json and merges.txt ('#version: 0.2' header).

    Like every trainer here, returns the file names written in ``out`` and the vocab size.
    """
    tk = _import_tokenizers()
    specials = [GPT2_EOD] + [t for t in args.special_tokens if t != GPT2_EOD]
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    if args.vocab_size < len(alphabet) + len(specials):
        raise InputError(f"--vocab-size {args.vocab_size} is below the 256 bytes + special tokens")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    # GPT-2 pre-tokenization: its regex, no space added in front of the text.
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=args.vocab_size, min_frequency=args.min_frequency,
                                     special_tokens=specials, initial_alphabet=alphabet,
                                     show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.model.save(out)
    return ["vocab.json", "merges.txt"], tokenizer.get_vocab_size()


def train_bert_wordpiece(texts: Iterator[str], args: argparse.Namespace, out: str) -> Trained:
    """WordPiece with BERT's normalizer; writes vocab.txt, [PAD] [UNK] [CLS] [SEP] [MASK] first."""
    tk = _import_tokenizers()
    lower = args.tokenizer_type == "BertWordPieceLowerCase"
    specials = BERT_SPECIALS + [t for t in args.special_tokens if t not in BERT_SPECIALS]
    tokenizer = tk.Tokenizer(tk.models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = tk.normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                         lowercase=lower, strip_accents=lower)
    tokenizer.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    trainer = tk.trainers.WordPieceTrainer(
        vocab_size=args.vocab_size, min_frequency=args.min_frequency, special_tokens=specials,
        continuing_subword_prefix="##", show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.model.save(out)
    return ["vocab.txt"], tokenizer.get_vocab_size()


def train_sentencepiece(texts: Iterator[str], args: argparse.Namespace, out: str) -> Trained:
    """sentencepiece BPE model; writes tokenizer.model (and its readable tokenizer.vocab)."""
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=sentencepiece_lines(texts), model_prefix=os.path.join(out, "tokenizer"),
        vocab_size=args.vocab_size, model_type="bpe", character_coverage=1.0,
        user_defined_symbols=args.special_tokens or [], minloglevel=2,
        num_threads=min(os.cpu_count() or 1, 16))
    model = sentencepiece.SentencePieceProcessor(model_file=os.path.join(out, "tokenizer.model"))
    return ["tokenizer.model", "tokenizer.vocab"], model.get_piece_size()


TRAINERS: Dict[str, Callable[[Iterator[str], argparse.Namespace, str], Trained]] = {
    "GPT2BPETokenizer": train_gpt2_bpe,
    "BertWordPieceLowerCase": train_bert_wordpiece,
    "BertWordPieceCase": train_bert_wordpiece,
    "SentencePieceTokenizer": train_sentencepiece,
}


# --- output -----------------------------------------------------------------------------
def load_trained(tokenizer_type: str, folder: str):
    """Load vocabulary files from ``folder`` with this project's tokenizer (rank 1: quiet)."""
    files = {"vocab_file": None, "merge_file": None, "tokenizer_model": None}
    if tokenizer_type == "GPT2BPETokenizer":
        files.update(vocab_file=os.path.join(folder, "vocab.json"),
                     merge_file=os.path.join(folder, "merges.txt"))
    elif tokenizer_type.startswith("Bert"):
        files["vocab_file"] = os.path.join(folder, "vocab.txt")
    else:
        files["tokenizer_model"] = os.path.join(folder, "tokenizer.model")
    args = argparse.Namespace(tokenizer_type=tokenizer_type, vocab_extra_ids=0, rank=1,
                              make_vocab_size_divisible_by=128, **files)
    return build_tokenizer(args)


def publish(tmp: str, output_dir: str, names: List[str]) -> None:
    """Move the finished files from ``tmp`` into ``output_dir`` (one rename when it is new)."""
    if not os.path.exists(output_dir):
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private; give it a normal folder's mode
        os.rename(tmp, output_dir)
        return
    for name in names:
        os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))


def train(args: argparse.Namespace) -> Trained:
    """Train, check and publish; returns the paths written and the vocab size."""
    for path in args.input:
        if not os.path.isfile(path):
            raise InputError(f"--input {path}: no such file")
    parent = os.path.dirname(os.path.abspath(args.output_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".train_tokenizer-", dir=parent)
    try:
        texts = _Guarded(iter_texts(args.input, args.json_keys))
        trainer = TRAINERS[args.tokenizer_type]
        try:
            names, vocab_size = trainer(iter(texts), args, tmp)
        except Exception:
            texts.check()  # an input error is the real cause; report it rather than the trainer's
            raise
        texts.check()
        load_trained(args.tokenizer_type, tmp)  # what we publish must load
        publish(tmp, args.output_dir, names)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [os.path.join(args.output_dir, name) for name in names], vocab_size


def main(argv: Optional[List[str]] = None) -> List[str]:
    """Command-line entry point; returns the paths written."""
    args = get_args(argv)
    start = time.time()
    paths, vocab_size = train(args)
    print(f"> trained {args.tokenizer_type} tokenizer: vocab size {vocab_size}, "
          f"wrote {', '.join(paths)} in {time.time() - start:.1f} s", flush=True)
    return paths


if __name__ == "__main__":
    run_cli(main, "train_tokenizer.py", errors=(InputError, MissingPackageError))
