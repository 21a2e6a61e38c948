"""BERTMaskedWordPieceDataset: sample layout, masking statistics, whole words, determinism,
Megatron's random streams, and the errors of unusable data.

Most tests use a generated `_text_sentence` dataset with a small WordPiece vocabulary written
here (words with '##' pieces), so they run without ../shared/data; one builds a real one from
the KJV corpus with the real BERT vocabulary and BertWordPieceTokenizer.
"""
import json

import numpy as np
import pytest

from megatron.training.arguments import parse_args
from megatron.training.dataset_configs import bert_dataset_config_from_args
from megatron.data.bert_dataset import (MT19937_64, BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig,
                                        _TargetLengths, build_sample_index)
from megatron.data.bert_masking import _choose_ngram_size
from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from megatron.training.tokenizer.bert_wordpiece import BertWordPieceTokenizer
from tools import preprocess_data

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
NUM_WORDS, NUM_PIECES = 300, 60


def _write_dataset(prefix, documents):
    """documents: lists of sentences (lists of ids) -> prefix.bin/.idx, one sequence per sentence."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for sentences in documents:
        builder.add_document([t for s in sentences for t in s], [len(s) for s in sentences])
    builder.finalize(f"{prefix}.idx")


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """(prefix, tokenizer): 400 documents of 1-8 sentences; a word is a word id plus 0-2 '##' pieces."""
    root = tmp_path_factory.mktemp("bert_generated")
    vocab = SPECIALS + [f"w{i}" for i in range(NUM_WORDS)] + [f"##p{i}" for i in range(NUM_PIECES)]
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertWordPieceTokenizer(str(root / "vocab.txt"))
    rng = np.random.default_rng(0)
    first_word, first_piece = len(SPECIALS), len(SPECIALS) + NUM_WORDS
    documents = []
    for _ in range(400):
        sentences = []
        for _ in range(int(rng.integers(1, 9))):
            sentence = []
            for _ in range(int(rng.integers(3, 12))):
                sentence.append(first_word + int(rng.integers(NUM_WORDS)))
                sentence += (first_piece + rng.integers(NUM_PIECES, size=int(rng.integers(0, 3)))).tolist()
            sentences.append(sentence)
        documents.append(sentences)
    _write_dataset(root / "data_text_sentence", documents)
    return str(root / "data_text_sentence"), tokenizer


def _config(tokenizer, prefix, seq_length=64, **changes):
    fields = dict(random_seed=1234, sequence_length=seq_length, blend=([prefix], None), split="1,0,0",
                  tokenizer=tokenizer, masking_do_full_word=False, masking_max_ngram=1, classification_head=True)
    fields.update(changes)
    return BERTMaskedWordPieceDatasetConfig(**fields)


def _dataset(tokenizer, prefix, num_samples=None, seq_length=64, **changes):
    config = _config(tokenizer, prefix, seq_length, **changes)
    train, _, _ = BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, [num_samples, 0, 0], None,
                                                config).build()
    return train


def _stack(dataset, count):
    samples = [dataset[i] for i in range(count)]
    return {key: np.stack([np.asarray(s[key]) for s in samples]) for key in samples[0]}


def _check_layout(batch, tokenizer, binary_head):
    """[CLS] A [SEP] (B [SEP]) then padding; types 0 then 1 on B [SEP]; masks and labels agree."""
    cls, sep, pad = tokenizer.cls, tokenizer.sep, tokenizer.pad
    for key, value in batch.items():
        assert value.dtype == np.int64, key
    for row in range(batch["text"].shape[0]):
        n = int(batch["padding_mask"][row].sum())
        assert np.all(batch["padding_mask"][row, :n] == 1) and np.all(batch["padding_mask"][row, n:] == 0)
        labels, text = batch["labels"][row], batch["text"][row]
        original = np.where(labels >= 0, labels, text)  # the unmasked sample
        assert original[0] == cls and original[n - 1] == sep and np.all(text[n:] == pad)
        seps = np.flatnonzero(original[:n] == sep)
        assert len(seps) == (2 if binary_head else 1)
        assert not np.any(original[1:n] == cls)
        types = batch["types"][row]
        assert np.all(types[:seps[0] + 1] == 0) and np.all(types[seps[0] + 1:n] == 1) and np.all(types[n:] == 0)
        assert np.array_equal(batch["loss_mask"][row], (labels >= 0).astype(np.int64))
        assert not np.any(np.isin(original[np.flatnonzero(labels >= 0)], [cls, sep]))  # specials never masked


def test_layout_and_lengths_with_the_binary_head(generated):
    prefix, tokenizer = generated
    for seq_length in (16, 64):
        dataset = _dataset(tokenizer, prefix, seq_length=seq_length)
        batch = _stack(dataset, min(len(dataset), 400))
        assert batch["text"].shape[1] == seq_length  # never longer: every sample is padded to it
        _check_layout(batch, tokenizer, binary_head=True)
        if seq_length == 16:
            assert batch["truncated"].mean() > 0.5  # most pairs had to be cut
        lengths = batch["padding_mask"].sum(1)
        targets = np.asarray(dataset.sample_index[:len(lengths), 2], dtype=np.int64)
        assert np.all(lengths <= targets + 3)  # A + B cut to the sample's (maybe short) target length
        assert lengths.max() == seq_length and lengths.min() >= 5 and (targets < seq_length - 3).any()


def test_without_the_binary_head_one_segment_and_never_random(generated):
    prefix, tokenizer = generated
    dataset = _dataset(tokenizer, prefix, classification_head=False)
    batch = _stack(dataset, 300)
    _check_layout(batch, tokenizer, binary_head=False)
    assert batch["is_random"].sum() == 0 and batch["types"].sum() == 0


def test_masking_statistics_over_10000_samples(generated):
    prefix, tokenizer = generated
    dataset = _dataset(tokenizer, prefix, num_samples=10_000)
    assert len(dataset) >= 10_000
    batch = _stack(dataset, 10_000)
    masked = batch["loss_mask"] == 1
    non_special = batch["padding_mask"].sum() - 3 * len(masked)  # [CLS] and two [SEP] per sample
    assert abs(masked.sum() / non_special - 0.15) < 0.01
    text, labels = batch["text"][masked], batch["labels"][masked]
    assert masked.sum() > 50_000
    as_mask = np.mean(text == tokenizer.mask)
    kept = np.mean(text == labels)
    assert abs(as_mask - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and abs(1 - as_mask - kept - 0.1) < 0.01
    assert abs(batch["is_random"].mean() - 0.5) < 0.02
    assert 0 < batch["truncated"].mean() < 1


def _words(tokens, is_continuation, specials):
    """Position lists of the words of a sample: a piece and the '##' pieces after it (a leading
    '##' piece of a segment is a word of its own)."""
    words = []
    for position, token in enumerate(tokens):
        if token in specials:
            words.append(None)
        elif is_continuation(token) and words and words[-1] is not None:
            words[-1].append(position)
        else:
            words.append([position])
    return [w for w in words if w is not None]


def test_whole_word_masking_masks_whole_words(generated):
    prefix, tokenizer = generated
    dataset = _dataset(tokenizer, prefix, num_samples=500, masking_do_full_word=True, masking_max_ngram=3)
    batch = _stack(dataset, 500)
    _check_layout(batch, tokenizer, binary_head=True)
    is_continuation = lambda token: tokenizer.inv_vocab[int(token)].startswith("##")
    partial = multi_piece = 0
    for row in range(500):
        original = np.where(batch["labels"][row] >= 0, batch["labels"][row], batch["text"][row])
        n = int(batch["padding_mask"][row].sum())
        for word in _words(original[:n].tolist(), is_continuation, {tokenizer.cls, tokenizer.sep}):
            chosen = batch["loss_mask"][row, word]
            partial += int(0 < chosen.sum() < len(word))
            multi_piece += int(len(word) > 1 and chosen.all())
    assert partial == 0 and multi_piece > 100
    masked = batch["loss_mask"].sum() / (batch["padding_mask"].sum() - 3 * 500)
    assert 0.12 < masked <= 0.17  # whole words and N-grams fill the count less exactly


def test_same_seed_same_samples_other_seed_others(generated, tmp_path):
    prefix, tokenizer = generated
    first = _stack(_dataset(tokenizer, prefix), 50)
    again = _stack(_dataset(tokenizer, prefix, path_to_cache=str(tmp_path)), 50)  # built anew, not loaded
    other = _stack(_dataset(tokenizer, prefix, random_seed=4321), 50)
    for key in first:
        assert np.array_equal(first[key], again[key]), key
    assert not np.array_equal(first["text"], other["text"])
    cached = list(tmp_path.glob("*-BERTMaskedWordPieceDataset-train-sample_index.npy"))
    assert len(cached) == 1 and json.loads(next(tmp_path.glob("*description.txt")).read_text())["classification_head"]


def test_sentence_split_is_by_document_and_samples_stay_in_documents(generated):
    prefix, tokenizer = generated
    config = _config(tokenizer, prefix, split="80,20,0")
    train, valid, _ = BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, [None, None, 0], None,
                                                    config).build()
    data = IndexedDataset(prefix)
    documents = data.document_indices
    bounds = {"train": (0, documents[320]), "valid": (documents[320], documents[400])}
    for dataset in (train, valid):
        rows = np.asarray(dataset.sample_index, dtype=np.int64)
        low, high = bounds[dataset.index_split.name]
        assert rows[:, 0].min() >= low and rows[:, 1].max() <= high
        doc_of_first = np.searchsorted(documents, rows[:, 0], side="right")
        doc_of_last = np.searchsorted(documents, rows[:, 1] - 1, side="right")
        assert np.array_equal(doc_of_first, doc_of_last)  # one document per sample
        assert np.all(rows[:, 1] - rows[:, 0] >= 2)


def test_megatron_random_streams():
    """std::mt19937 / std::mt19937_64 give these 10,000th outputs for the default seed 5489 (the
    C++ standard's check values); legacy RandomState.choice equals the shortcut draw."""
    assert MT19937_64(5489).outputs(10_000)[-1] == 9981545732273789042
    assert _TargetLengths(5489, 1.0, 10).generator.random_raw(10_000)[-1] == 4123659995
    p = 1.0 / np.arange(1, 4)
    p /= p.sum()
    cdf = (np.cumsum(p) / np.cumsum(p)[-1]).tolist()
    a, b = np.random.RandomState(7), np.random.RandomState(7)
    assert [int(a.choice(np.arange(1, 4), p=p)) for _ in range(2000)] == [_choose_ngram_size(b, cdf)
                                                                           for _ in range(2000)]


def test_sample_index_rules():
    """A 5-sentence document with target 4 and no short samples: [0, 2) [2, 5) (one sentence may
    not be left alone); a document with a sentence over 512 tokens is skipped."""
    lengths = np.array([3, 3, 3, 3, 3, 600, 3], dtype=np.int32)
    rows = build_sample_index(np.array([0, 5]), np.array([5, 7]), lengths, None, 4, 0.0, 1, 2)
    assert sorted(map(tuple, rows.tolist())) == [(0, 2, 4), (2, 5, 4)]
    more = build_sample_index(np.array([0]), np.array([5]), lengths, 5, 4, 0.0, 1, 2)
    assert len(more) == 6  # whole epochs until there are enough


def test_config_from_megatron_flags(generated):
    prefix, tokenizer = generated
    args = parse_args(argv=["--data-path", prefix, "--split", "1,0,0", "--seq-length", "32", "--seed", "7",
                            "--mask-prob", "0.2", "--bert-no-binary-head"])
    config = bert_dataset_config_from_args(args, tokenizer)
    assert (config.masking_probability, config.short_sequence_probability, config.classification_head) == (0.2, 0.1,
                                                                                                          False)
    assert (config.sequence_length, config.random_seed, config.masking_do_full_word) == (32, 7, True)
    defaults = bert_dataset_config_from_args(parse_args(argv=["--data-path", prefix, "--split", "1,0,0",
                                                              "--seq-length", "32"]), tokenizer)
    assert defaults.classification_head and defaults.masking_probability == 0.15


def test_unsplit_data_and_tiny_sequences_are_clear_errors(generated, tmp_path):
    prefix, tokenizer = generated
    documents = [[list(range(5, 5 + int(n)))] for n in np.random.default_rng(1).integers(20, 60, size=50)]
    _write_dataset(tmp_path / "doc_text_document", documents)
    with pytest.raises(IndexedDatasetError, match="--split-sentences"):
        _dataset(tokenizer, str(tmp_path / "doc_text_document"), path_to_cache=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="--seq-length 4 is too small"):
        _config(tokenizer, prefix, seq_length=4)
    with pytest.raises(ValueError, match="WordPiece tokenizer"):
        _config(object(), prefix)


def _preprocess(corpus_path, bert_vocab_file, tmp_path, split_sentences):
    """tools/preprocess_data.py on the first 20 KJV chapters; the output prefix."""
    lines = open(corpus_path, encoding="utf-8").readlines()[:20]
    (tmp_path / "kjv.jsonl").write_text("".join(lines), encoding="utf-8")
    argv = ["--input", str(tmp_path / "kjv.jsonl"), "--output-prefix", str(tmp_path / "kjv"),
            "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(bert_vocab_file), "--workers", "1"]
    preprocess_data.main(argv + (["--split-sentences"] if split_sentences else []))
    return str(tmp_path / ("kjv_text_sentence" if split_sentences else "kjv_text_document"))


def test_real_corpus_with_the_bert_vocab(corpus_path, bert_vocab_file, nltk_data_dir, tmp_path):
    """KJV chapters through tools/preprocess_data.py --split-sentences (NLTK punkt, the real BERT
    vocab): layout, lengths and whole-word masking hold on real WordPiece data; the same chapters
    preprocessed without --split-sentences are refused with the flag named."""
    tokenizer = BertWordPieceTokenizer(str(bert_vocab_file))
    prefix = _preprocess(corpus_path, bert_vocab_file, tmp_path, split_sentences=True)
    dataset = _dataset(tokenizer, prefix, seq_length=128, masking_do_full_word=True, masking_max_ngram=3)
    batch = _stack(dataset, min(len(dataset), 200))
    _check_layout(batch, tokenizer, binary_head=True)
    is_continuation = lambda token: tokenizer.inv_vocab[int(token)].startswith("##")
    for row in range(batch["text"].shape[0]):
        original = np.where(batch["labels"][row] >= 0, batch["labels"][row], batch["text"][row])
        n = int(batch["padding_mask"][row].sum())
        for word in _words(original[:n].tolist(), is_continuation, {tokenizer.cls, tokenizer.sep}):
            assert batch["loss_mask"][row, word].sum() in (0, len(word))
    assert batch["truncated"].any() and (batch["padding_mask"].sum(1) < 128).any()
    unsplit = _preprocess(corpus_path, bert_vocab_file, tmp_path, split_sentences=False)
    with pytest.raises(IndexedDatasetError, match="--split-sentences"):
        _dataset(tokenizer, unsplit)
