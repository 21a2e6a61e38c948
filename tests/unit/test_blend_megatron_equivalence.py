"""Blends, sizes, split boundaries and cache names against megatron-core 0.16.1 itself.

Both sides read the same small .bin/.idx files written here. megatron-core runs in one
subprocess per test (tests/helpers/mcore_reference.py) that handles a whole list of cases; our side
runs the same cases in this process, and every array, size and file name is compared.
"""

import json
import os
from collections import OrderedDict

import numpy as np
import pytest

from megatron.data import blending_indices
from megatron.data.blended_dataset import BlendedDataset
from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder
from megatron.data.dataset_config import GPTDatasetConfig
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDatasetBuilder
from megatron.data.utils import get_split_indices, parse_and_normalize_split
from tests.helpers.mcore_reference import require_mcore, run_mcore

VOCAB = 1000
# Megatron-LM's legacy GPT2BPETokenizer describes itself so (core_v0.13 / v0.14, or --legacy-tokenizer)
TOKENIZER_IDS = OrderedDict([("class", "_GPT2BPETokenizer"),
                             ("tokenizer_path", ["gpt2-vocab.json", "gpt2-merges.txt"])])

# What each side reports about the datasets one case builds; run here and inside megatron-core.
SUMMARY = '''
def summarize(datasets, out):
    """JSON-able description of [train, valid, test]; blend index arrays saved as out-<split>-*.npy."""
    def mid(d):
        return {"class": type(d).__name__, "num_samples": d.num_samples, "len": len(d),
                "indices": [int(d.indices[0]), int(d.indices[-1]) + 1, len(d.indices)]}
    report = []
    for i, d in enumerate(datasets):
        if d is None:
            report.append(None)
        elif hasattr(d, "dataset_index"):
            numpy.save(f"{out}-{i}-dataset_index.npy", numpy.asarray(d.dataset_index))
            numpy.save(f"{out}-{i}-dataset_sample_index.npy", numpy.asarray(d.dataset_sample_index))
            report.append({"class": "BlendedDataset", "len": len(d), "size": d.size,
                           "weights": list(d.weights), "parts": [mid(p) for p in d.datasets]})
        else:
            report.append(mid(d))
    return report
'''

MCORE_SNIPPET = '''
import numpy, torch
from collections import OrderedDict
torch.distributed.init_process_group("gloo", init_method="file://" + WORK + "/pg", rank=0, world_size=1)
from megatron.core.datasets import helpers_cpp
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

class Tokenizer:
    eod = 0
    vocab_size = VOCAB
    unique_identifiers = TOKENIZER_IDS

spec = json.load(open(WORK + "/spec.json"))
results = []
for case in spec["cases"]:
    config = GPTDatasetConfig(
        random_seed=case["seed"], sequence_length=case["seq"], blend=case["blend"],
        blend_per_split=case["blend_per_split"], split=case["split"],
        path_to_cache=WORK + "/mcore/" + case["name"], tokenizer=Tokenizer(),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, case["sizes"], lambda: True, config).build()
    results.append(summarize(datasets, WORK + "/mcore/" + case["name"]))
for i, (w, size) in enumerate(spec["weighted"]):
    index, sample = numpy.zeros(size, numpy.int16), numpy.zeros(size, numpy.int64)
    helpers_cpp.build_blending_indices(index, sample, numpy.array(w), len(w), size, False)
    numpy.save(WORK + f"/greedy-w{i}.npy", numpy.stack([index, sample]))
for i, sizes in enumerate(spec["exhaustive"]):
    total = sum(sizes)
    index, sample = numpy.zeros(total, numpy.int16), numpy.zeros(total, numpy.int64)
    helpers_cpp.build_exhaustive_blending_indices(index, sample, numpy.array(sizes), len(sizes))
    numpy.save(WORK + f"/greedy-e{i}.npy", numpy.stack([index, sample]))
emit(results)
'''


class Tokenizer:
    eod = 0
    vocab_size = VOCAB
    unique_identifiers = TOKENIZER_IDS


def write_dataset(prefix, num_docs, rng, min_length=3):
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
        for _ in range(num_docs):
            builder.add_item(rng.integers(1, VOCAB, size=int(rng.integers(min_length, 40))))
            builder.end_document()
        builder.finalize(prefix + ".idx")
    return prefix


def blend_cases(prefixes, rng):
    """Weighted and unweighted blends of 2-10 datasets, and separate train/valid/test blends."""
    cases = []
    for i, count in enumerate([2, 4, 10]):
        chosen = [prefixes[j] for j in rng.choice(len(prefixes), size=count, replace=False)]
        weights = [float(x) for x in rng.dirichlet(np.ones(count) * 0.7) + 0.01]
        sizes = [int(rng.integers(1500, 3000)), int(rng.integers(20, 300)), int(rng.integers(20, 300))]
        cases.append(dict(blend=[chosen, weights], split=["90,6,4", "98,1,1", "80/15/5"][i],
                          sizes=sizes))
    cases.append(dict(blend=[prefixes[:2], [30, 70]], split="969, 30, 1", sizes=[300, 40, 10]))  # int weights
    cases.append(dict(blend=[prefixes[2:5], None], split="7,2,1", sizes=[3000, 50, 30]))  # unweighted, capped
    cases.append(dict(blend=[prefixes[5:7], None], split="90,5,5", sizes=[None, None, None]))  # every sample once
    cases.append(dict(blend_per_split=[[prefixes[:3], [0.5, 0.25, 0.25]], [prefixes[3:5], None],
                                       [prefixes[5:6], [1.0]]], sizes=[2000, None, 40]))
    cases.append(dict(blend_per_split=[[prefixes[6:8], None], [prefixes[1:6], [1, 2, 3, 4, 5]],
                                       [prefixes[9:], None]], sizes=[1500, 500, 60]))
    for i, case in enumerate(cases):
        case.update(name=f"case{i}", seed=int(rng.integers(0, 1000)), seq=int(rng.integers(4, 24)))
        case.setdefault("blend", None)
        case.setdefault("blend_per_split", None)
        case.setdefault("split", None)
    return cases


def split_cases(work, rng):
    """One dataset each, split where running sums land on .5 (275 documents at 98,1,1: 269.5)."""
    cases = []
    for docs, split in [(275, "98,1,1"), (50, "93,5,2"), (30, "75,15,10"), (10, "65,20,15"), (70, "45,45,10"),
                        (1500, "969, 30, 1"), (22, "3,1,1"), (14, "25,50,25")]:
        prefix = write_dataset(str(work / f"split{docs}"), docs, rng, min_length=8)
        cases.append(dict(name=f"split{docs}", blend=[[prefix], None], blend_per_split=None, split=split,
                          sizes=[20, 5, 5], seed=1, seq=4, docs=docs))
    return cases


def greedy_cases(rng):
    """Random weights and sizes, including tiny weights and exact ties; sizes for exhaustive blends."""
    weighted, exhaustive = [], []
    for i in range(32):
        count = int(rng.integers(1, 11))
        kind = i % 4
        if kind == 0:
            w = rng.dirichlet(np.ones(count))
        elif kind == 1:  # some datasets chosen once in thousands of samples
            w = rng.random(count) ** 6 + 1e-5
        elif kind == 2:  # small integers: many exact ties
            w = rng.integers(1, 5, size=count).astype(float)
        else:
            w = rng.dirichlet(np.ones(count) * 0.2) + 1e-4
        weighted.append([(w / w.sum()).tolist(), int(rng.integers(1, 12000))])
        if i % 2:
            exhaustive.append([int(x) for x in rng.integers(1, 1000, size=count)])
    return weighted, exhaustive


def build_ours(case, work):
    config = GPTDatasetConfig(random_seed=case["seed"], sequence_length=case["seq"],
                              blend=None if case["blend"] is None else tuple(case["blend"]),
                              blend_per_split=None if case["blend_per_split"] is None
                              else [tuple(b) for b in case["blend_per_split"]],
                              split=case["split"], path_to_cache=str(work / "ours" / case["name"]),
                              tokenizer=Tokenizer())
    return BlendedMegatronDatasetBuilder(GPTDataset, case["sizes"], None, config).build()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Every case built here and, in one subprocess, by megatron-core: (work, spec, ours, theirs)."""
    require_mcore()
    work = tmp_path_factory.mktemp("blend_equivalence")
    rng = np.random.default_rng(2024)
    # the first two are large enough for the 0.1% test split of Megatron's default "969, 30, 1"
    prefixes = [write_dataset(str(work / f"d{i}"), 1500 if i < 2 else int(rng.integers(200, 400)), rng)
                for i in range(10)]
    cases = blend_cases(prefixes, rng) + split_cases(work, rng)
    weighted, exhaustive = greedy_cases(rng)
    spec = dict(cases=cases, weighted=weighted, exhaustive=exhaustive)
    # ours first: it refuses an empty split, which megatron-core's builder loops on forever
    scope = {"numpy": np}
    exec(SUMMARY, scope)
    ours = [scope["summarize"](build_ours(case, work), str(work / "ours" / case["name"])) for case in cases]
    (work / "spec.json").write_text(json.dumps(spec))
    preamble = (f"from collections import OrderedDict\nimport numpy\nWORK = {str(work)!r}\nVOCAB = {VOCAB}\n"
                f"TOKENIZER_IDS = OrderedDict({list(TOKENIZER_IDS.items())!r})\n")
    theirs = run_mcore(preamble + SUMMARY + MCORE_SNIPPET, timeout=180)
    return work, spec, dict(zip([c["name"] for c in cases], ours)), dict(zip([c["name"] for c in cases], theirs))


def test_blends_sizes_and_cache_names_equal_megatron_cores(reference):
    work, spec, ours, theirs = reference
    for case in spec["cases"]:
        name = case["name"]
        if not name.startswith("case"):
            continue
        assert ours[name] == theirs[name], case  # classes, lengths, blend sizes and weights, mid-level sizes, splits
        for i, split in enumerate(theirs[name]):
            if split is not None and split["class"] == "BlendedDataset":
                for array in ("dataset_index", "dataset_sample_index"):
                    np.testing.assert_array_equal(np.load(work / "ours" / f"{name}-{i}-{array}.npy"),
                                                  np.load(work / "mcore" / f"{name}-{i}-{array}.npy"))
        # the same md5-named cache files, holding the same arrays; ours adds the token-id ranges
        mine, megatron = (set(os.listdir(work / side / name)) for side in ("ours", "mcore"))
        assert megatron <= mine and all(n.endswith("-token_range.json") for n in mine - megatron)
        for file_name in sorted(megatron):
            ours_file, their_file = work / "ours" / name / file_name, work / "mcore" / name / file_name
            if file_name.endswith(".npy"):
                np.testing.assert_array_equal(np.load(ours_file), np.load(their_file), err_msg=file_name)
            else:
                assert ours_file.read_text() == their_file.read_text()


def test_split_boundaries_round_like_megatron_core_at_half(reference):
    work, spec, ours, theirs = reference
    for case in spec["cases"]:
        name = case["name"]
        if not name.startswith("split"):
            continue
        assert [s["indices"] for s in ours[name]] == [s["indices"] for s in theirs[name]], case
        bounds = get_split_indices(parse_and_normalize_split(case["split"]), case["docs"])
        assert [s["indices"][:2] for s in theirs[name]] == [bounds[0:2], bounds[1:3], bounds[2:4]]
    assert [s["indices"][:2] for s in theirs["split275"]] == [[0, 270], [270, 272], [272, 275]]  # the issue's


def test_greedy_indices_equal_helpers_cpp_bit_for_bit(reference):
    """Default geometry and many short blocks (whose warm-ups often start wrong and get repaired)."""
    work, spec, _, _ = reference
    rng = np.random.default_rng(5)
    for i, (w, size) in enumerate(spec["weighted"]):
        expected = np.load(work / f"greedy-w{i}.npy")
        block = int(rng.integers(16, 400))
        for kwargs in ({}, dict(block=block, warmup=int(rng.integers(1, block)))):
            index, sample = blending_indices.build_blending_indices(w, size, **kwargs)
            assert index.dtype == np.int16 and sample.dtype == np.int64
            np.testing.assert_array_equal(np.stack([index, sample]), expected, err_msg=f"{w} {size} {kwargs}")
    for i, sizes in enumerate(spec["exhaustive"]):
        expected = np.load(work / f"greedy-e{i}.npy")
        for kwargs in ({}, dict(block=64, warmup=8)):
            index, sample = blending_indices.build_exhaustive_blending_indices(sizes, **kwargs)
            np.testing.assert_array_equal(np.stack([index, sample]), expected, err_msg=f"{sizes} {kwargs}")


def test_blended_dataset_is_rejected_without_samples(tmp_path):
    """An unweighted blend whose dataset has no sample in the split is refused by name (Megatron asserts)."""
    rng = np.random.default_rng(3)
    prefixes = [write_dataset(str(tmp_path / f"p{i}"), 30, rng) for i in range(2)]
    config = GPTDatasetConfig(random_seed=1, sequence_length=4, blend=(prefixes, None), split="1",
                              path_to_cache=str(tmp_path / "cache"), tokenizer=Tokenizer())
    train = BlendedMegatronDatasetBuilder(GPTDataset, [None, 0, 0], None, config).build()[0]
    with pytest.raises(ValueError, match=f"blend weight of {prefixes[1]} must be a positive number, got 0"):
        BlendedDataset(train.datasets, [len(train.datasets[0]), 0], None, config)
