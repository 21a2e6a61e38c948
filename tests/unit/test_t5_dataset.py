"""T5MaskedWordPieceDataset: span corruption on real data (the KJV corpus through
tools/preprocess_data.py --split-sentences, the real BERT vocabulary with 100 sentinels).

Statistics over all samples: the masked fraction of the text and the mean span length against
their settings; every sample: the layout (sentinels in order, one per span, the decoder input the
labels shifted right), the text given back by filling the sentinels, the lengths; determinism per
seed; the one-line errors."""
import argparse

import numpy as np
import pytest

from megatron.training.arguments import parse_args
from megatron.training.dataset_configs import t5_dataset_config_from_args
from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
from megatron.data.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from megatron.training.tokenizer.bert_wordpiece import BertWordPieceTokenizer
from tools import preprocess_data

NUM_SAMPLES = 400
KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "truncated", "enc_mask", "dec_mask")


@pytest.fixture(scope="module")
def kjv(corpus_path, bert_vocab_file, nltk_data_dir, tmp_path_factory):
    """(prefix, tokenizer): the first 40 KJV chapters, one sequence per sentence."""
    root = tmp_path_factory.mktemp("t5_kjv")
    lines = open(corpus_path, encoding="utf-8").readlines()[:40]
    (root / "kjv.jsonl").write_text("".join(lines), encoding="utf-8")
    preprocess_data.main(["--input", str(root / "kjv.jsonl"), "--output-prefix", str(root / "kjv"),
                          "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(bert_vocab_file),
                          "--split-sentences", "--workers", "1"])
    return str(root / "kjv_text_sentence"), BertWordPieceTokenizer(str(bert_vocab_file), vocab_extra_ids=100)


def _config(tokenizer, prefix, encoder=512, decoder=128, **changes):
    fields = dict(random_seed=1234, sequence_length=encoder, sequence_length_decoder=decoder, blend=([prefix], None),
                  split="1,0,0", tokenizer=tokenizer)
    fields.update(changes)
    return T5MaskedWordPieceDatasetConfig(**fields)


def _dataset(tokenizer, prefix, num_samples=NUM_SAMPLES, **changes):
    train, _, _ = BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, [num_samples, 0, 0], None,
                                                _config(tokenizer, prefix, **changes)).build()
    return train


def _spans(sample, sentinels):
    """The spans of one sample, read from its labels: [(sentinel, span tokens), ...]."""
    labels = sample["labels"][sample["loss_mask"] == 1].tolist()
    assert labels[-1] != -1
    starts = [i for i, token in enumerate(labels) if token in sentinels] + [len(labels) - 1]
    return [(labels[a], labels[a + 1:b]) for a, b in zip(starts[:-1], starts[1:])]


def _statistics(dataset, tokenizer):
    sentinels = set(tokenizer.additional_special_tokens_ids)
    masked = text = 0
    lengths = []
    for i in range(len(dataset)):
        sample = dataset[i]
        spans = _spans(sample, sentinels)
        span_tokens = sum(len(tokens) for _, tokens in spans)
        masked += span_tokens
        text += int(sample["enc_mask"].sum()) - len(spans) + span_tokens  # the cut text, before corruption
        lengths += [len(tokens) for _, tokens in spans]
    return masked / text, float(np.mean(lengths))


def _clipped_geometric_mean(p, clip):
    """E[min(N, clip)], N ~ Geometric(p) on 1, 2, ...: the drawn span length in words."""
    return (1 - (1 - p) ** clip) / p


@pytest.mark.parametrize("geometric_p", [0.2, 1 / 3], ids=["megatron", "mean3"])
def test_noise_density_and_mean_span_length(kjv, geometric_p):
    """Megatron's settings (p = 0.2, N-grams clipped at 10 whole words; mean 4.46) and p = 1/3
    (T5's mean span length 3, 2.95 clipped): the masked fraction is --mask-prob, and the mean
    span in WordPiece tokens the clipped geometric mean, each within 5%."""
    prefix, tokenizer = kjv
    dataset = _dataset(tokenizer, prefix, masking_geometric_p=geometric_p)
    density, mean_span = _statistics(dataset, tokenizer)
    expected_span = _clipped_geometric_mean(geometric_p, 10)
    print(f"p={geometric_p:.3f}: noise density {density:.4f} (0.15), mean span {mean_span:.3f} ({expected_span:.3f})")
    assert abs(density - 0.15) < 0.05 * 0.15
    assert abs(mean_span - expected_span) < 0.05 * expected_span


def test_layout_sentinels_and_the_text_given_back(kjv):
    prefix, tokenizer = kjv
    dataset = _dataset(tokenizer, prefix)
    sentinel_ids = tokenizer.additional_special_tokens_ids
    sentinels = set(sentinel_ids)
    truncated = 0
    for i in range(len(dataset)):
        sample = dataset[i]
        assert set(sample) == set(KEYS)
        for key in KEYS:
            assert np.asarray(sample[key]).dtype == np.int64, key
        assert sample["text_enc"].shape == (512,) and sample["text_dec"].shape == (128,)
        assert sample["labels"].shape == sample["loss_mask"].shape == sample["dec_mask"].shape == (128,)
        n_enc, n_dec = int(sample["enc_mask"].sum()), int(sample["dec_mask"].sum())
        assert (sample["enc_mask"][:n_enc] == 1).all() and (sample["text_enc"][n_enc:] == tokenizer.pad).all()
        assert (sample["dec_mask"][:n_dec] == 1).all() and (sample["text_dec"][n_dec:] == tokenizer.pad).all()
        assert (sample["loss_mask"] == sample["dec_mask"]).all() and (sample["labels"][n_dec:] == -1).all()
        encoder, decoder = sample["text_enc"][:n_enc].tolist(), sample["text_dec"][:n_dec].tolist()
        labels = sample["labels"][:n_dec].tolist()
        assert decoder[0] == tokenizer.bos and labels[-1] == tokenizer.eos
        assert decoder[1:] == labels[:-1]  # teacher forcing: the labels shifted right
        spans = _spans(sample, sentinels)
        in_encoder = [t for t in encoder if t in sentinels]
        assert [s for s, _ in spans] == in_encoder == sentinel_ids[:len(spans)]  # in order, one per span
        assert spans and all(tokens for _, tokens in spans)
        # fill each sentinel with its span: the sample's text as cut from its sentences
        filled = [t for token in encoder for t in (dict(spans)[token] if token in sentinels else [token])]
        first, end, target = (int(x) for x in dataset.sample_index[i])
        original = [t for s in range(first, end) for t in dataset.dataset.get(s).tolist()]
        assert filled == original[:target] and bool(sample["truncated"]) == (len(original) > target)
        assert tokenizer.detokenize(filled) == tokenizer.detokenize(original[:target])
        assert len(filled) <= 512 - 2
        truncated += int(sample["truncated"])
    assert 0 < truncated < len(dataset)


def test_deterministic_per_seed(kjv, tmp_path):
    prefix, tokenizer = kjv
    first = _dataset(tokenizer, prefix, num_samples=20)
    again = _dataset(tokenizer, prefix, num_samples=20, path_to_cache=str(tmp_path / "fresh"))  # built anew
    other = _dataset(tokenizer, prefix, num_samples=20, random_seed=99, path_to_cache=str(tmp_path / "other"))
    for i in range(20):
        for key in KEYS:
            assert np.array_equal(first[i][key], again[i][key])
    assert any(not np.array_equal(first[i]["text_enc"], other[i]["text_enc"]) for i in range(20))


def test_config_from_megatron_flags(kjv):
    prefix, tokenizer = kjv
    args = parse_args(argv=["--data-path", prefix, "--split", "1,0,0", "--seq-length", "256",
                            "--decoder-seq-length", "64", "--mask-prob", "0.1", "--seed", "7"])
    config = t5_dataset_config_from_args(args, tokenizer)
    assert (config.sequence_length_encoder, config.sequence_length_decoder, config.random_seed) == (256, 64, 7)
    assert (config.masking_probability, config.short_sequence_probability) == (0.1, 0.1)
    assert (config.masking_max_ngram, config.masking_do_full_word, config.masking_use_geometric_distribution,
            config.masking_geometric_p) == (10, True, True, 0.2)  # Megatron's pretrain_t5.py
    import pretrain_t5

    args = pretrain_t5.add_t5_args(argparse.ArgumentParser()).parse_args(["--mean-noise-span-length", "3"])
    args = argparse.Namespace(**{**vars(parse_args(argv=["--data-path", prefix, "--split", "1,0,0", "--seq-length",
                                                         "256", "--decoder-seq-length", "64"])), **vars(args)})
    assert t5_dataset_config_from_args(args, tokenizer).masking_geometric_p == pytest.approx(1 / 3)  # T5's mean 3


def test_errors(kjv, bert_vocab_file, tmp_path):
    prefix, tokenizer = kjv
    with pytest.raises(ValueError, match=r"has 0: give --vocab-extra-ids 100"):
        _config(BertWordPieceTokenizer(str(bert_vocab_file)), prefix)
    few = _few_sentinel_tokenizer(tokenizer, 10)
    with pytest.raises(ValueError, match=r"up to 76 .* has 10: give --vocab-extra-ids 100"):
        _config(few, prefix)
    with pytest.raises(ValueError, match="--decoder-seq-length 40 is too short.*>= 78"):
        _config(tokenizer, prefix, decoder=40)
    with pytest.raises(ValueError, match="needs --decoder-seq-length"):
        _config(tokenizer, prefix, decoder=None)
    with pytest.raises(ValueError, match="--encoder-seq-length 2 is too small"):
        _config(tokenizer, prefix, encoder=2, decoder=8)
    with pytest.raises(ValueError, match="WordPiece tokenizer.*has no bos, eos"):
        _config(object(), prefix)
    # a decoder length that fits the masked tokens but not their sentinels: refused at the sample
    tight = _dataset(tokenizer, prefix, num_samples=20, decoder=78, path_to_cache=str(tmp_path / "tight"))
    with pytest.raises(ValueError, match=r"T5 sample \d+ needs \d+ decoder tokens .* --decoder-seq-length is 78"):
        for i in range(len(tight)):
            tight[i]


def _few_sentinel_tokenizer(tokenizer, count):
    """The tokenizer with only its first `count` sentinels (a too small --vocab-extra-ids)."""
    class Few(type(tokenizer)):
        @property
        def additional_special_tokens_ids(self):
            return super().additional_special_tokens_ids[:count]

    few = object.__new__(Few)
    few.__dict__.update(tokenizer.__dict__)
    return few


# Megatron-Core's T5MaskedWordPieceDataset on the same .bin/.idx and vocabulary, in a process of its
# own (its package is called `megatron`, like ours); the install is `make setup-test`'s.
MCORE = '''
import json, sys, numpy, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=0, world_size=1)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from megatron.core.datasets.utils import Split
spec = json.load(open(sys.argv[1]))
class Tokenizer:  # the attributes the dataset reads
    unique_identifiers = {"class": "Tokenizer"}
    def __init__(self):
        self.inv_vocab = {int(k): v for k, v in spec["inv_vocab"].items()}
        for name in ("cls", "sep", "mask", "bos", "eos", "pad", "additional_special_tokens_ids"):
            setattr(self, name, spec[name])
config = T5MaskedWordPieceDatasetConfig(
    random_seed=1234, sequence_length=128, sequence_length_decoder=40, blend=([spec["prefix"]], None), split="1,0,0",
    tokenizer=Tokenizer(), path_to_cache=spec["cache"], masking_probability=0.15, short_sequence_probability=0.1,
    masking_max_ngram=10, masking_do_full_word=True, masking_do_permutation=False, masking_use_longer_ngrams=False,
    masking_use_geometric_distribution=True)  # Megatron's pretrain_t5.py
data = IndexedDataset(spec["prefix"])
dataset = T5MaskedWordPieceDataset(data, spec["prefix"], numpy.arange(data.document_indices.shape[0] - 1),
                                   spec["count"], Split.train, config)
json.dump({"sample_index": numpy.asarray(dataset.sample_index).tolist(),
           "samples": [{k: numpy.asarray(v).tolist() for k, v in dataset[i].items()} for i in range(spec["count"])]},
          open(sys.argv[2], "w"))
'''


def test_samples_equal_megatron_cores(kjv, tmp_path):
    """Megatron-Core's T5 dataset (its C++ build_mapping, its masking) and ours, Megatron's
    pretrain_t5.py settings: the same sample index and the same 300 samples, key for key."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    mcore = Path(os.environ.get("MEGATRON_CORE_PATH", Path(__file__).resolve().parents[2] / ".venv" / "peers"
                                / "megatron_core"))
    if not (mcore / "megatron" / "core" / "datasets" / "t5_dataset.py").is_file():
        pytest.skip(f"megatron-core not installed at {mcore} (make setup-test)")
    prefix, tokenizer = kjv
    spec = dict(inv_vocab={str(k): v for k, v in tokenizer.inv_vocab.items()}, cls=tokenizer.cls, sep=tokenizer.sep,
                mask=tokenizer.mask, bos=tokenizer.bos, eos=tokenizer.eos, pad=tokenizer.pad,
                additional_special_tokens_ids=tokenizer.additional_special_tokens_ids, prefix=prefix,
                cache=str(tmp_path / "mcore_cache"), count=300)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "mcore.py").write_text(MCORE)
    proc = subprocess.run([sys.executable, str(tmp_path / "mcore.py"), str(tmp_path / "spec.json"),
                           str(tmp_path / "out.json"), str(tmp_path / "pg")], env=dict(os.environ, PYTHONPATH=str(mcore)),
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = json.loads((tmp_path / "out.json").read_text())
    ours = _dataset(tokenizer, prefix, num_samples=300, encoder=128, decoder=40, path_to_cache=str(tmp_path / "ours"))
    assert np.array_equal(np.asarray(reference["sample_index"]), ours.sample_index)
    for i, sample in enumerate(reference["samples"]):
        mine = ours[i]
        assert set(sample) == set(mine)
        for key, value in sample.items():
            assert np.array_equal(np.asarray(value), np.asarray(mine[key])), (i, key)
