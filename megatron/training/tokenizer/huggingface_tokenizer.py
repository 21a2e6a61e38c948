"""HuggingFaceTokenizer: a local tokenizer.json file or a saved HuggingFace tokenizer folder.

``--tokenizer-model PATH``:
* PATH is a file: a ``tokenizers`` tokenizer.json, loaded with ``tokenizers.Tokenizer``;
* PATH is a folder: loaded with ``transformers.AutoTokenizer`` (local files only) when
  transformers is installed, else with ``tokenizers`` from PATH/tokenizer.json.
Both libraries are optional extras, imported only here and only when this type is used.

As in Megatron, ``tokenize`` is the library's default encoding, so a post-processor that
adds special tokens (e.g. Llama's BOS) runs; ``detokenize`` keeps special tokens.

``additional_special_tokens_ids`` are the T5 sentinels ``<extra_id_i>`` of the vocabulary in
order of i (what span corruption takes: the first span gets ``<extra_id_0>``). HF's T5
vocabulary counts them down from its last id (``<extra_id_0>`` = 32099 in t5's), so the order
comes from the names, not from the ids.
"""
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.training.tokenizer.base import MegatronTokenizer

INSTALL_HINT = "pip install -e .[huggingface]"
# Conventional strings for special tokens when a bare tokenizer.json carries no roles.
_CANDIDATES = {
    "eos": ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]"),
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]"),
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "cls": ("[CLS]", "<cls>"),
    "sep": ("[SEP]", "<sep>"),
    "mask": ("[MASK]", "<mask>"),
}
_SENTINEL = re.compile(r"<extra_id_(\d+)>")


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError(
            f"HuggingFaceTokenizer needs the 'tokenizers' package: {INSTALL_HINT}") from err
    return tokenizers


def _import_transformers():
    try:
        import transformers
    except ImportError:
        return None
    return transformers


class HuggingFaceTokenizer(MegatronTokenizer):
    """Megatron's HuggingFaceTokenizer over local files (see the module docstring)."""

    def __init__(self, path: str):
        super().__init__(f"HuggingFace ({path})")
        self._hf = None       # a transformers tokenizer, when loaded that way
        self._backend = None  # a tokenizers.Tokenizer, when loaded that way
        transformers = _import_transformers() if os.path.isdir(path) else None
        if transformers is not None:
            self._hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
            self._vocab: Dict[str, int] = dict(self._hf.get_vocab())
        else:
            tokenizers = _import_tokenizers()
            file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
            if not os.path.isfile(file):
                raise FileNotFoundError(f"--tokenizer-model {path}: no tokenizer.json at {file} "
                                        f"(a folder needs transformers: {INSTALL_HINT})")
            self._backend = tokenizers.Tokenizer.from_file(file)
            self._vocab = dict(self._backend.get_vocab(with_added_tokens=True))
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        sentinels = ((_SENTINEL.fullmatch(t), i) for t, i in self._vocab.items())
        self._sentinel_ids = [i for _, i in sorted((int(m.group(1)), i) for m, i in sentinels if m)]

    @property
    def vocab_size(self) -> int:
        # Ids may have holes; the embedding must still cover the largest id.
        return max(len(self._vocab), max(self._vocab.values(), default=-1) + 1)

    def tokenize(self, text: str) -> List[int]:
        """The library's default encoding of ``text`` (its post-processor included)."""
        if self._hf is not None:
            return list(self._hf(text)["input_ids"])
        return self._backend.encode(text).ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Decode ``token_ids``, special tokens included."""
        if self._hf is not None:
            return self._hf.decode(list(token_ids))
        return self._backend.decode(list(token_ids), skip_special_tokens=False)

    def _special(self, role: str) -> int:
        token_id: Optional[int] = getattr(self._hf, f"{role}_token_id", None) if self._hf else None
        if token_id is None:
            token_id = next((self._vocab[t] for t in _CANDIDATES[role] if t in self._vocab), None)
        if token_id is None:
            raise self._missing(role.upper())
        return token_id

    @property
    def eos(self) -> int:
        return self._special("eos")

    @property
    def eod(self) -> int:
        # Megatron uses the end-of-sequence token to end documents.
        return self._special("eos")

    @property
    def bos(self) -> int:
        return self._special("bos")

    @property
    def pad(self) -> int:
        return self._special("pad")

    @property
    def cls(self) -> int:
        return self._special("cls")

    @property
    def sep(self) -> int:
        return self._special("sep")

    @property
    def mask(self) -> int:
        return self._special("mask")

    # ------------------------------------------------------------------ chat data (--sft)
    @property
    def chat_template(self) -> Optional[str]:
        """tokenizer_config.json's ``chat_template`` (a Jinja template string), None without one."""
        template = getattr(self._hf, "chat_template", None) if self._hf is not None else None
        return template if isinstance(template, str) else None

    @property
    def special_tokens_map(self) -> Dict[str, str]:
        """Role -> token string (bos_token, eos_token, ...): the variables a chat template sees."""
        if self._hf is not None:
            return {k: v for k, v in self._hf.special_tokens_map.items() if isinstance(v, str)}
        found = {f"{role}_token": self._inv_vocab[self._special(role)] for role in ("bos", "eos", "pad")
                 if any(t in self._vocab for t in _CANDIDATES[role])}
        return found

    def encode_with_offsets(self, text: str) -> Tuple[List[int], Optional[List[Tuple[int, int]]]]:
        """(ids, character span of each id) of ``text`` as written: no special tokens added
        (a chat template writes its own BOS), as transformers tokenizes a rendered template.
        A slow (Python) transformers tokenizer has no spans: (ids, None)."""
        if self._hf is not None and not getattr(self._hf, "is_fast", False):
            return list(self._hf(text, add_special_tokens=False)["input_ids"]), None
        if self._hf is not None:
            encoded = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
            return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
        encoding = self._backend.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        """Ids of <extra_id_0>, <extra_id_1>, ... ([] when the vocabulary has none)."""
        return list(self._sentinel_ids)
