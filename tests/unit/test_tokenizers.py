"""megatron.training.tokenizer against the reference libraries, on the real vocabularies and corpus."""
import argparse
import json
import sys

import pytest

from megatron.training.tokenizer import (
    MegatronTokenizer,
    TokenizerConfigError,
    UnsupportedSpecialToken,
    add_tokenizer_args,
    build_tokenizer,
    vocab_size_with_padding,
)
from megatron.training.tokenizer.bert_wordpiece import BertWordPieceTokenizer
from megatron.training.tokenizer.gpt2_bpe import GPT2BPETokenizer, bytes_to_unicode
from megatron.training.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer

GPT2_STRINGS = [
    "Hello world",
    "  leading and trailing spaces   ",
    "multiple    spaces\tand\ttabs\n\nnewlines\r\n",
    "I'm sure they'll say it's what we'd've done; DON'T you're",
    "naïve café, Ångström — “quotes” … ¿qué?",
    "emoji 😀👍🏽 and flags 🇺🇸, CJK 我爱北京 日本語",
    "numbers 3.14159 1,000,000 and 12345678901234567890",
    "code: def f(x):\n    return x**2  # comment\n",
    "\u00a0nbsp\u2003em space\u200bzero-width",
    "",
]
BERT_STRINGS = [
    "Café Déjà vu, naïve façade — ÅNGSTRÖM!",
    "我爱北京天安门 and 日本語のテキスト 한국어",
    "a\x00b\x07c\u200bd\tend\r\nnext\x0bline\x1fx\ufffdy",
    "Hello, world! (test) [x] {y} a-b_c$d^e`f~g @#%&*+=|\\/<>?;:'\"",
    "«quoted» – dash… ¿qué? ¡sí! “curly” ‘single’",
    "a" * 150 + " ok " + "b" * 100,
    "unaffable Unbelievable antidisestablishmentarianism",
    "non\u00a0breaking\u2003em\u3000ideo space x\u2028y\u2029z\x85w",
    "emoji 😀👍🏽 and ☃ ✓, e\u0301cole decomposed, İstanbul ß ﬁ Ⅻ ½",
    "  \n\t  ",
]


def make_args(**kwargs) -> argparse.Namespace:
    """A namespace as add_tokenizer_args would give, overridden by kwargs."""
    args = add_tokenizer_args(argparse.ArgumentParser()).parse_args([])
    for key, value in kwargs.items():
        setattr(args, key, value)
    return args


@pytest.fixture(scope="module")
def corpus_docs(corpus_path):
    with open(corpus_path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="module")
def gpt2(gpt2_vocab_dir):
    return build_tokenizer(make_args(tokenizer_type="GPT2BPETokenizer", rank=1,
                                     vocab_file=str(gpt2_vocab_dir / "vocab.json"),
                                     merge_file=str(gpt2_vocab_dir / "merges.txt")))


@pytest.fixture(scope="module")
def hf_gpt2(gpt2_vocab_dir):
    from transformers import GPT2TokenizerFast

    return GPT2TokenizerFast.from_pretrained(str(gpt2_vocab_dir), local_files_only=True)


@pytest.fixture(scope="module")
def bert_lower(bert_vocab_file):
    return build_tokenizer(make_args(tokenizer_type="BertWordPieceLowerCase", rank=1,
                                     vocab_file=str(bert_vocab_file)))


# --- GPT-2 BPE ----------------------------------------------------------------------------
def test_gpt2_whole_corpus_matches_hf_and_round_trips(gpt2, hf_gpt2, corpus_docs):
    ours = [gpt2.tokenize(doc) for doc in corpus_docs]
    reference = hf_gpt2(corpus_docs)["input_ids"]
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert a == b, f"document {i} differs"
    for i, (doc, ids) in enumerate(zip(corpus_docs, ours)):
        assert gpt2.detokenize(ids) == doc, f"document {i} does not round-trip"


@pytest.mark.parametrize("text", GPT2_STRINGS)
def test_gpt2_hand_strings(gpt2, hf_gpt2, text):
    ids = gpt2.tokenize(text)
    assert ids == hf_gpt2(text)["input_ids"]
    assert gpt2.detokenize(ids) == text


def test_gpt2_vocab_and_specials(gpt2):
    assert gpt2.vocab_size == 50257
    assert gpt2.eod == 50256 == gpt2.vocab["<|endoftext|>"]
    assert gpt2.inv_vocab[15496] == "Hello"
    assert gpt2.tokenize("Hello world") == [15496, 995]
    # As in Megatron, the end-of-text string in raw text is ordinary text, not the eod id.
    ids = gpt2.tokenize("a<|endoftext|>b")
    assert gpt2.eod not in ids and gpt2.detokenize(ids) == "a<|endoftext|>b"
    # A multi-byte character cut in half decodes to U+FFFD instead of failing.
    assert gpt2.detokenize(gpt2.tokenize("😀")[:1]) == "\ufffd"
    for missing in ("cls", "sep", "mask", "pad"):
        with pytest.raises(UnsupportedSpecialToken, match="GPT2 BPE tokenizer has no"):
            getattr(gpt2, missing)
    assert getattr(gpt2, "cls", None) is None  # an AttributeError, so getattr defaults work
    with pytest.raises(NotImplementedError):
        gpt2.mask
    assert gpt2.additional_special_tokens_ids == []


def test_bytes_to_unicode_is_a_printable_bijection():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert not any(c.isspace() for c in table.values())
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


def test_gpt2_merges_without_version_header(tmp_path):
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    vocab.update({"ab": 256, "Ġab": 257, "<|endoftext|>": 258})
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    for name, merges in (("m1.txt", "a b\nĠ ab\n"), ("m2.txt", "#version: 0.2\na b\nĠ ab\n")):
        (tmp_path / name).write_text(merges, encoding="utf-8")
        tok = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / name))
        assert tok.tokenize("ab ab abc") == [256, 257, 257, vocab["c"]]
        assert tok.eod == 258


# --- BERT WordPiece -----------------------------------------------------------------------
def test_bert_whole_corpus_matches_hf(bert_lower, bert_vocab_file, corpus_docs):
    from transformers import BertTokenizer

    ours = [bert_lower.tokenize(doc) for doc in corpus_docs]
    hf = BertTokenizer(vocab=str(bert_vocab_file), do_lower_case=True)
    reference = hf(corpus_docs, add_special_tokens=False)["input_ids"]
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert a == b, f"document {i} differs"


@pytest.mark.parametrize("lower_case", [True, False])
def test_bert_hand_strings_match_both_hf_tokenizers(bert_vocab_file, lower_case):
    from transformers import BertTokenizer, BertTokenizerLegacy

    ours = BertWordPieceTokenizer(str(bert_vocab_file), lower_case=lower_case)
    fast = BertTokenizer(vocab=str(bert_vocab_file), do_lower_case=lower_case)
    slow = BertTokenizerLegacy(vocab_file=str(bert_vocab_file), do_lower_case=lower_case)
    for text in BERT_STRINGS:
        ids = ours.tokenize(text)
        assert ids == fast(text, add_special_tokens=False)["input_ids"], repr(text)
        assert ids == slow(text, add_special_tokens=False)["input_ids"], repr(text)


def test_bert_basic_rules(bert_lower):
    assert bert_lower.text_to_tokens("Héllo, WORLD!") == ["hello", ",", "world", "!"]
    assert bert_lower.text_to_tokens("unaffable") == ["una", "##ffa", "##ble"]
    assert bert_lower.text_to_tokens("ab北京cd") == ["ab", "北", "京", "cd"]
    assert bert_lower.text_to_tokens("a" * 101) == ["[UNK]"]
    assert bert_lower.text_to_tokens("a\x00b") == ["ab"]


def test_bert_specials_and_decoding(bert_vocab_file):
    tok = build_tokenizer(make_args(tokenizer_type="BertWordPieceLowerCase", rank=1,
                                    vocab_file=str(bert_vocab_file), vocab_extra_ids=3))
    assert (tok.pad, tok.cls, tok.sep, tok.mask) == (0, 101, 102, 103)
    assert tok.eod == tok.sep
    # [BOS]/[EOS] and then the T5 sentinels are appended after the 30522 real tokens.
    assert (tok.bos, tok.eos) == (30522, 30523)
    assert tok.additional_special_tokens_ids == [30524, 30525, 30526]
    assert tok.inv_vocab[30526] == "<extra_id_2>" and tok.vocab_size == 30527
    ids = tok.tokenize("Hello unaffable world")
    assert ids == [7592, 14477, 20961, 3468, 2088]
    assert tok.detokenize(ids) == tok.decode(ids) == "hello unaffable world"
    assert tok.decode_token_ids([tok.cls] + ids + [tok.pad]) == " hello unaffable world"


# --- SentencePiece ------------------------------------------------------------------------
def test_sentencepiece_whole_corpus_matches_library(sentencepiece_model, corpus_docs):
    import sentencepiece

    tok = build_tokenizer(make_args(tokenizer_type="SentencePieceTokenizer", rank=1,
                                    tokenizer_model=str(sentencepiece_model)))
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    ours = [tok.tokenize(doc) for doc in corpus_docs]
    assert ours == reference.encode(corpus_docs)


def test_sentencepiece_special_tokens(sentencepiece_model):
    tok = build_tokenizer(make_args(tokenizer_type="SentencePieceTokenizer", rank=1,
                                    tokenizer_model=str(sentencepiece_model), vocab_extra_ids=2))
    # The model has bos '<s>' (1) and eos '</s>' (2) but no pad; the rest come after 32000.
    assert (tok.cls, tok.sep, tok.eod, tok.mask, tok.pad) == (32000, 32001, 32002, 32003, 32004)
    assert (tok.bos, tok.eos) == (1, 2)
    assert tok.additional_special_tokens_ids == [32005, 32006] and tok.vocab_size == 32007
    assert tok.inv_vocab[32004] == "<PAD>"
    ids = tok.tokenize("Hello<SEP>world</s><extra_id_1>")
    plain = tok.tokenizer.encode_as_ids
    assert ids == plain("Hello") + [32001] + plain("world") + [2, 32006]
    # Megatron's format: each special token is preceded by the decoded run before it (even
    # an empty one) and a space, and followed by a space.
    assert tok.detokenize(ids) == "Hello <SEP> world </s>  <extra_id_1> "


def test_gpt_sentencepiece_and_llama2(sentencepiece_model):
    gpt = build_tokenizer(make_args(tokenizer_type="GPTSentencePieceTokenizer", rank=1,
                                    tokenizer_model=str(sentencepiece_model)))
    llama = build_tokenizer(make_args(tokenizer_type="Llama2Tokenizer", rank=1,
                                      tokenizer_model=str(sentencepiece_model)))
    for tok in (gpt, llama):
        assert tok.vocab_size == 32000 and (tok.bos, tok.eos, tok.eod) == (1, 2, 2)
        with pytest.raises(UnsupportedSpecialToken, match="no PAD"):
            tok.pad
        with pytest.raises(UnsupportedSpecialToken, match="no CLS"):
            tok.cls
    ids = gpt.tokenize("Hello world")
    assert ids == gpt.tokenizer.encode_as_ids("Hello world") and gpt.detokenize(ids) == "Hello world"
    assert llama.tokenize("Hello world") == [1] + ids
    assert llama.tokenize("Hello world", bos=False, eos=True) == ids + [2]


# --- build_tokenizer, padding, arguments, errors ------------------------------------------
def test_padding_values_and_log_line(gpt2_vocab_dir, capsys):
    args = make_args(tokenizer_type="GPT2BPETokenizer", vocab_file=str(gpt2_vocab_dir / "vocab.json"),
                     merge_file=str(gpt2_vocab_dir / "merges.txt"))
    build_tokenizer(args)
    assert args.padded_vocab_size == 50304
    out = capsys.readouterr().out
    assert out == ("> building GPT2BPETokenizer tokenizer ...\n"
                   " > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)\n")
    tp2 = make_args(tensor_model_parallel_size=2)
    assert vocab_size_with_padding(50257, tp2) == 50432
    assert capsys.readouterr().out == " > padded vocab (size: 50257) with 175 dummy tokens (new size: 50432)\n"
    assert vocab_size_with_padding(256, make_args(rank=3)) == 256
    assert vocab_size_with_padding(1, make_args(make_vocab_size_divisible_by=1)) == 1
    assert capsys.readouterr().out == " > padded vocab (size: 1) with 0 dummy tokens (new size: 1)\n"
    preset = make_args(tokenizer_type="NullTokenizer", vocab_size=10, padded_vocab_size=512, rank=1)
    build_tokenizer(preset)
    assert preset.padded_vocab_size == 512  # a value from a checkpoint is kept


def test_add_tokenizer_args_defaults_and_group():
    parser = add_tokenizer_args(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert (args.tokenizer_type, args.vocab_file, args.merge_file, args.vocab_size) == (None,) * 4
    assert (args.vocab_extra_ids, args.tokenizer_model, args.make_vocab_size_divisible_by) == (0, None, 128)
    assert not hasattr(args, "tensor_model_parallel_size") and not hasattr(args, "rank")
    assert "tokenizer" in [g.title for g in parser._action_groups]
    with pytest.raises(SystemExit):
        parser.parse_args(["--tokenizer-type", "NoSuchTokenizer"])


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(tokenizer_type="GPT2BPETokenizer", merge_file="m.txt"), TokenizerConfigError, ["--vocab-file"]),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="VOCAB"), TokenizerConfigError, ["--merge-file"]),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/no/vocab.json", merge_file="/no/m.txt"),
     FileNotFoundError, ["--vocab-file", "/no/vocab.json"]),
    (dict(tokenizer_type="BertWordPieceCase"), TokenizerConfigError, ["--vocab-file"]),
    (dict(tokenizer_type="BertWordPieceLowerCase", vocab_file="/no/vocab.txt"), FileNotFoundError,
     ["--vocab-file", "/no/vocab.txt"]),
    (dict(tokenizer_type="SentencePieceTokenizer"), TokenizerConfigError, ["--tokenizer-model"]),
    (dict(tokenizer_type="Llama2Tokenizer", tokenizer_model="/no/t.model"), FileNotFoundError,
     ["--tokenizer-model", "/no/t.model"]),
    (dict(tokenizer_type="HuggingFaceTokenizer"), TokenizerConfigError, ["--tokenizer-model"]),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/no/dir"), FileNotFoundError,
     ["--tokenizer-model", "/no/dir"]),
    (dict(tokenizer_type="NullTokenizer"), TokenizerConfigError, ["--vocab-size"]),
    (dict(tokenizer_type="Nope"), TokenizerConfigError, ["--tokenizer-type", "Nope"]),
    (dict(tokenizer_type=None), TokenizerConfigError, ["--tokenizer-type"]),
])
def test_errors_name_the_flag_and_path(tmp_path, kwargs, error, words):
    kwargs = {k: (str(tmp_path / v) if v in ("m.txt", "VOCAB") else v) for k, v in kwargs.items()}
    if "VOCAB" in kwargs.get("vocab_file", ""):
        open(kwargs["vocab_file"], "w").close()
    with pytest.raises(error) as info:
        build_tokenizer(make_args(rank=1, **kwargs))
    assert isinstance(info.value, (ValueError, FileNotFoundError))
    for word in words:
        assert word in str(info.value)


def test_null_tokenizer():
    args = make_args(tokenizer_type="NullTokenizer", vocab_size=1000, rank=1)
    tok = build_tokenizer(args)
    assert tok.vocab_size == 1001 and tok.eod == 1000 and args.padded_vocab_size == 1024
    assert tok.tokenize("3 1  4\n1") == [3, 1, 4, 1]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(UnsupportedSpecialToken):
        tok.bos


def test_abstract_base_cannot_be_instantiated():
    with pytest.raises(TypeError):
        MegatronTokenizer("x")


# --- HuggingFace --------------------------------------------------------------------------
def test_huggingface_tokenizer_json_and_folder(tmp_path, hf_gpt2, gpt2, monkeypatch):
    hf_gpt2.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    hf_gpt2.save_pretrained(str(tmp_path / "saved"))
    text = GPT2_STRINGS[3] + GPT2_STRINGS[5]
    from_file = build_tokenizer(make_args(tokenizer_type="HuggingFaceTokenizer", rank=1,
                                          tokenizer_model=str(tmp_path / "tokenizer.json")))
    from_dir = build_tokenizer(make_args(tokenizer_type="HuggingFaceTokenizer", rank=1,
                                         tokenizer_model=str(tmp_path / "saved")))
    assert from_file._backend is not None and from_dir._hf is not None
    for tok in (from_file, from_dir):
        assert tok.vocab_size == 50257 and tok.eod == tok.eos == 50256
        assert tok.tokenize(text) == gpt2.tokenize(text)
        assert tok.detokenize(tok.tokenize(text)) == text
        assert tok.inv_vocab[15496] == "Hello"
    # Without transformers a folder is read through tokenizers from its tokenizer.json.
    import megatron.training.tokenizer.huggingface_tokenizer as module

    monkeypatch.setattr(module, "_import_transformers", lambda: None)
    no_transformers = HuggingFaceTokenizer(str(tmp_path / "saved"))
    assert no_transformers._backend is not None and no_transformers.tokenize(text) == gpt2.tokenize(text)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HuggingFaceTokenizer(str(tmp_path / "empty"))


def test_huggingface_missing_library_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}", encoding="utf-8")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match=r"pip install -e \.\[huggingface\]"):
        HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))


def _t5_like_tokenizer(sentinels: int):
    """A tiny word-level tokenizers model whose <extra_id_i> come after the words counting down, as
    in HF's T5 vocabulary (<extra_id_0> the last id); a look-alike that is no sentinel before them."""
    tokenizers = pytest.importorskip("tokenizers")
    words = {"<pad>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<extra_id_x>"] + [f"<extra_id_{i}>" for i in reversed(range(sentinels))])
    return tok


def test_huggingface_sentinels_in_order_of_their_number(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = _t5_like_tokenizer(12)
    tok.save(str(tmp_path / "tokenizer.json"))
    extras = [f"<extra_id_{i}>" for i in reversed(range(12))]
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                                                unk_token="<unk>", additional_special_tokens=extras)
    fast.save_pretrained(str(tmp_path / "saved"))
    expected = [17 - i for i in range(12)]  # <extra_id_0> = 17 (the last id) ... <extra_id_11> = 6
    for path in (tmp_path / "tokenizer.json", tmp_path / "saved"):
        ours = HuggingFaceTokenizer(str(path))
        assert ours.additional_special_tokens_ids == expected, path
        assert [ours.inv_vocab[i] for i in ours.additional_special_tokens_ids[:3]] == \
            ["<extra_id_0>", "<extra_id_1>", "<extra_id_2>"]
        assert ours.tokenize("hello <extra_id_0> world")[:3] == [3, 17, 4]
    _t5_like_tokenizer(0).save(str(tmp_path / "none.json"))
    assert HuggingFaceTokenizer(str(tmp_path / "none.json")).additional_special_tokens_ids == []
