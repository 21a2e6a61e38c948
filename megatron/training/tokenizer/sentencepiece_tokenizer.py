"""Tokenizers over a SentencePiece model file (--tokenizer-model).

* SentencePieceTokenizer: Megatron's T5/BERT-style wrapper. It adds <CLS>, <SEP>, <EOD>,
  <MASK>, the model's pad/bos/eos pieces (or <PAD>/<BOS>/<EOS> when the model defines none)
  and <extra_id_i> sentinels after the model's pieces, and treats all of them as special
  strings in the text.
* GPTSentencePieceTokenizer: the model as it is; eod is the model's eos.
* Llama2Tokenizer: as GPTSentencePieceTokenizer, but ``tokenize`` prepends bos by default.
"""
import re
from typing import Dict, List, Sequence

from megatron.training.tokenizer.base import MegatronTokenizer


def load_sentencepiece(model_file: str):
    """Load a SentencePieceProcessor from ``model_file``."""
    import sentencepiece  # a core dependency, imported here to keep package import light

    return sentencepiece.SentencePieceProcessor(model_file=model_file)


class _SentencePieceBase(MegatronTokenizer):
    """Shared part: the processor and the piece <-> id tables."""

    def __init__(self, name: str, model_file: str):
        super().__init__(name)
        self.tokenizer = load_sentencepiece(model_file)
        self._vocab: Dict[str, int] = {}
        self._inv_vocab: Dict[int, str] = {}
        for i in range(self.tokenizer.get_piece_size()):
            piece = self.tokenizer.id_to_piece(i)
            self._vocab[piece] = i
            self._inv_vocab[i] = piece

    def _model_id(self, which: str) -> int:
        """The model's own bos/eos/pad id; sentencepiece reports -1 when it has none."""
        value = getattr(self.tokenizer, f"{which}_id")()
        if value < 0:
            raise self._missing(which.upper())
        return value


class SentencePieceTokenizer(_SentencePieceBase):
    """Megatron's SentencePieceTokenizer (special tokens added after the model's pieces)."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__("SentencePiece", model_file)
        self._special_tokens: Dict[str, int] = {}
        self._inv_special_tokens: Dict[int, str] = {}
        self._cls_id = self._add_special_token("<CLS>")
        self._sep_id = self._add_special_token("<SEP>")
        self._eod_id = self._add_special_token("<EOD>")
        self._mask_id = self._add_special_token("<MASK>")
        self._pad_id = self._add_special_token(self._model_piece("pad", "<PAD>"))
        self._bos_id = self._add_special_token(self._model_piece("bos", "<BOS>"))
        self._eos_id = self._add_special_token(self._model_piece("eos", "<EOS>"))
        self._t5_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self._t5_tokens:
            self._add_special_token(token)
        # Earliest occurrence wins; at one position the first-added token wins (Megatron).
        self._special_re = re.compile("|".join(re.escape(t) for t in self._special_tokens))

    def _model_piece(self, which: str, fallback: str) -> str:
        model_id = getattr(self.tokenizer, f"{which}_id")()
        return self.tokenizer.id_to_piece(model_id) if model_id >= 0 else fallback

    def _add_special_token(self, token: str) -> int:
        # A piece the model already has keeps its id; a new one goes after the last id.
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token] = new_id
            self._inv_vocab[new_id] = token
        self._special_tokens[token] = self._vocab[token]
        self._inv_special_tokens[self._vocab[token]] = token
        return self._vocab[token]

    def tokenize(self, text: str) -> List[int]:
        """Encode ``text``; special-token strings in it become their ids."""
        ids: List[int] = []
        start = 0
        for match in self._special_re.finditer(text):
            ids.extend(self.tokenizer.encode_as_ids(text[start:match.start()]))
            ids.append(self._special_tokens[match.group()])
            start = match.end()
        ids.extend(self.tokenizer.encode_as_ids(text[start:]))
        return ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Decode; each special token is written as its string followed by a space (Megatron)."""
        token_ids = list(token_ids)
        text = ""
        last = 0
        for i, token_id in enumerate(token_ids):
            if token_id in self._inv_special_tokens:
                text += self.tokenizer.decode_ids(token_ids[last:i]) + " "
                text += self._inv_special_tokens[token_id] + " "
                last = i + 1
        return text + self.tokenizer.decode_ids(token_ids[last:])

    @property
    def cls(self) -> int:
        return self._cls_id

    @property
    def sep(self) -> int:
        return self._sep_id

    @property
    def pad(self) -> int:
        return self._pad_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def mask(self) -> int:
        return self._mask_id

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return [self._vocab[t] for t in self._t5_tokens]


class GPTSentencePieceTokenizer(_SentencePieceBase):
    """Megatron's GPTSentencePieceTokenizer: plain sentencepiece, eod = the model's eos."""

    def __init__(self, model_file: str, name: str = "GPT SentencePiece"):
        super().__init__(name, model_file)

    def tokenize(self, text: str) -> List[int]:
        """Encode ``text`` with sentencepiece (no bos/eos added)."""
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Decode with sentencepiece."""
        return self.tokenizer.decode_ids(list(token_ids))

    @property
    def pad(self) -> int:
        return self._model_id("pad")

    @property
    def bos(self) -> int:
        return self._model_id("bos")

    @property
    def eos(self) -> int:
        return self._model_id("eos")

    @property
    def eod(self) -> int:
        return self._model_id("eos")


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's Llama2Tokenizer: ``tokenize(text, bos=True, eos=False)``.

    ``pad`` is the model's own pad piece; Llama-2's model has none, so ``pad`` raises
    (Megatron returns sentencepiece's -1, which would index the last embedding row).
    """

    def __init__(self, model_file: str):
        super().__init__(model_file, name="Llama2 SentencePiece")
        if self.tokenizer.vocab_size() != self.tokenizer.get_piece_size():
            raise ValueError(f"--tokenizer-model {model_file}: vocab size != piece count")

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        """Encode ``text``; prepend bos / append eos as asked (text-completion defaults)."""
        ids = self.tokenizer.encode_as_ids(text)
        if bos:
            ids = [self._model_id("bos")] + ids
        if eos:
            ids = ids + [self._model_id("eos")]
        return ids
