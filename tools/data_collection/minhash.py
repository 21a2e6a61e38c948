"""MinHash signatures, LSH banding and duplicate groups, vectorised with numpy.

How a document becomes a signature (all arithmetic in uint64, wrapping mod 2^64):
  1. normalise: lower-case words (regex \\w+) joined by single spaces, as UTF-8 bytes `t`;
  2. shingles: each run of `k` consecutive words (word shingles) or `k` bytes (char shingles);
     a text shorter than one shingle is one shingle;
  3. hash every shingle at once with a polynomial rolling hash over prefix sums:
     with C[i] = sum_{j<i} t[j] * B^-j, the span [s, e) hashes to B^(e-1) * (C[e] - C[s])
     (B odd, so invertible mod 2^64), then a splitmix64 finaliser, keeping the top 32 bits x;
  4. `num_perm` hash functions from the multiply-add-shift family h(x) = ((a*x + b) mod 2^64) >> 32
     (a, b random 64-bit, a odd; Dietzfelbinger's strongly universal family for 32-bit keys,
     which needs no 128-bit product or division as a*x+b mod p would); the signature is the
     minimum of each h over the shingles, uint32 [num_perm].
Same text, same settings (num_perm, shingle kind and size, seed) -> same signature, in any
process or run: signatures of files computed apart can be merged.

LSH: the signature is cut into `bands` bands of `rows` values (chosen, as datasketch does, to
minimise the sum of the false positive and false negative probability mass around the
threshold); documents sharing a band's values are candidates. Candidates are verified by the
Jaccard similarity *estimated from their signatures* (the fraction of equal values; standard
error sqrt(J(1-J)/num_perm), 0.026 at J=0.9 with 128 values), kept when >= the threshold, and
joined into groups with union-find.
"""

from __future__ import annotations

import hashlib
import re
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np

_WORD = re.compile(r"\w+")
_B = np.uint64(0x100000001B3)  # odd: invertible mod 2^64
_B_INV = np.uint64(pow(0x100000001B3, -1, 1 << 64))
EMPTY = np.uint32(0xFFFFFFFF)  # every value of the signature of a text without words
_CHUNK_ROWS = 8192  # shingles hashed at a time: [num_perm, 8192] uint64 = 8 MiB at 128


# ASCII bytes that are not \w (letters, digits, underscore) become spaces.
_ASCII_NON_WORD = bytes(c if chr(c).isascii() and (chr(c).isalnum() or c == ord("_")) else 32 for c in range(256))


def normalise(text: str) -> str:
    """Lower-case \\w+ words joined by single spaces (an ASCII text takes a path twice as fast)."""
    if text.isascii():
        return b" ".join(text.encode("ascii").lower().translate(_ASCII_NON_WORD).split()).decode("ascii")
    return " ".join(_WORD.findall(text.lower()))


def exact_hash(normalised: str) -> int:
    """64-bit hash of the normalised text: equal for texts differing only in case, punctuation, spacing."""
    return int.from_bytes(hashlib.blake2b(normalised.encode("utf-8"), digest_size=8).digest(), "little")


class _Powers:
    """B^i and B^-i for i < n, grown on demand (shared by all documents of a process)."""

    def __init__(self) -> None:
        self.forward = np.ones(1, np.uint64)
        self.inverse = np.ones(1, np.uint64)

    def get(self, n: int) -> Tuple[np.ndarray, np.ndarray]:
        if len(self.forward) < n:
            size = max(n, 2 * len(self.forward))
            self.forward = np.cumprod(np.concatenate([[np.uint64(1)], np.full(size - 1, _B, np.uint64)]),
                                      dtype=np.uint64)
            self.inverse = np.cumprod(np.concatenate([[np.uint64(1)], np.full(size - 1, _B_INV, np.uint64)]),
                                      dtype=np.uint64)
        return self.forward[:n], self.inverse[:n]


_POWERS = _Powers()


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place on uint64."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def span_hashes(normalised: str, kind: str, size: int) -> np.ndarray:
    """uint64 hash of every shingle of a normalised text, in order (a text shorter than one
    shingle is one shingle; none without words)."""
    data = np.frombuffer(normalised.encode("utf-8"), np.uint8)
    n = len(data)
    if n == 0:
        return np.zeros(0, np.uint64)
    if kind == "word":
        spaces = np.flatnonzero(data == 32)
        starts = np.concatenate([[0], spaces + 1])
        ends = np.concatenate([spaces, [n]])
        if len(starts) >= size:
            s, e = starts[: len(starts) - size + 1], ends[size - 1:]
        else:
            s, e = starts[:1], ends[-1:]
    else:
        count = max(n - size + 1, 1)
        s = np.arange(count)
        e = np.minimum(s + size, n)
    forward, inverse = _POWERS.get(n + 1)
    prefix = np.zeros(n + 1, np.uint64)
    np.cumsum(data.astype(np.uint64) * inverse[:n], dtype=np.uint64, out=prefix[1:])
    return _mix(forward[e - 1] * (prefix[e] - prefix[s]))


def shingle_hashes(normalised: str, kind: str, size: int) -> np.ndarray:
    """uint64 hashes (< 2^32) of the shingles of a normalised text (repeats kept: they do not
    change a minimum, and removing them costs more than it saves); empty without words."""
    return span_hashes(normalised, kind, size) >> np.uint64(32)


def batch_word_shingles(normalised_texts: Sequence[str], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Hashes (< 2^32) of the word shingles of many normalised texts at once, and the number of
    each text's shingles (the hashes are grouped by text, in order): the same values as
    shingle_hashes(text, "word", size) text by text, with numpy's per-call cost paid once."""
    data = np.frombuffer("\n".join(normalised_texts).encode("utf-8"), np.uint8)
    n, docs = len(data), len(normalised_texts)
    if n == 0:
        return np.zeros(0, np.uint64), np.zeros(docs, np.int64)
    separator = (data == 32) | (data == 10)
    inside = ~separator
    starts = np.flatnonzero(inside & np.concatenate([[True], separator[:-1]]))
    ends = np.flatnonzero(inside & np.concatenate([separator[1:], [True]])) + 1
    newlines = np.flatnonzero(data == 10)
    doc_of_word = np.searchsorted(newlines, starts)  # texts are separated by "\n"
    words_per_doc = np.bincount(doc_of_word, minlength=docs)
    # Full shingles: `size` consecutive words of one text.
    first = np.arange(max(len(starts) - size + 1, 0))
    full = first[doc_of_word[first] == doc_of_word[first + size - 1]]
    s, e, d = starts[full], ends[full + size - 1], doc_of_word[full]
    # A text with fewer words than a shingle is one shingle.
    short = np.flatnonzero((words_per_doc > 0) & (words_per_doc < size))
    if len(short):
        first_word = np.concatenate([[0], np.cumsum(words_per_doc)[:-1]])
        s = np.concatenate([s, starts[first_word[short]]])
        e = np.concatenate([e, ends[first_word[short] + words_per_doc[short] - 1]])
        d = np.concatenate([d, short])
        order = np.argsort(d, kind="stable")
        s, e, d = s[order], e[order], d[order]
    forward, inverse = _POWERS.get(n + 1)
    prefix = np.zeros(n + 1, np.uint64)
    np.cumsum(data.astype(np.uint64) * inverse[:n], dtype=np.uint64, out=prefix[1:])
    hashes = _mix(forward[e - 1] * (prefix[e] - prefix[s])) >> np.uint64(32)
    return hashes, np.bincount(d, minlength=docs).astype(np.int64)


class MinHasher:
    """The num_perm hash functions of one seed, and signatures of batches of texts."""

    def __init__(self, num_perm: int = 128, seed: int = 1, kind: str = "word", size: int = 5) -> None:
        if kind not in ("word", "char"):
            raise ValueError(f"shingle kind {kind!r} is not 'word' or 'char'")
        rng = np.random.Generator(np.random.PCG64(seed))
        self.a = rng.integers(0, 1 << 63, num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self.b = rng.integers(0, 1 << 63, num_perm, dtype=np.uint64) * np.uint64(2)
        self.num_perm, self.kind, self.size = num_perm, kind, size

    def signatures(self, normalised_texts: Sequence[str]) -> np.ndarray:
        """uint32 [len(texts), num_perm]; a text without words gets EMPTY everywhere."""
        if self.kind == "word":
            x, counts = batch_word_shingles(normalised_texts, self.size)
        else:
            parts = [shingle_hashes(text, self.kind, self.size) for text in normalised_texts]
            counts = np.array([len(p) for p in parts], np.int64)
            x = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
        out = np.full((len(normalised_texts), self.num_perm), EMPTY, np.uint32)
        docs = np.flatnonzero(counts)  # the documents with shingles
        if len(docs) == 0:
            return out
        starts = np.concatenate([[0], np.cumsum(counts[docs])[:-1]])
        # [num_perm, shingles] layout: the per-document minimum runs along contiguous memory.
        signature = np.full((self.num_perm, len(docs)), np.iinfo(np.uint64).max, np.uint64)
        for r0 in range(0, len(x), _CHUNK_ROWS):
            r1 = min(r0 + _CHUNK_ROWS, len(x))
            h = np.multiply.outer(self.a, x[r0:r1])  # [num_perm, rows]: a*x mod 2^64
            h += self.b[:, None]
            d0 = int(np.searchsorted(starts, r0, side="right")) - 1
            d1 = int(np.searchsorted(starts, r1, side="left"))
            offsets = np.maximum(starts[d0:d1], r0) - r0
            # >> 32 is monotonic, so it is taken once on the minima rather than on every value.
            np.minimum(signature[:, d0:d1], np.minimum.reduceat(h, offsets, axis=1), out=signature[:, d0:d1])
        out[docs] = (signature >> np.uint64(32)).T.astype(np.uint32)
        return out


# ----------------------------------------------------------------------------- LSH


def optimal_bands(threshold: float, num_perm: int, fp_weight: float = 0.5, fn_weight: float = 0.5) -> Tuple[int, int]:
    """(bands, rows) minimising fp_weight * P(false positive) + fn_weight * P(false negative),
    integrated over similarities below / above the threshold (datasketch's rule)."""
    best, best_cost = (1, 1), float("inf")
    below = np.linspace(0.0, threshold, 201)
    above = np.linspace(threshold, 1.0, 201)
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            fp = np.trapezoid(1 - (1 - below ** rows) ** bands, below)
            fn = np.trapezoid((1 - above ** rows) ** bands, above)
            cost = fp_weight * fp + fn_weight * fn
            if cost < best_cost:
                best, best_cost = (bands, rows), cost
    return best


def band_keys(signatures: np.ndarray, band: int, rows: int) -> np.ndarray:
    """uint64 key of each row's values in band `band` (equal values -> equal keys)."""
    key = np.zeros(len(signatures), np.uint64)
    for column in range(band * rows, (band + 1) * rows):
        key *= np.uint64(0x9E3779B97F4A7C15)
        key += signatures[:, column].astype(np.uint64)
        _mix(key)
    return key


def bucket_pairs(keys: np.ndarray, ids: np.ndarray, max_all_pairs: int = 16) -> np.ndarray:
    """int64 [m, 2] candidate pairs (i < j) of ids sharing a key: every pair in buckets of up to
    max_all_pairs members, the first member with each other and each with the next in larger
    ones (enough for union-find to join them when they are similar)."""
    order = np.argsort(keys, kind="stable")
    sorted_keys, sorted_ids = keys[order], ids[order]
    same = sorted_keys[1:] == sorted_keys[:-1]
    if not same.any():
        return np.zeros((0, 2), np.int64)
    starts = np.flatnonzero(np.concatenate([[True], ~same]))
    sizes = np.diff(np.concatenate([starts, [len(keys)]]))
    pairs: List[np.ndarray] = []
    # Every member with its bucket's first member, and with its successor.
    first = np.repeat(starts, sizes)
    position = np.arange(len(keys))
    member = position != first
    pairs.append(np.stack([sorted_ids[first[member]], sorted_ids[position[member]]], 1))
    pairs.append(np.stack([sorted_ids[:-1][same], sorted_ids[1:][same]], 1))
    for start, size in zip(starts[(sizes > 2) & (sizes <= max_all_pairs)], sizes[(sizes > 2) & (sizes <= max_all_pairs)]):
        members = sorted_ids[start:start + size]
        i, j = np.triu_indices(size, 1)
        pairs.append(np.stack([members[i], members[j]], 1))
    pairs_array = np.sort(np.concatenate(pairs), axis=1)
    return pairs_array


def unique_pairs(pairs: np.ndarray) -> np.ndarray:
    if len(pairs) == 0:
        return pairs.reshape(0, 2)
    return np.unique(pairs, axis=0)


def estimated_jaccard(signatures_of, pairs: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """Fraction of equal signature values of each pair; signatures_of(ids) -> uint32 [len(ids), P]."""
    out = np.zeros(len(pairs), np.float64)
    for p0 in range(0, len(pairs), chunk):
        block = pairs[p0:p0 + chunk]
        out[p0:p0 + chunk] = (signatures_of(block[:, 0]) == signatures_of(block[:, 1])).mean(axis=1)
    return out


class UnionFind:
    """Disjoint sets over 0..n-1 (path halving, union by smaller root id: a group's root is its
    lowest member, the document kept)."""

    def __init__(self, n: int) -> None:
        self.parent = np.arange(n, dtype=np.int64)

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return int(i)

    def union_pairs(self, pairs: Iterable[Tuple[int, int]]) -> None:
        for i, j in pairs:
            ri, rj = self.find(int(i)), self.find(int(j))
            if ri != rj:
                self.parent[max(ri, rj)] = min(ri, rj)

    def roots(self) -> np.ndarray:
        """The root of every element, by vectorised pointer jumping (parents only point down)."""
        roots = self.parent.copy()
        while True:
            jumped = roots[roots]
            if (jumped == roots).all():
                return roots
            roots = jumped

    def groups(self) -> Dict[int, List[int]]:
        """root -> sorted members, for groups of two or more."""
        roots = self.roots()
        members = np.flatnonzero(roots != np.arange(len(roots)))
        members = members[np.argsort(roots[members], kind="stable")]
        out: Dict[int, List[int]] = {}
        for group in np.split(members, np.flatnonzero(np.diff(roots[members])) + 1) if len(members) else []:
            root = int(roots[group[0]])
            out[root] = [root] + group.tolist()
        return out
