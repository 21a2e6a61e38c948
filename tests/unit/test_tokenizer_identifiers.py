"""Our tokenizers describe themselves as Megatron-LM's legacy tokenizers do (`unique_identifiers`),
so the dataset index caches, which hash that description, get megatron-core's file names.

Megatron-LM's tokenizers call megatron-core's `MegatronTokenizer.__init__(*paths, **options)` (`MegatronLegacyTokenizer` in 0.16)
(megatron/core/datasets/megatron_tokenizer.py) with per-class arguments (core_v0.13's
megatron/training/tokenizer/tokenizer.py); the reference here is that base class, run live in
megatron-core 0.16.1, for the arguments each class passes. tests/unit/test_blend_megatron_equivalence.py
shows that equal descriptions give equal cache names and arrays.
"""

import json
from argparse import Namespace

import pytest

from megatron.training.tokenizer import build_tokenizer
from tests.helpers.mcore_reference import run_mcore

# --tokenizer-type -> (Megatron's class, the positional paths and the options it passes to the base)
MEGATRON_CALLS = {
    "GPT2BPETokenizer": ("_GPT2BPETokenizer", ["VOCAB_JSON", "MERGES"], {}),
    "BertWordPieceLowerCase": ("_BertWordPieceTokenizer", ["VOCAB_TXT"], {"lower_case": True, "vocab_extra_ids": 3}),
    "BertWordPieceCase": ("_BertWordPieceTokenizer", ["VOCAB_TXT"], {"lower_case": False, "vocab_extra_ids": 3}),
    "NullTokenizer": ("_NullTokenizer", [None], {"vocab_size": 500}),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    vocab = {chr(c): i for i, c in enumerate(range(ord("a"), ord("z") + 1))}
    vocab.update({"ab": 26, "<|endoftext|>": 27})
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\na b\n")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]) + "\n")
    # relative to nothing in particular: Megatron records the paths exactly as given on the command line
    return {"VOCAB_JSON": str(folder / "vocab.json"), "MERGES": str(folder / "merges.txt"),
            "VOCAB_TXT": str(folder / "vocab.txt")}


def _args(tokenizer_type: str, files) -> Namespace:
    return Namespace(tokenizer_type=tokenizer_type, vocab_file=files["VOCAB_TXT"] if "Bert" in tokenizer_type
                     else files["VOCAB_JSON"], merge_file=files["MERGES"], tokenizer_model=None,
                     vocab_size=500, vocab_extra_ids=3, make_vocab_size_divisible_by=128,
                     tensor_model_parallel_size=1, rank=1)


def test_tokenizers_describe_themselves_as_megatron_lm_does(files):
    calls = {name: (cls, [files.get(p, p) for p in paths], options)
             for name, (cls, paths, options) in MEGATRON_CALLS.items()}
    reference = run_mcore(f'''
        from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer as MegatronTokenizer
        stubs = {{name: (lambda self, *a, **k: None) for name in MegatronTokenizer.__abstractmethods__}}
        described = {{}}
        for tokenizer_type, (cls, paths, options) in {calls!r}.items():
            tokenizer = type(cls, (MegatronTokenizer,), dict(stubs))(*paths, **options)
            described[tokenizer_type] = tokenizer.unique_description
        emit(described)
    ''')
    for tokenizer_type in MEGATRON_CALLS:
        ours = build_tokenizer(_args(tokenizer_type, files)).unique_identifiers
        assert json.dumps(ours, indent=4) == reference[tokenizer_type], tokenizer_type


def test_sentencepiece_family_description(files):
    """The SentencePiece types (no small model to build here) follow Megatron's table too."""
    from megatron.training.tokenizer.tokenizer import megatron_unique_identifiers

    args = _args("SentencePieceTokenizer", files)
    args.tokenizer_model = "spm.model"
    assert dict(megatron_unique_identifiers(args)) == {
        "class": "_SentencePieceTokenizer", "tokenizer_path": ["spm.model"], "vocab_extra_ids": "3"}
    for tokenizer_type, cls in (("GPTSentencePieceTokenizer", "_GPTSentencePieceTokenizer"),
                                ("Llama2Tokenizer", "_Llama2Tokenizer")):
        args.tokenizer_type = tokenizer_type
        assert dict(megatron_unique_identifiers(args)) == {
            "class": cls, "tokenizer_path": ["spm.model"], "vocab_extra_ids": "0"}
