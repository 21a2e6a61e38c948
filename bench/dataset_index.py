"""How long the GPT dataset indices take to build on a large synthetic corpus.

Writes a corpus of --tokens random uint16 tokens in documents of lognormal length (median
~400 tokens) to a temporary directory, then times, at --seq-length:
  (a) the document / sample / shuffle indices of one epoch,
  (b) a sample count that needs 3 epochs (2.5 epochs' worth: the final epoch is separate),
  (c) a 3-dataset blend (the corpus under three prefixes) built by the builder,
and the loading of the cached indices; then
  (d) the blending indices of a --blend-samples (100M) blend of 10 datasets, and, when
      megatron-core is installed (make setup-test), its compiled helper on the same blend and
      whether the two agree element for element.
It prints figures and asserts nothing.

    python bench/dataset_index.py [--tokens 100000000] [--seq-length 2048] [--keep-dir]
    python bench/dataset_index.py --only-blend [--blend-samples 100000000]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data import blending_indices, index_helpers  # noqa: E402
from megatron.data.dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.data.dataset_config import GPTDatasetConfig  # noqa: E402
from megatron.data.gpt_dataset import GPTDataset  # noqa: E402
from megatron.data.indexed_dataset import IndexedDataset, write_index  # noqa: E402
from megatron.data.utils import Split, normalize  # noqa: E402

# A typical 10-dataset blend: a few large sources and a tail of small ones.
BLEND_WEIGHTS = (0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.03, 0.02, 0.01)
MCORE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "peers", "megatron_core")


class _Tokenizer:
    eod = 50256
    vocab_size = 50257


def write_corpus(prefix: str, num_tokens: int, median_doc_tokens: int = 400, seed: int = 0) -> None:
    """Random documents (lognormal lengths around median_doc_tokens, eod last) totalling num_tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(median_doc_tokens), 0.8,
                                          size=2 * num_tokens // median_doc_tokens + 16).astype(np.int64))
    ends = np.cumsum(lengths)
    count = int(np.searchsorted(ends, num_tokens)) + 1
    lengths[count - 1] -= ends[count - 1] - num_tokens  # the last document ends exactly at num_tokens
    tokens = rng.integers(0, _Tokenizer.eod, size=num_tokens, dtype=np.uint16)
    ends = np.cumsum(lengths[:count])
    tokens[ends - 1] = _Tokenizer.eod
    # one sequence per document, written in one go (the builder's add_item loop is slow for
    # millions of documents); write_index is the builder's own index writer
    tokens.tofile(prefix + ".bin")
    write_index(prefix + ".idx", np.uint16, lengths[:count], np.arange(count + 1, dtype=np.int64))


def timed(label: str, fn):
    start = time.perf_counter()
    result = fn()
    print(f"  {label:<44s} {time.perf_counter() - start:8.3f} s", flush=True)
    return result


def time_phases(dataset: IndexedDataset, seq_length: int, num_samples) -> None:
    """Time the three index builders directly (no file I/O)."""
    ids = np.arange(len(dataset), dtype=np.int32)
    tokens = int(dataset.sequence_lengths.sum(dtype=np.int64))
    epochs = index_helpers.get_num_epochs(tokens, seq_length, num_samples, 1)
    separate = index_helpers.use_separate_final_epoch(tokens, seq_length, num_samples, epochs, 1)
    rng = np.random.RandomState(1234)
    doc = timed("document index", lambda: index_helpers.build_document_index(ids, epochs, rng, separate))
    sample = timed("sample index", lambda: index_helpers.build_sample_index(dataset.sequence_lengths, doc,
                                                                            seq_length, 1))
    total = len(sample) - 1
    first = ((epochs - 1) * tokens - 1) // seq_length if separate else total
    timed("shuffle index", lambda: index_helpers.build_shuffle_index(first, total, rng))
    print(f"  -> {epochs} epoch(s), separate final epoch: {separate}, document index {len(doc):,}, "
          f"samples {total:,}")


def time_dataset(prefix: str, dataset: IndexedDataset, cache: str, seq_length: int, num_samples) -> None:
    """Build (and save) the cached indices through GPTDataset, then load them again."""
    config = GPTDatasetConfig(random_seed=1234, sequence_length=seq_length, blend=([prefix], None), split="1",
                              path_to_cache=cache, tokenizer=_Tokenizer())
    ids = np.arange(len(dataset), dtype=np.int32)
    make = lambda: GPTDataset(dataset, prefix, ids, num_samples, Split.train, config)  # noqa: E731
    built = timed("GPTDataset build + save (total)", make)
    loaded = timed("GPTDataset load from cache", make)
    timed("read 1000 samples", lambda: [loaded[i] for i in range(1000)])
    assert len(built) == len(loaded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--median-doc-tokens", type=int, default=400,
                        help="median document length (smaller means more documents)")
    parser.add_argument("--keep-dir", action="store_true", help="keep the temporary directory")
    parser.add_argument("--blend-samples", type=int, default=100_000_000, help="samples of the 10-dataset blend (d)")
    parser.add_argument("--only-blend", action="store_true", help="only (d), no corpus")
    args = parser.parse_args()
    if args.only_blend:
        time_blend_indices(args.blend_samples)
        return
    directory = tempfile.mkdtemp(prefix="bench_dataset_index_")
    try:
        prefix = os.path.join(directory, "corpus_text_document")
        timed(f"write a {args.tokens:,}-token corpus", lambda: write_corpus(prefix, args.tokens, args.median_doc_tokens))
        dataset = IndexedDataset(prefix)
        per_epoch = (args.tokens - 1) // args.seq_length
        print(f"corpus: {dataset.num_documents:,} documents, {args.tokens:,} tokens, "
              f"{per_epoch:,} samples of {args.seq_length} per epoch")
        three_epochs = int(2.5 * per_epoch)
        for label, num_samples in (("(a) one epoch", None), (f"(b) {three_epochs:,} samples", three_epochs)):
            print(f"{label}: index builders")
            time_phases(dataset, args.seq_length, num_samples)
            print(f"{label}: through GPTDataset (logs above the totals)")
            time_dataset(prefix, dataset, os.path.join(directory, f"cache_{num_samples}"), args.seq_length,
                         num_samples)
        time_blend(directory, prefix, args.seq_length, per_epoch)
        time_blend_indices(args.blend_samples)
    finally:
        if args.keep_dir:
            print(f"kept {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)


def time_blend(directory: str, prefix: str, seq_length: int, per_epoch: int) -> None:
    """(c) A blend of three prefixes (hard links to one corpus), 2 epochs' worth of samples."""
    prefixes = []
    for i in range(3):
        link = os.path.join(directory, f"blend{i}_text_document")
        for ext in (".bin", ".idx"):
            os.link(prefix + ext, link + ext)
        prefixes.append(link)
    size = 2 * per_epoch
    config = GPTDatasetConfig(random_seed=1234, sequence_length=seq_length, blend=(prefixes, [0.5, 0.3, 0.2]),
                              split="98,2,0", path_to_cache=os.path.join(directory, "cache_blend"),
                              tokenizer=_Tokenizer())
    print(f"(c) blend of 3 datasets (weights 0.5/0.3/0.2), {size:,} train samples, split 98,2,0")
    build = lambda: BlendedMegatronDatasetBuilder(GPTDataset, [size, 1000, 0], None, config).build()  # noqa: E731
    train = timed("builder: build + save (total)", build)[0]
    timed("builder: load from cache", build)
    counts = np.bincount(train.dataset_index, minlength=3)
    print(f"  -> blended samples per dataset: {counts.tolist()} of {len(train):,}")


def _megatron_core_helpers():
    """megatron-core's compiled helpers_cpp module, loaded from its file (it imports nothing of
    megatron), or None when megatron-core is not installed."""
    folder = os.path.join(MCORE, "megatron", "core", "datasets")
    names = [n for n in os.listdir(folder) if n.startswith("helpers_cpp") and n.endswith(".so")] \
        if os.path.isdir(folder) else []
    if not names:
        return None
    spec = importlib.util.spec_from_file_location("helpers_cpp", os.path.join(folder, names[0]))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_blend_indices(num_samples: int) -> None:
    """(d) The greedy blending indices alone (what a BlendedDataset builds), against megatron-core's C++."""
    print(f"(d) blending indices of a {num_samples:,}-sample blend of {len(BLEND_WEIGHTS)} datasets "
          f"(weights {', '.join(map(str, BLEND_WEIGHTS))})")
    index, sample = timed("build (vectorised numpy)",
                          lambda: blending_indices.build_blending_indices(normalize(BLEND_WEIGHTS), num_samples))
    print(f"  -> samples per dataset: {np.bincount(index, minlength=len(BLEND_WEIGHTS)).tolist()}")
    helpers = _megatron_core_helpers()
    if helpers is None:
        print("  (megatron-core not installed: no comparison with its C++ helper)")
        return
    reference_index = np.zeros(num_samples, dtype=np.int16)
    reference_sample = np.zeros(num_samples, dtype=np.int64)
    weights = np.array(normalize(BLEND_WEIGHTS))
    timed("megatron-core's compiled helpers_cpp", lambda: helpers.build_blending_indices(
        reference_index, reference_sample, weights, len(weights), num_samples, False))
    equal = np.array_equal(index, reference_index) and np.array_equal(sample, reference_sample)
    print(f"  -> identical to megatron-core's arrays: {equal}")


if __name__ == "__main__":
    main()
