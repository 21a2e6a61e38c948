"""Find and remove exact and near-duplicate documents (MinHash LSH) across loose-JSON files.

One step, for files that fit one run:

    python tools/data_collection/dedup.py run --input a.jsonl b.jsonl --output-dir deduped \
        --workers 8 [--threshold 0.8 --num-perm 128 --shingle word --shingle-size 5]

or three, so that signatures of many files can be computed on different machines and merged:

    dedup.py signatures --input a.jsonl --state state/a --workers 8      # per file, anywhere
    dedup.py find --state state/a state/b --output dups                   # all states at once
    dedup.py remove --state state/a state/b --duplicates dups --output-dir deduped

State files are plain: `STATE.json` (input path, size, settings, document count),
`STATE.minhash.npy` (uint32 [docs, num_perm]), `STATE.exact.npy` (uint64 [docs]: blake2b of the
normalised text) and `STATE.lines.npy` (int64 line numbers); `find` writes `DUPS.json` (the
groups, each [[state, line], ...] with the kept document first, and counts) and
`DUPS.drop.npy` (int64 global indices of the dropped documents: the states' documents in
order). Everything is loaded with allow_pickle=False.

Duplicates: documents with equal normalised text (lower-case words; see minhash.py), and pairs
whose MinHash signatures share a band and whose Jaccard similarity of shingle sets is at least
--threshold: estimated from the signatures (--verify signatures, the default: no second read),
or computed exactly from the shingle sets of the candidates, re-read (--verify shingles).
Groups are the connected components of those pairs; the first document of a group (in file
order) is kept, the others dropped.

Memory: `signatures` streams (a batch of documents per worker); `find` memory-maps the
signatures and holds 8 bytes per document per band while bucketing, plus the candidate pairs;
`remove` streams.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.data_collection import minhash
from tools.data_collection.common import (DataCollectionError, Line, atomic_output, atomic_write_json, batched,
                                          check_inputs, numbered_lines, ordered_map, parse_document, positive_int,
                                          run_tool)
from tools.data_collection.npy_stream import NpyRowWriter

STATE_FORMAT = 1
# Every candidate pair is verified, so a false positive of the banding costs one comparison and a
# false negative a missed duplicate: the bands favour recall. At threshold 0.8 and 128 values this
# picks 14 bands of 9 rows: a pair at J = 0.9 is a candidate with probability 0.999, at 0.5 with
# 0.027 (datasketch's default weights 0.5/0.5 pick 9 x 13: 0.93 at J = 0.9).
FALSE_NEGATIVE_WEIGHT = 0.9
VERIFY_HELP = ("How candidate pairs are verified: the Jaccard similarity estimated from their signatures "
               "(default), or the true one of their shingle sets (re-reads the candidates' documents)")
SETTINGS = ("num_perm", "shingle", "shingle_size", "seed")


# ----------------------------------------------------------------------------- signatures


def _signature_batch(lines: List[Line], path: str, hasher: minhash.MinHasher) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    normalised, numbers = [], []
    for number, raw in lines:
        normalised.append(minhash.normalise(parse_document(path, number, raw)["text"]))
        numbers.append(number)
    exact = np.array([minhash.exact_hash(t) for t in normalised], np.uint64)
    return np.array(numbers, np.int64), exact, hasher.signatures(normalised)


def compute_signatures(path: str, state: str, settings: dict, workers: int, batch_size: int = 64) -> dict:
    """Write STATE.{minhash,exact,lines}.npy and STATE.json for one input file."""
    hasher = minhash.MinHasher(settings["num_perm"], settings["seed"], settings["shingle"], settings["shingle_size"])
    writers = [NpyRowWriter(state + ".lines.npy", np.int64), NpyRowWriter(state + ".exact.npy", np.uint64),
               NpyRowWriter(state + ".minhash.npy", np.uint32, (settings["num_perm"],))]
    start = time.time()
    try:
        work = functools.partial(_signature_batch, path=path, hasher=hasher)
        for arrays in ordered_map(work, batched(numbered_lines(path), batch_size), workers):
            for writer, array in zip(writers, arrays):
                writer.append(array)
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    for writer in writers:
        writer.close()
    meta = {"format": STATE_FORMAT, "input": os.path.abspath(path), "input_bytes": os.path.getsize(path),
            "documents": writers[0].rows, **{key: settings[key] for key in SETTINGS},
            "seconds": round(time.time() - start, 3)}
    atomic_write_json(state + ".json", meta)  # written last: a state without its .json is incomplete
    return meta


# ----------------------------------------------------------------------------- find


class States:
    """The state files of a run, in order, memory-mapped; global index = position over all of them."""

    def __init__(self, prefixes: Sequence[str]) -> None:
        self.prefixes = list(prefixes)
        self.meta = [self._read_meta(p) for p in self.prefixes]
        first = self.meta[0]
        for prefix, meta in zip(self.prefixes, self.meta):
            differing = [key for key in SETTINGS if meta.get(key) != first.get(key)]
            if differing:
                raise DataCollectionError(f"--state {prefix}: its {', '.join(differing)} differ from those of "
                                          f"{self.prefixes[0]} (signatures must share every setting to be compared)")
        self.minhash = [self._load(p, ".minhash.npy", np.uint32, (m["documents"], first["num_perm"]))
                        for p, m in zip(self.prefixes, self.meta)]
        self.offsets = np.cumsum([0] + [m["documents"] for m in self.meta])
        self.total = int(self.offsets[-1])

    @staticmethod
    def _read_meta(prefix: str) -> dict:
        try:
            with open(prefix + ".json", encoding="utf-8") as f:
                meta = json.load(f)
        except FileNotFoundError:
            raise DataCollectionError(f"--state {prefix}: no {prefix}.json (run `dedup.py signatures` first, "
                                      "or it did not finish)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise DataCollectionError(f"--state {prefix}.json: not valid JSON ({error})") from None
        if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
            raise DataCollectionError(f"--state {prefix}.json: not a dedup state of format {STATE_FORMAT}")
        return meta

    @staticmethod
    def _load(prefix: str, suffix: str, dtype, shape: tuple) -> np.ndarray:
        path = prefix + suffix
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as error:
            raise DataCollectionError(f"--state {path}: {getattr(error, 'strerror', None) or error}") from None
        if array.dtype != dtype or array.shape != shape:
            raise DataCollectionError(f"--state {path}: {array.dtype} {array.shape}, expected {np.dtype(dtype)} {shape}")
        return array

    def load(self, suffix: str, dtype) -> List[np.ndarray]:
        return [self._load(p, suffix, dtype, (m["documents"],)) for p, m in zip(self.prefixes, self.meta)]

    def signatures_of(self, ids: np.ndarray) -> np.ndarray:
        """uint32 [len(ids), num_perm] of global ids."""
        out = np.empty((len(ids), self.meta[0]["num_perm"]), np.uint32)
        which = np.searchsorted(self.offsets, ids, side="right") - 1
        for k in np.unique(which):
            mask = which == k
            out[mask] = self.minhash[k][ids[mask] - self.offsets[k]]
        return out


def shingle_jaccard(states: States, pairs: np.ndarray) -> np.ndarray:
    """The true Jaccard similarity of each pair's shingle sets (64-bit shingle hashes), the
    documents re-read from the states' inputs: only those in a pair are kept in memory."""
    meta = states.meta[0]
    wanted = np.unique(pairs)
    shingles = {}
    for k, state_meta in enumerate(states.meta):
        path = state_meta["input"]
        check_inputs([path], "--state input")
        if os.path.getsize(path) != state_meta["input_bytes"]:
            raise DataCollectionError(f"{path}: changed since its signatures were computed")
        local = wanted[(wanted >= states.offsets[k]) & (wanted < states.offsets[k + 1])] - states.offsets[k]
        lines = states.load(".lines.npy", np.int64)[k]
        by_line = {int(lines[i]): int(i + states.offsets[k]) for i in local}
        for number, raw in numbered_lines(path):
            if number in by_line:
                text = minhash.normalise(parse_document(path, number, raw)["text"])
                shingles[by_line[number]] = np.unique(minhash.span_hashes(text, meta["shingle"], meta["shingle_size"]))
    out = np.zeros(len(pairs))
    for p, (i, j) in enumerate(pairs.tolist()):
        a, b = shingles[i], shingles[j]
        common = len(np.intersect1d(a, b, assume_unique=True))
        out[p] = common / max(len(a) + len(b) - common, 1)
    return out


def find_duplicates(states: States, threshold: float, verify: str = "signatures",
                    false_negative_weight: float = FALSE_NEGATIVE_WEIGHT) -> Tuple[minhash.UnionFind, dict]:
    """Union-find over the states' documents joined by exact and near-duplicate pairs; verify:
    "signatures" (the estimated Jaccard) or "shingles" (the true one, re-reading the inputs)."""
    num_perm = states.meta[0]["num_perm"]
    bands, rows = minhash.optimal_bands(threshold, num_perm, 1.0 - false_negative_weight, false_negative_weight)
    groups = minhash.UnionFind(states.total)
    stats = {"documents": states.total, "bands": bands, "rows": rows, "verify": verify,
             "false_negative_weight": false_negative_weight}

    exact = np.concatenate(states.load(".exact.npy", np.uint64)) if states.total else np.zeros(0, np.uint64)
    exact_pairs = minhash.unique_pairs(minhash.bucket_pairs(exact, np.arange(states.total, dtype=np.int64),
                                                             max_all_pairs=2))
    groups.union_pairs(exact_pairs)
    stats["exact_pairs"] = len(exact_pairs)
    del exact

    candidates = []
    for band in range(bands):
        keys, ids = [], []
        for k, signatures in enumerate(states.minhash):
            nonempty = signatures[:, 0] != minhash.EMPTY  # texts without words are never near-duplicates
            keys.append(minhash.band_keys(signatures, band, rows)[nonempty])
            ids.append(np.flatnonzero(nonempty) + states.offsets[k])
        if keys:
            candidates.append(minhash.bucket_pairs(np.concatenate(keys), np.concatenate(ids).astype(np.int64)))
    pairs = minhash.unique_pairs(np.concatenate(candidates) if candidates else np.zeros((0, 2), np.int64))
    if verify == "shingles":
        similarity = shingle_jaccard(states, pairs)
    else:
        similarity = minhash.estimated_jaccard(states.signatures_of, pairs)
    verified = pairs[similarity >= threshold]
    groups.union_pairs(verified)
    stats.update(candidate_pairs=len(pairs), verified_pairs=len(verified))
    return groups, stats


def write_duplicates(states: States, groups: minhash.UnionFind, stats: dict, output: str) -> np.ndarray:
    members = groups.groups()
    drop = np.array(sorted(i for group in members.values() for i in group[1:]), np.int64)
    lines = states.load(".lines.npy", np.int64)

    def ref(i: int) -> list:
        k = int(np.searchsorted(states.offsets, i, side="right") - 1)
        return [k, int(lines[k][i - states.offsets[k]])]

    report = {"states": [os.path.abspath(p) for p in states.prefixes], **stats, "groups": len(members),
              "dropped": len(drop), "group_members": [[ref(i) for i in group] for _, group in sorted(members.items())]}
    with atomic_output(output + ".drop.npy") as f:
        np.save(f, drop, allow_pickle=False)
    atomic_write_json(output + ".json", report)
    return drop


# ----------------------------------------------------------------------------- remove


def remove_duplicates(states: States, duplicates: str, output_dir: str) -> List[Tuple[str, int, int]]:
    """Copy each state's input to OUTPUT_DIR/NAME without its dropped lines; (output, kept, dropped)."""
    try:
        drop = np.load(duplicates + ".drop.npy", allow_pickle=False)
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or error
        raise DataCollectionError(f"--duplicates {duplicates}.drop.npy: {reason}") from None
    if drop.dtype != np.int64 or drop.ndim != 1 or (len(drop) and (drop.min() < 0 or drop.max() >= states.total)):
        raise DataCollectionError(f"--duplicates {duplicates}.drop.npy: not a list of document indices of these states")
    names = [os.path.basename(m["input"]) for m in states.meta]
    if len(set(names)) != len(names):
        raise DataCollectionError("--state: two inputs have the same file name; their outputs would collide")
    lines = states.load(".lines.npy", np.int64)
    results = []
    for k, meta in enumerate(states.meta):
        path = meta["input"]
        check_inputs([path], "--state input")
        if os.path.getsize(path) != meta["input_bytes"]:
            raise DataCollectionError(f"{path}: changed since its signatures were computed "
                                      f"({os.path.getsize(path)} bytes, was {meta['input_bytes']})")
        local = drop[(drop >= states.offsets[k]) & (drop < states.offsets[k + 1])] - states.offsets[k]
        dropped_lines = set(lines[k][local].tolist())
        output = os.path.join(output_dir, names[k])
        if os.path.abspath(output) == os.path.abspath(path):
            raise DataCollectionError(f"--output-dir {output_dir}: would overwrite the input {path}")
        kept = 0
        with atomic_output(output) as out:
            for number, raw in numbered_lines(path):
                if number not in dropped_lines:
                    out.write(raw if raw.endswith(b"\n") else raw + b"\n")
                    kept += 1
        results.append((output, kept, len(dropped_lines)))
    return results


# ----------------------------------------------------------------------------- main


def _add_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-perm", type=int, default=128, help="MinHash values per document")
    parser.add_argument("--shingle", choices=("word", "char"), default="word")
    parser.add_argument("--shingle-size", type=int, default=5, help="Words (or bytes) per shingle")
    parser.add_argument("--seed", type=int, default=1, help="Seed of the hash functions")
    parser.add_argument("--workers", type=int, default=1)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="signatures, find and remove in one go")
    run.add_argument("--input", nargs="+", required=True)
    run.add_argument("--output-dir", required=True, help="Deduplicated copies of the inputs, same names")
    run.add_argument("--threshold", type=float, default=0.8, help="Jaccard similarity of near-duplicates")
    run.add_argument("--verify", choices=("signatures", "shingles"), default="signatures", help=VERIFY_HELP)
    run.add_argument("--false-negative-weight", type=float, default=FALSE_NEGATIVE_WEIGHT,
                     help="Weight of missed pairs against extra candidates when choosing the LSH bands "
                          "(datasketch's default: 0.5)")
    _add_settings(run)
    signatures = sub.add_parser("signatures", help="MinHash and exact hashes of one file")
    signatures.add_argument("--input", required=True)
    signatures.add_argument("--state", required=True, help="Prefix of the state files to write")
    _add_settings(signatures)
    find = sub.add_parser("find", help="duplicate groups over state files")
    find.add_argument("--state", nargs="+", required=True)
    find.add_argument("--output", required=True, help="Prefix of OUTPUT.json and OUTPUT.drop.npy")
    find.add_argument("--threshold", type=float, default=0.8)
    find.add_argument("--verify", choices=("signatures", "shingles"), default="signatures", help=VERIFY_HELP)
    find.add_argument("--false-negative-weight", type=float, default=FALSE_NEGATIVE_WEIGHT,
                     help="Weight of missed pairs against extra candidates when choosing the LSH bands "
                          "(datasketch's default: 0.5)")
    remove = sub.add_parser("remove", help="copy the inputs without their duplicates")
    remove.add_argument("--state", nargs="+", required=True)
    remove.add_argument("--duplicates", required=True, help="The --output prefix of `find`")
    remove.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    if hasattr(args, "workers"):
        positive_int("--workers", args.workers)
        positive_int("--num-perm", args.num_perm)
        positive_int("--shingle-size", args.shingle_size)
    if hasattr(args, "threshold") and not 0.0 < args.threshold <= 1.0:
        raise DataCollectionError(f"--threshold must be in (0, 1], got {args.threshold}")
    if hasattr(args, "false_negative_weight") and not 0.0 < args.false_negative_weight < 1.0:
        raise DataCollectionError(f"--false-negative-weight must be in (0, 1), got {args.false_negative_weight}")
    return args


def main(argv: Optional[List[str]] = None) -> dict:
    args = get_args(argv)
    start = time.time()
    if args.command in ("run", "signatures"):
        inputs = args.input if isinstance(args.input, list) else [args.input]
        check_inputs(inputs)
        settings = {"num_perm": args.num_perm, "shingle": args.shingle, "shingle_size": args.shingle_size,
                    "seed": args.seed}
    if args.command == "signatures":
        meta = compute_signatures(args.input, args.state, settings, args.workers)
        print(f"dedup signatures: {meta['documents']} documents of {args.input} in {meta['seconds']:.2f} s -> "
              f"{args.state}.*", file=sys.stderr)
        return meta
    if args.command == "run":
        if len({os.path.basename(p) for p in inputs}) != len(inputs):
            raise DataCollectionError("--input: two inputs have the same file name; their outputs would collide")
        os.makedirs(args.output_dir, exist_ok=True)
        state_dir = os.path.join(args.output_dir, ".dedup-state")
        prefixes = [os.path.join(state_dir, f"{k}") for k in range(len(inputs))]
        try:
            for path, prefix in zip(inputs, prefixes):
                compute_signatures(path, prefix, settings, args.workers)
            return _find_and_remove(prefixes, args, os.path.join(state_dir, "duplicates"), args.output_dir, start)
        finally:
            for name in os.listdir(state_dir) if os.path.isdir(state_dir) else []:
                os.unlink(os.path.join(state_dir, name))
            if os.path.isdir(state_dir):
                os.rmdir(state_dir)
    states = States(args.state)
    if args.command == "find":
        groups, stats = find_duplicates(states, args.threshold, args.verify, args.false_negative_weight)
        drop = write_duplicates(states, groups, stats, args.output)
        print(f"dedup find: {len(drop)} of {states.total} documents are duplicates ({stats['exact_pairs']} exact "
              f"pairs, {stats['verified_pairs']} of {stats['candidate_pairs']} candidate pairs verified) -> "
              f"{args.output}.json", file=sys.stderr)
        return stats
    results = remove_duplicates(states, args.duplicates, args.output_dir)
    for output, kept, dropped in results:
        print(f"dedup remove: kept {kept}, dropped {dropped} -> {output}", file=sys.stderr)
    return {"outputs": results}


def _find_and_remove(prefixes: List[str], args: argparse.Namespace, duplicates: str, output_dir: str,
                     start: float) -> dict:
    states = States(prefixes)
    groups, stats = find_duplicates(states, args.threshold, args.verify, args.false_negative_weight)
    drop = write_duplicates(states, groups, stats, duplicates)
    with open(duplicates + ".json", encoding="utf-8") as f:
        report = json.load(f)
    results = remove_duplicates(states, duplicates, output_dir)
    report["states"] = [m["input"] for m in states.meta]  # the state folder is removed at the end
    report["seconds"] = round(time.time() - start, 3)
    atomic_write_json(os.path.join(output_dir, "dedup.report.json"), report)
    print(f"dedup: dropped {len(drop)} of {states.total} documents ({stats['exact_pairs']} exact pairs, "
          f"{stats['verified_pairs']} near-duplicate pairs) -> {output_dir}", file=sys.stderr)
    return {**stats, "dropped": len(drop), "outputs": results}


if __name__ == "__main__":
    run_tool(main, "dedup.py")
