"""NullTokenizer: the text already is space-separated token ids (for tests and benchmarks)."""
from typing import Dict, List, Sequence

from megatron.training.tokenizer.base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Ids 0..N-1 are ordinary tokens; id N is end of document, so vocab_size is N + 1."""

    def __init__(self, vocab_size: int):
        super().__init__("Null")
        self._eod_id = int(vocab_size)
        # Megatron counts the extra eod id in the vocabulary size.
        self._vocab_size = int(vocab_size) + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> Dict[str, int]:
        raise NotImplementedError("Null tokenizer has no vocabulary")

    @property
    def inv_vocab(self) -> Dict[int, str]:
        raise NotImplementedError("Null tokenizer has no vocabulary")

    def tokenize(self, text: str) -> List[int]:
        """'3 1 4' -> [3, 1, 4]; runs of whitespace count as one separator."""
        return [int(x) for x in text.split()]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """[3, 1, 4] -> '3 1 4'."""
        return " ".join(str(int(x)) for x in token_ids)

    @property
    def eod(self) -> int:
        return self._eod_id
