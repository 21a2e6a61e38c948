"""MinHash LSH deduplication (tools/data_collection/minhash.py, dedup.py): on a corpus with planted
near-duplicates it finds >= 95% of the pairs with Jaccard >= 0.9 and flags <= 1% of those with
Jaccard <= 0.5; signatures do not depend on batching or processes; the state files are plain
.npy/.json and a split run (signatures per file, then find, then remove) equals the one-step run."""
import json
import os

import numpy as np
import pytest

from tools.data_collection import dedup, minhash
from tools.data_collection.common import DataCollectionError
from tools.data_collection.synthetic import planted_corpus


def shingles(text: str, size: int = 5) -> set:
    words = minhash.normalise(text).split()
    return {tuple(words[i:i + size]) for i in range(max(len(words) - size + 1, 1))}


def jaccard(a: str, b: str) -> float:
    x, y = shingles(a), shingles(b)
    return len(x & y) / len(x | y)


def write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")


def same_group(drop_json: str, n_docs: int) -> np.ndarray:
    """Group id of each document (its own index when alone), from find's report."""
    with open(drop_json) as f:
        report = json.load(f)
    group = np.arange(n_docs)
    lines = {}
    for members in report["group_members"]:
        for _, line in members:
            lines[line - 1] = members[0][1] - 1
    for i, root in lines.items():
        group[i] = root
    return group


@pytest.mark.parametrize("verify", ["signatures", "shingles"])
def test_planted_near_duplicates_are_found_and_dissimilar_pairs_are_not(tmp_path, verify):
    texts, planted = planted_corpus(documents=400, pairs=500, words=200, substitutions=[0, 1, 1, 2, 2, 3, 4, 6, 8, 10, 12]
                                    + list(range(14, 41)), seed=3)
    write_jsonl(tmp_path / "corpus.jsonl", texts)
    stats = dedup.main(["run", "--input", str(tmp_path / "corpus.jsonl"), "--output-dir", str(tmp_path / "out"),
                        "--threshold", "0.8", "--verify", verify])
    group = same_group(str(tmp_path / "out" / "dedup.report.json"), len(texts))
    similar = [(i, j) for i, j in planted if jaccard(texts[i], texts[j]) >= 0.9]
    dissimilar = [(i, j) for i, j in planted if jaccard(texts[i], texts[j]) <= 0.5]
    assert len(similar) >= 50 and len(dissimilar) >= 250  # the corpus covers both ends
    found = sum(group[i] == group[j] for i, j in similar)
    flagged = sum(group[i] == group[j] for i, j in dissimilar)
    print(f"{verify}: found {found} of {len(similar)} pairs with J >= 0.9, "
          f"flagged {flagged} of {len(dissimilar)} with J <= 0.5")
    assert found >= 0.95 * len(similar), (found, len(similar))
    assert flagged <= 0.01 * len(dissimilar), (flagged, len(dissimilar))
    # Unrelated documents (of different planted families) are never joined.
    family = minhash.UnionFind(len(texts))
    family.union_pairs(planted)
    assert all(len({family.find(int(i)) for i in np.flatnonzero(group == g)}) == 1 for g in set(group.tolist()))
    kept = [json.loads(line)["text"] for line in open(tmp_path / "out" / "corpus.jsonl")]
    assert len(kept) == len(texts) - stats["dropped"]


def test_pairs_just_above_0_9_are_found(tmp_path):
    """The hardest case for the banding: every planted pair at J of about 0.9 (2 of 200 words changed)."""
    texts, planted = planted_corpus(documents=300, pairs=300, words=200, substitutions=[2], seed=8)
    write_jsonl(tmp_path / "corpus.jsonl", texts)
    dedup.main(["run", "--input", str(tmp_path / "corpus.jsonl"), "--output-dir", str(tmp_path / "out")])
    group = same_group(str(tmp_path / "out" / "dedup.report.json"), len(texts))
    similar = [(i, j) for i, j in planted if jaccard(texts[i], texts[j]) >= 0.9]
    assert len(similar) >= 200
    assert sum(group[i] == group[j] for i, j in similar) >= 0.95 * len(similar)


def test_signatures_do_not_depend_on_batching_and_equal_texts_match():
    texts, _ = planted_corpus(documents=20, pairs=0, seed=1)
    hasher = minhash.MinHasher(num_perm=64, seed=7)
    normalised = [minhash.normalise(t) for t in texts] + ["", "one two"]
    together = hasher.signatures(normalised)
    alone = np.concatenate([hasher.signatures([t]) for t in normalised])
    assert together.dtype == np.uint32 and together.shape == (22, 64)
    assert (together == alone).all()
    assert (together[20] == minhash.EMPTY).all() and not (together[21] == minhash.EMPTY).any()
    # Case, punctuation and spacing do not matter; the estimate tracks the true Jaccard.
    assert (hasher.signatures([minhash.normalise("One,  TWO three!")]) == hasher.signatures(["one two three"])).all()
    a, b = texts[0], " ".join(texts[0].split()[:150] + texts[1].split()[:50])
    estimate = (hasher.signatures([minhash.normalise(a)]) == hasher.signatures([minhash.normalise(b)])).mean()
    assert abs(estimate - jaccard(a, b)) < 0.15


def test_char_shingles_and_optimal_bands():
    hasher = minhash.MinHasher(num_perm=32, kind="char", size=4)
    assert hasher.signatures(["abcdefgh", "abcdefgh", "xyz"]).shape == (3, 32)
    bands, rows = minhash.optimal_bands(0.8, 128)
    assert bands * rows <= 128 and (bands, rows) == (9, 13)  # as datasketch picks for these settings


def test_split_run_equals_one_step_and_states_are_plain(tmp_path, capsys):
    texts, _ = planted_corpus(documents=60, pairs=60, seed=5)
    write_jsonl(tmp_path / "a.jsonl", texts[:70])
    write_jsonl(tmp_path / "b.jsonl", texts[70:])
    dedup.main(["run", "--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"),
                "--output-dir", str(tmp_path / "one"), "--workers", "2"])
    for name in ("a", "b"):
        dedup.main(["signatures", "--input", str(tmp_path / f"{name}.jsonl"), "--state", str(tmp_path / "st" / name)])
    dedup.main(["find", "--state", str(tmp_path / "st" / "a"), str(tmp_path / "st" / "b"), "--output",
                str(tmp_path / "dups")])
    dedup.main(["remove", "--state", str(tmp_path / "st" / "a"), str(tmp_path / "st" / "b"), "--duplicates",
                str(tmp_path / "dups"), "--output-dir", str(tmp_path / "split")])
    for name in ("a.jsonl", "b.jsonl"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "split" / name).read_bytes()
    assert sorted(os.listdir(tmp_path / "one")) == ["a.jsonl", "b.jsonl", "dedup.report.json"]
    for suffix in (".minhash.npy", ".exact.npy", ".lines.npy"):
        np.load(tmp_path / "st" / f"a{suffix}", allow_pickle=False)
    assert np.load(tmp_path / "dups.drop.npy", allow_pickle=False).dtype == np.int64
    # States of other settings cannot be mixed.
    dedup.main(["signatures", "--input", str(tmp_path / "b.jsonl"), "--state", str(tmp_path / "st" / "c"),
                "--num-perm", "64"])
    with pytest.raises(DataCollectionError, match=r"--state .*c: its num_perm differ"):
        dedup.main(["find", "--state", str(tmp_path / "st" / "a"), str(tmp_path / "st" / "c"), "--output",
                    str(tmp_path / "x")])


def test_malformed_json_line_names_file_and_line_and_writes_nothing(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "a b c"}\n{"text": "d e f"\n')
    with pytest.raises(DataCollectionError, match=r"in\.jsonl:2: not valid JSON"):
        dedup.main(["run", "--input", str(tmp_path / "in.jsonl"), "--output-dir", str(tmp_path / "out"),
                    "--workers", "2"])
    assert os.listdir(tmp_path / "out") == []


def test_batched_word_shingles_equal_text_by_text():
    texts = ["", "one", "one two three", "a b c d e f g h", "", "x y z w v u", "caf\u00e9 na\u00efve r\u00e9sum\u00e9 a b c"]
    hashes, counts = minhash.batch_word_shingles(texts, 5)
    alone = [minhash.shingle_hashes(t, "word", 5) for t in texts]
    assert counts.tolist() == [len(a) for a in alone] == [0, 1, 1, 4, 0, 2, 2]
    assert (hashes == np.concatenate(alone)).all()


def test_union_find_groups_keep_the_lowest_member():
    groups = minhash.UnionFind(10)
    groups.union_pairs([(8, 9), (3, 8), (5, 6), (9, 1)])
    assert groups.groups() == {1: [1, 3, 8, 9], 5: [5, 6]}
    assert groups.roots().tolist() == [0, 1, 2, 1, 4, 5, 5, 7, 1, 1]


def test_normalise_ascii_fast_path_equals_the_regex():
    import random
    import re

    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice([chr(i) for i in range(128)]) for _ in range(40))
        assert minhash.normalise(text) == " ".join(re.findall(r"\w+", text.lower()))
    assert minhash.normalise("Héllo, WORLD_x! Ünï") == "héllo world_x ünï"
