"""GPT-2's byte-level BPE, implemented here in pure Python (vocab.json + merges.txt).

The algorithm is OpenAI's: text is cut into words by GPT-2's regex, each word's UTF-8
bytes are mapped to printable characters (``bytes_to_unicode``), then adjacent symbols are
merged, lowest merge rank first, until no ranked pair is left. Results are cached per word,
which is what makes a corpus pass fast: most words repeat.
"""
import json
from functools import lru_cache
from typing import Dict, List, Sequence, Tuple

import regex

from megatron.training.tokenizer.base import MegatronTokenizer
from megatron.training.tokenizer.base import TokenizerConfigError

# GPT-2's pre-tokenization pattern: contractions, letter runs, number runs, other symbol
# runs (each with an optional leading space), then whitespace not followed by a word.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOD_TOKEN = "<|endoftext|>"
# Bound on the word cache: the corpus vocabulary of words, not of tokens, lives here.
_CACHE_LIMIT = 1_000_000


@lru_cache()
def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, ...)
    map to chr(256 + n) in byte order, so no token string contains whitespace.
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(table.items()))


_SWAPPED = "are --vocab-file and --merge-file swapped?"


def _read_text(path: str, shown: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise TokenizerConfigError(f"{shown} {path} is not a text file (not UTF-8)") from None


def _looks_like_merges(text: str) -> bool:
    lines = [line for line in text.split("\n")[:5] if line.strip()]
    return bool(lines) and (lines[0].startswith("#version") or all(len(line.split(" ")) == 2 for line in lines))


def read_vocab(vocab_file: str) -> Dict[str, int]:
    """Read vocab.json ({token: id}); a merges file, or anything else, is a TokenizerConfigError
    saying what the file looks like."""
    text = _read_text(vocab_file, "--vocab-file")
    try:
        vocab = json.loads(text)
    except json.JSONDecodeError as error:
        if _looks_like_merges(text):
            raise TokenizerConfigError(f"--vocab-file {vocab_file} looks like a BPE merges file (merges.txt: "
                                       "'#version' and 'left right' lines), not GPT-2's vocab.json; "
                                       f"{_SWAPPED}") from None
        raise TokenizerConfigError(f"--vocab-file {vocab_file} is not GPT-2's vocab.json (a JSON object of "
                                   f"token ids): {error}") from None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise TokenizerConfigError(f"--vocab-file {vocab_file} is JSON but not GPT-2's vocab.json "
                                   "(an object mapping each token to its integer id)")
    return vocab


def read_merges(merge_file: str) -> List[Tuple[str, str]]:
    """Read merges.txt: one 'left right' pair per line, after an optional '#version' line; a
    JSON vocabulary, or a line that is not a pair, is a TokenizerConfigError."""
    text = _read_text(merge_file, "--merge-file")
    if text.lstrip().startswith("{"):
        raise TokenizerConfigError(f"--merge-file {merge_file} looks like a JSON vocabulary (vocab.json), not "
                                   f"GPT-2's merges.txt; {_SWAPPED}")
    lines = text.split("\n")
    first = 1
    if lines and lines[0].startswith("#version"):
        lines, first = lines[1:], 2
    merges = []
    for number, line in enumerate(lines, first):
        if not line.strip():
            continue
        pair = tuple(line.split(" "))
        if len(pair) != 2:
            raise TokenizerConfigError(f"--merge-file {merge_file}:{number}: expected a merge 'left right', "
                                       f"got {line[:60]!r}")
        merges.append(pair)
    return merges


def bpe_merge(word: str, ranks: Dict[Tuple[str, str], int]) -> List[str]:
    """Apply BPE merges to one byte-mapped word; returns its symbols."""
    symbols = list(word)
    while len(symbols) > 1:
        # The adjacent pair with the lowest merge rank is merged everywhere at once.
        pairs = zip(symbols, symbols[1:])
        best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
        if best not in ranks:
            break
        first, second = best
        merged: List[str] = []
        i = 0
        n = len(symbols)
        while i < n:
            if i < n - 1 and symbols[i] == first and symbols[i + 1] == second:
                merged.append(first + second)
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
    return symbols


class GPT2BPETokenizer(MegatronTokenizer):
    """Megatron's GPT2BPETokenizer: byte-level BPE from vocab.json and merges.txt."""

    def __init__(self, vocab_file: str, merge_file: str):
        super().__init__("GPT2 BPE")
        self.encoder: Dict[str, int] = read_vocab(vocab_file)
        self.decoder: Dict[int, str] = {v: k for k, v in self.encoder.items()}
        self._vocab, self._inv_vocab = self.encoder, self.decoder
        self.bpe_ranks = {pair: i for i, pair in enumerate(read_merges(merge_file))}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        # Latin-1 decoding maps byte b to chr(b); this table then maps chr(b) to GPT-2's char.
        self._byte_table = str.maketrans({chr(b): c for b, c in self.byte_encoder.items()})
        self._pattern = regex.compile(GPT2_PATTERN)
        self._cache: Dict[str, List[int]] = {}
        self._id_bytes: Dict[int, bytes] = {}
        if EOD_TOKEN not in self.encoder:
            raise TokenizerConfigError(f"--vocab-file {vocab_file} has no {EOD_TOKEN!r} token (needed as end "
                                       "of document)")
        self.eod_id = self.encoder[EOD_TOKEN]

    def _word_ids(self, word: str) -> List[int]:
        mapped = word.encode("utf-8").decode("latin-1").translate(self._byte_table)
        ids = [self.encoder[s] for s in bpe_merge(mapped, self.bpe_ranks)]
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[word] = ids
        return ids

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``; '<|endoftext|>' in the text is NOT special (as in Megatron)."""
        ids: List[int] = []
        cache = self._cache
        for word in self._pattern.findall(text):
            cached = cache.get(word)
            ids.extend(cached if cached is not None else self._word_ids(word))
        return ids

    def _bytes_of(self, token_id: int) -> bytes:
        data = self._id_bytes.get(token_id)
        if data is None:
            data = bytes(self.byte_decoder[c] for c in self.decoder[token_id])
            self._id_bytes[token_id] = data
        return data

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``; invalid UTF-8 (split multi-byte chars) becomes U+FFFD."""
        id_bytes = self._id_bytes
        data = b"".join([id_bytes.get(i) or self._bytes_of(i) for i in token_ids])
        return data.decode("utf-8", errors="replace")

    @property
    def eod(self) -> int:
        return self.eod_id
