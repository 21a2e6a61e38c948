"""BERT's WordPiece tokenizer (vocab.txt), implemented here in pure Python.

Two stages, as in Google's original BERT code that Megatron ships:
1. basic: drop control characters, turn whitespace into spaces, put spaces around CJK
   ideographs, split on whitespace; per word, lower-case and strip accents (NFD, drop Mn)
   when lower-casing, then split off every punctuation character;
2. wordpiece: greedy longest-match-first over the vocabulary, continuation pieces
   prefixed with '##'; a word with an unmatched rest, or longer than 100 characters,
   becomes [UNK].
Stage 1's per-word part and stage 2 depend only on the word, so their result is cached
per whitespace-separated word; the per-character cleanup runs through ``str.translate``.
"""
import unicodedata
from typing import Dict, List, Sequence

from megatron.training.tokenizer.base import MegatronTokenizer

UNK, CLS, SEP, PAD, MASK, BOS, EOS = "[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "[BOS]", "[EOS]"
_CACHE_LIMIT = 1_000_000
# CJK Unified Ideographs blocks (BERT's definition; not Hangul, kana or other Asian scripts).
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
               (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def load_vocab(vocab_file: str) -> Dict[str, int]:
    """One token per line; the id is the line number (a repeated token keeps its last line)."""
    vocab: Dict[str, int] = {}
    with open(vocab_file, encoding="utf-8") as f:
        for index, line in enumerate(f):
            vocab[line.strip()] = index
    return vocab


def is_punctuation(char: str) -> bool:
    """BERT's punctuation: every non-alphanumeric printable ASCII char plus Unicode P*."""
    cp = ord(char)
    # ASCII symbols such as '$', '^', '`' are not Unicode P* but BERT splits on them too.
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


class _CleanupTable(dict):
    """``str.translate`` table, filled lazily: control -> '', whitespace -> ' ', CJK -> ' c '."""

    def __missing__(self, cp: int) -> str:
        char = chr(cp)
        if char in " \t\n\r" or unicodedata.category(char) == "Zs":
            out = " "
        elif cp == 0 or cp == 0xFFFD or unicodedata.category(char).startswith("C"):
            out = ""
        elif _is_cjk(cp):
            out = f" {char} "
        else:
            out = char
        self[cp] = out
        return out


def strip_accents(text: str) -> str:
    """Decompose (NFD) and drop the combining marks (category Mn)."""
    return "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")


def split_on_punctuation(word: str) -> List[str]:
    """Split ``word`` so that each punctuation character is a piece of its own."""
    pieces: List[str] = []
    current: List[str] = []
    for char in word:
        if is_punctuation(char):
            if current:
                pieces.append("".join(current))
                current = []
            pieces.append(char)
        else:
            current.append(char)
    if current:
        pieces.append("".join(current))
    return pieces


def wordpiece(word: str, vocab: Dict[str, int], max_chars: int = 100) -> List[str]:
    """Greedy longest-match-first split of one word; [UNK] if any rest cannot be matched."""
    if len(word) > max_chars:
        return [UNK]
    pieces: List[str] = []
    start = 0
    while start < len(word):
        end = len(word)
        while end > start:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                break
            end -= 1
        else:
            return [UNK]
        pieces.append(piece)
        start = end
    return pieces


class BertWordPieceTokenizer(MegatronTokenizer):
    """Megatron's BertWordPieceLowerCase (lower_case=True) and BertWordPieceCase tokenizers."""

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0,
                 max_input_chars_per_word: int = 100):
        super().__init__("BERT Lower Case" if lower_case else "BERT Upper Case")
        self.lower_case = lower_case
        self.max_input_chars_per_word = max_input_chars_per_word
        self._vocab = load_vocab(vocab_file)
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        for token in (UNK, CLS, SEP, PAD, MASK):
            if token not in self._vocab:
                raise ValueError(f"--vocab-file {vocab_file} has no {token} token")
        self._cleanup = _CleanupTable()
        self._cache: Dict[str, List[int]] = {}
        # Megatron appends [BOS]/[EOS] (for T5/BERT generation) when the vocab lacks them.
        self.bos_token, self.eos_token = BOS, EOS
        self.add_token(BOS)
        self.add_token(EOS)
        # T5 sentinels <extra_id_i> go after them, in order (--vocab-extra-ids).
        self.additional_special_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self.additional_special_tokens:
            self.add_token(token)

    def add_token(self, token: str) -> None:
        """Append ``token`` with the next free id unless the vocabulary already has it."""
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token] = new_id
            self._inv_vocab[new_id] = token
            self._cache.clear()

    # --- encoding ---------------------------------------------------------------------
    def _word_pieces(self, word: str) -> List[str]:
        if self.lower_case:
            word = word.lower()
            if not word.isascii():
                word = strip_accents(word)
        pieces: List[str] = []
        for part in split_on_punctuation(word):
            pieces.extend(wordpiece(part, self._vocab, self.max_input_chars_per_word))
        return pieces

    def _word_ids(self, word: str) -> List[int]:
        ids = [self._vocab[p] for p in self._word_pieces(word)]
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[word] = ids
        return ids

    def text_to_tokens(self, text: str) -> List[str]:
        """Wordpiece strings of ``text`` (Megatron's ``tokenizer.tokenize`` of the full BERT)."""
        words = text.translate(self._cleanup).split()
        return [p for w in words for p in self._word_pieces(w)]

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``, without [CLS]/[SEP]."""
        ids: List[int] = []
        cache = self._cache
        for word in text.translate(self._cleanup).split():
            cached = cache.get(word)
            ids.extend(cached if cached is not None else self._word_ids(word))
        return ids

    # --- decoding ---------------------------------------------------------------------
    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> List[str]:
        """Token strings of ``token_ids``."""
        return [self._inv_vocab[i] for i in token_ids]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Space-join the tokens and glue '##' continuations to the piece before them."""
        return " ".join(self.convert_ids_to_tokens(token_ids)).replace(" ##", "").strip()

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Same as :meth:`decode` (Megatron's inference code calls this name)."""
        return self.decode(token_ids)

    def decode_token_ids(self, token_ids: Sequence[int]) -> str:
        """Megatron's variant: drop [PAD]/[CLS], prefix each new word with a space."""
        out = []
        for token in self.convert_ids_to_tokens(token_ids):
            if token in (PAD, CLS):
                continue
            out.append(token[2:] if token.startswith("##") else " " + token)
        return "".join(out)

    # --- special ids ------------------------------------------------------------------
    @property
    def cls(self) -> int:
        return self._vocab[CLS]

    @property
    def sep(self) -> int:
        return self._vocab[SEP]

    @property
    def pad(self) -> int:
        return self._vocab[PAD]

    @property
    def mask(self) -> int:
        return self._vocab[MASK]

    @property
    def eod(self) -> int:
        # Megatron ends BERT documents with [SEP].
        return self._vocab[SEP]

    @property
    def bos(self) -> int:
        return self._vocab[BOS]

    @property
    def eos(self) -> int:
        return self._vocab[EOS]

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return [self._vocab[t] for t in self.additional_special_tokens]
