"""Megatron-LM's detokenizers for zero-shot evaluation, chosen by the data file's path.

WikiText-103's files are word-level with spaces around punctuation (" @-@ ", " , ", "( x )");
wikitext_detokenizer undoes that before the sub-word tokenizer sees the text, so the model reads
ordinary prose. The rules and their order are Megatron's (tasks/zeroshot_gpt/detokenizer.py).
"""

from __future__ import annotations

import re
from typing import Callable, Optional


def ptb_detokenizer(string: str) -> str:
    string = string.replace(" '", "'")
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" n't", "n't")
    string = string.replace(" N ", "1 ")
    string = string.replace("$ 1", "$1")
    string = string.replace("# 1", "#1")
    return string


def wikitext_detokenizer(string: str) -> str:
    # contractions
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)  # as in Megatron (a pattern that rarely matches)
    # number separators
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    # punctuation
    for mark in (":", ";", ".", "!", "?", ","):
        string = string.replace(f" {mark} ", f"{mark} ")
    # double brackets
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    # miscellaneous
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" N ", " 1 ")
    string = string.replace(" 's", "'s")
    return string


def lambada_detokenizer(string: str) -> str:
    return string


# Tried in this order against the path, as Megatron does: the first key the path contains wins.
_DETOKENIZERS = {
    "ptb": ptb_detokenizer,
    "wiki": wikitext_detokenizer,
    "lambada": lambada_detokenizer,
}


def get_detokenizer(path: str) -> Optional[Callable[[str], str]]:
    """The detokenizer whose key the path contains ("ptb", "wiki", "lambada"), or None."""
    for key, detokenizer in _DETOKENIZERS.items():
        if key in path:
            return detokenizer
    return None
