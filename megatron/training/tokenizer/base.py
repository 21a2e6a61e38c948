"""The interface every tokenizer implements, as Megatron's training code and tools use it.

Special ids: each tokenizer defines the ones its vocabulary really has. Asking for one it
lacks raises :class:`UnsupportedSpecialToken`, which is both an ``AttributeError`` (so
``getattr(tokenizer, "cls", None)`` and ``hasattr`` work) and a ``NotImplementedError``
(what Megatron raises), and whose message names the tokenizer. No property ever returns
a placeholder such as -1 or None for a missing token.
"""
from abc import ABC, abstractmethod
from typing import Dict, List, Sequence


class UnsupportedSpecialToken(AttributeError, NotImplementedError):
    """Raised when a tokenizer is asked for a special token its vocabulary does not have."""


class TokenizerConfigError(ValueError):
    """A tokenizer flag is missing or has a bad value."""


class MegatronTokenizer(ABC):
    """Abstract tokenizer: text <-> token ids, plus the special ids the models need."""

    def __init__(self, name: str):
        self.name = name

    def _missing(self, what: str) -> UnsupportedSpecialToken:
        return UnsupportedSpecialToken(f"{self.name} tokenizer has no {what} token")

    # --- vocabulary (subclasses fill self._vocab and self._inv_vocab, or override) -------
    _vocab: Dict[str, int]
    _inv_vocab: Dict[int, str]

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (before padding for the embedding)."""
        return len(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        """Token string -> id."""
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token string."""
        return self._inv_vocab

    # --- text <-> ids -----------------------------------------------------------------
    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Convert text to a list of token ids."""

    @abstractmethod
    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Convert token ids back to text."""

    # --- special ids (override the ones the vocabulary has) ---------------------------
    @property
    def cls(self) -> int:
        raise self._missing("CLS")

    @property
    def sep(self) -> int:
        raise self._missing("SEP")

    @property
    def pad(self) -> int:
        raise self._missing("PAD")

    @property
    def eod(self) -> int:
        raise self._missing("EOD (end of document)")

    @property
    def bos(self) -> int:
        raise self._missing("BOS")

    @property
    def eos(self) -> int:
        raise self._missing("EOS")

    @property
    def mask(self) -> int:
        raise self._missing("MASK")

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        """Ids of the T5 sentinel tokens <extra_id_i> (--vocab-extra-ids); [] when none."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"
