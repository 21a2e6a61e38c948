"""Throughput and memory of the data-collection stages, and the MinHash dedup side by side with
datasketch's MinHashLSH.

    python bench/data_collection.py [--articles 3000] [--dedup-docs 20000] [--workers N] [--quick]

Each stage (tools/data_collection/*.py) runs as a child process on synthetic input it writes
first (synthetic.py: a MediaWiki dump of --articles articles, and 10x that; the stages after
extraction read what the one before wrote). Printed per stage: MB of input per second with 1
worker (per process) and with --workers (default: all cores), and the peak resident set of the
run (VmRSS sampled from /proc every 50 ms: the largest process, and the sum over the run's
processes) at 1x and at 10x the input, to show memory stays flat as the input grows.

Dedup comparison: on a corpus with planted near-duplicates (--dedup-docs documents of 200 words,
a fifth of them near-copies with 0-40 words changed), our MinHash LSH (in-process, 1 worker, and
--workers processes) and datasketch's MinHash + MinHashLSH with the same settings (128
permutations, word 5-shingles, threshold 0.8, the same LSH weighting: ours' default 0.1/0.9, then
datasketch's 0.5/0.5; candidates verified by the signatures' estimated Jaccard in both) are
timed, in documents/s; printed: the pairs each finds, their agreement, and
recall of the planted pairs with true Jaccard >= 0.9 and the rate at which pairs <= 0.5 are
flagged. datasketch is a bench-only dependency (pip install datasketch); without it that part
says so and is skipped. Prints what it measured; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.data_collection import dedup, minhash, synthetic  # noqa: E402

TOOLS = os.path.join(ROOT, "tools", "data_collection")


def _children(pid: int):
    """Child pids of pid, through every thread's /proc/PID/task/TID/children (Linux)."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _tree_rss(pid: int):
    """(largest VmRSS of one process, sum of VmRSS) over pid and its descendants, in bytes.
    Forked workers share their parent's pages, so the sum over-counts."""
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [c for p in frontier for c in _children(p)]
        tree += frontier
    sizes = []
    for p in tree:
        try:
            with open(f"/proc/{p}/status") as f:
                sizes += [int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")]
        except OSError:
            pass
    return (max(sizes), sum(sizes)) if sizes else (0, 0)


def run_measured(argv):
    """Run argv; (wall seconds, peak RSS of its largest process, peak RSS summed over its process
    tree), sampled from /proc every 50 ms. (ru_maxrss is no use here: a child started by fork+exec
    carries the parent's high-water mark across exec.)"""
    start = time.perf_counter()
    child = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_one = peak_sum = 0
    while child.poll() is None:
        one, total = _tree_rss(child.pid)
        peak_one, peak_sum = max(peak_one, one), max(peak_sum, total)
        time.sleep(0.05)
    wall = time.perf_counter() - start
    err = child.stderr.read().decode()
    child.stderr.close()
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{err}")
    return wall, peak_one, peak_sum


def stage_commands(scratch: str, tag: str, dump: str, workers: int, lambada: str):
    """(name, input file, argv) of each stage, each reading what the previous one wrote."""
    py = sys.executable
    d = os.path.join(scratch, tag)
    os.makedirs(d, exist_ok=True)
    return [
        ("extract_wikipedia", dump, [py, os.path.join(TOOLS, "extract_wikipedia.py"), "--input", dump, "--output",
                                     f"{d}/wiki.jsonl", "--workers", str(workers), "--split-sentences", "regex"]),
        ("cleanup", f"{d}/wiki.jsonl", [py, os.path.join(TOOLS, "cleanup.py"), "--input", f"{d}/wiki.jsonl", "--output",
                                        f"{d}/clean.jsonl", "--no-url-filter", "--min-words", "50",
                                        "--workers", str(workers)]),
        ("dedup", f"{d}/clean.jsonl", [py, os.path.join(TOOLS, "dedup.py"), "run", "--input", f"{d}/clean.jsonl",
                                       "--output-dir", f"{d}/dedup", "--workers", str(workers)]),
        ("decontaminate", f"{d}/dedup/clean.jsonl", [py, os.path.join(TOOLS, "decontaminate.py"), "--input",
                                                     f"{d}/dedup/clean.jsonl", "--output", f"{d}/final.jsonl",
                                                     "--task", f"LAMBADA:{lambada}", "--workers", str(workers)]),
    ]


def bench_stages(scratch: str, articles: int, workers: int) -> None:
    lambada = os.path.join(scratch, "lambada.jsonl")
    rng = synthetic.random.Random(9)
    with open(lambada, "w") as f:
        for _ in range(500):
            f.write(json.dumps({"text": synthetic.paragraph(rng, 4)}) + "\n")
    results = {}
    for scale in (1, 10):
        dump = os.path.join(scratch, f"dump{scale}.xml")
        synthetic.write_dump(dump, articles * scale, seed=scale, copies=articles * scale // 20)
        runs = [(1, f"x{scale}w1")] if scale == 1 else []
        runs.append((workers, f"x{scale}w{workers}"))
        for w, tag in runs:
            for name, source, argv in stage_commands(scratch, tag, dump, w, lambada):
                size = os.path.getsize(source)
                wall, rss, rss_sum = run_measured(argv)
                results[(name, scale, w)] = (size, wall, rss, rss_sum)
    print(f"\n== stages (synthetic Wikipedia: {articles} articles at 1x, {10 * articles} at 10x; "
          f"{os.cpu_count()} cores; wall time of the whole child, start-up included)")
    print(f"{'stage':<18} {'input 1x':>9} {'MB/s 1 proc':>12} {f'MB/s {workers} procs':>14} "
          f"{'peak RSS 1x':>16} {'input 10x':>10} {'MB/s 10x':>9} {'peak RSS 10x':>16}")
    mb = 1024 * 1024
    for name in ("extract_wikipedia", "cleanup", "dedup", "decontaminate"):
        s1, t1, _, _ = results[(name, 1, 1)]
        _, tw, rw, rws = results[(name, 1, workers)]
        s10, t10, r10, r10s = results[(name, 10, workers)]
        print(f"{name:<18} {s1 / mb:>7.1f}MB {s1 / mb / t1:>12.2f} {s1 / mb / tw:>14.2f} "
              f"{f'{rw / mb:.0f}/{rws / mb:.0f}MB':>16} {s10 / mb:>8.1f}MB {s10 / mb / t10:>9.2f} "
              f"{f'{r10 / mb:.0f}/{r10s / mb:.0f}MB':>16}")
    print("(peak RSS: of the largest process / summed over the run's processes, sampled every 50 ms, "
          f"with {workers} workers)")
    print("(extract_wikipedia reads uncompressed XML here; a .bz2 dump adds serial decompression in the main process)")


# ----------------------------------------------------------------------------- dedup vs datasketch


def true_jaccard(a: str, b: str) -> float:
    def shingles(text):
        w = minhash.normalise(text).split()
        return {tuple(w[i:i + 5]) for i in range(max(len(w) - 4, 1))}
    x, y = shingles(a), shingles(b)
    return len(x & y) / len(x | y)


def group_pairs(groups: minhash.UnionFind, n: int):
    """Set of (i, j) pairs in one group."""
    roots = groups.roots()
    pairs = set()
    for root in np.unique(roots):
        members = np.flatnonzero(roots == root).tolist()
        pairs.update((members[a], members[b]) for a in range(len(members)) for b in range(a + 1, len(members)))
    return pairs


def ours(texts, scratch: str, workers: int, threshold: float, weight: float):
    path = os.path.join(scratch, "dedup_corpus.jsonl")
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    start = time.perf_counter()
    settings = {"num_perm": 128, "shingle": "word", "shingle_size": 5, "seed": 1}
    dedup.compute_signatures(path, os.path.join(scratch, f"state{workers}"), settings, workers)
    groups, stats = dedup.find_duplicates(dedup.States([os.path.join(scratch, f"state{workers}")]), threshold,
                                          false_negative_weight=weight)
    return time.perf_counter() - start, groups


def theirs(texts, threshold: float, weight: float):
    from datasketch import MinHash, MinHashLSH

    start = time.perf_counter()
    lsh = MinHashLSH(threshold=threshold, num_perm=128, weights=(1 - weight, weight))
    sketches = []
    for k, text in enumerate(texts):
        w = minhash.normalise(text).split()
        m = MinHash(num_perm=128, seed=1)
        m.update_batch([" ".join(w[i:i + 5]).encode() for i in range(max(len(w) - 4, 1))])
        lsh.insert(k, m)
        sketches.append(m)
    groups = minhash.UnionFind(len(texts))
    for k, m in enumerate(sketches):
        for other in lsh.query(m):
            if other > k and m.jaccard(sketches[other]) >= threshold:
                groups.union_pairs([(k, other)])
    return time.perf_counter() - start, groups


def bench_dedup(scratch: str, docs: int, workers: int, weight: float, threshold: float = 0.8) -> None:
    texts, planted = synthetic.planted_corpus(docs - docs // 5, docs // 5, words=200, seed=11)
    similar = [p for p in planted if true_jaccard(texts[p[0]], texts[p[1]]) >= 0.9]
    dissimilar = [p for p in planted if true_jaccard(texts[p[0]], texts[p[1]]) <= 0.5]
    print(f"\n== dedup: {len(texts)} documents of 200 words, {len(planted)} planted near-copies "
          f"({len(similar)} with Jaccard >= 0.9, {len(dissimilar)} <= 0.5); 128 permutations, word 5-shingles, "
          f"threshold {threshold}, LSH weights (false positive, false negative) = ({1 - weight:.1f}, {weight:.1f}) "
          f"in both, bands x rows {minhash.optimal_bands(threshold, 128, 1 - weight, weight)}")
    rows = []
    for w in sorted({1, workers}):
        seconds, groups = ours(texts, scratch, w, threshold, weight)
        rows.append((f"ours, {w} worker{'s' if w > 1 else ''}", seconds, group_pairs(groups, len(texts))))
    try:
        import datasketch  # noqa: F401
    except ImportError:
        print("datasketch is not installed (a bench-only dependency: pip install datasketch); comparison skipped")
    else:
        seconds, groups = theirs(texts, threshold, weight)
        rows.append((f"datasketch {datasketch.__version__}, 1 process", seconds, group_pairs(groups, len(texts))))
    for name, seconds, pairs in rows:
        recall = sum(p in pairs for p in similar) / max(len(similar), 1)
        flagged = sum(p in pairs for p in dissimilar) / max(len(dissimilar), 1)
        print(f"{name:<28} {len(texts) / seconds:>9.0f} docs/s ({seconds:6.2f} s)  pairs found {len(pairs):>6}  "
              f"recall(J>=0.9) {recall:.3f}  flagged(J<=0.5) {flagged:.4f}")
    if len(rows) > 2 or (len(rows) == 2 and rows[-1][0].startswith("datasketch")):
        ours_pairs, their_pairs = rows[0][2], rows[-1][2]
        both, either = ours_pairs & their_pairs, ours_pairs | their_pairs
        differing = sorted(either - both)
        near = sum(abs(true_jaccard(texts[i], texts[j]) - threshold) <= 0.1 for i, j in differing)
        print(f"agreement: {len(both)} pairs found by both, {len(ours_pairs - their_pairs)} only by ours, "
              f"{len(their_pairs - ours_pairs)} only by datasketch; {near} of the {len(differing)} differing pairs "
              f"have a true Jaccard within 0.1 of the threshold (3 standard errors of a 128-value estimate: "
              f"sampling error)")
        print(f"speed: ours (1 worker) {rows[-1][1] / rows[0][1]:.1f}x datasketch's documents/s; "
              f"ours ({workers} workers) {rows[-1][1] / rows[1 if len(rows) > 2 else 0][1]:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--articles", type=int, default=3000, help="Articles of the 1x dump")
    parser.add_argument("--dedup-docs", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="Tiny sizes: a smoke test of the bench itself")
    parser.add_argument("--skip-stages", action="store_true")
    parser.add_argument("--false-negative-weight", type=float, nargs="+", default=[dedup.FALSE_NEGATIVE_WEIGHT, 0.5],
                        help="LSH weightings to compare at (ours' default, then datasketch's)")
    args = parser.parse_args()
    if args.quick:
        args.articles, args.dedup_docs = 100, 1000
    print(f"bench/data_collection.py: Python {platform.python_version()}, numpy {np.__version__}, "
          f"{os.cpu_count()} cores, --workers {args.workers}")
    with tempfile.TemporaryDirectory(prefix="bench-data-collection-") as scratch:
        if not args.skip_stages:
            bench_stages(scratch, args.articles, args.workers)
        for weight in args.false_negative_weight:
            bench_dedup(scratch, args.dedup_docs, args.workers, weight)


if __name__ == "__main__":
    main()
