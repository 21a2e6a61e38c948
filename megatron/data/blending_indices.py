"""Megatron-Core's blending indices, bit for bit, in vectorised numpy (no compiled helper).

Megatron-Core's C++ helpers build a blend greedily, one sample at a time:

    for n in 0, 1, ..., size - 1:
        t = max(n, 1)
        d = the first dataset maximising  error[d] = weights[d] * t - count[d]   (IEEE double)
        dataset_index[n], dataset_sample_index[n] = d, count[d];  count[d] += 1

`build_exhaustive_blending_indices` does the same with weights = sizes / sum(sizes) and drops a
dataset once it has given sizes[d] samples. Each step depends on the previous one, and the
choices are not a sort by any per-sample key, so the loop is reproduced as such, but for many
stretches of it at once:

* The steps are cut into blocks of B steps. Block j starts W steps early (a warm-up) from a
  plausible state, the counts a greedy run would roughly have there. The greedy forgets a wrong
  start quickly: two states that differ by one sample of one dataset typically reach the same
  state within a few steps, because the state with the extra sample lets that dataset's error
  fall behind until the other state catches up. So after the warm-up a block is almost always on
  the exact trajectory.
* All blocks step together: one step is a few numpy operations on [datasets, blocks] arrays,
  computing every error with the same two IEEE operations as the C++ loop (multiply, subtract),
  so that the choices are identical, ties and rounding included.
* Nothing is trusted: block 0 starts from the true state (all counts 0); block j + 1 is exact
  when block j is and both reach the same state where they overlap. A block that disagrees is
  run again from its predecessor's state, until every block agrees with the one before it.
  The result is therefore exact whatever the warm-up achieved; only the time depends on it.

    dataset_index         int16 [size]   which dataset each blended sample comes from
    dataset_sample_index  int64 [size]   the sample id within that dataset
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

# Blocks stepped together in one group (bounds the working arrays: datasets x GROUP values).
GROUP = 16384
# Steps whose samples are written out together (see _Blocks._run).
FLUSH = 64
# Datasets up to which the first maximal dataset is found through a lookup table of 2**D entries.
_LOOKUP_MAX_DATASETS = 16


def build_blending_indices(weights: Sequence[float], size: int, *, block: Optional[int] = None,
                           warmup: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron-Core's helpers.build_blending_indices(weights, size): the greedy blend of `size`
    samples. `weights` are used as given (Megatron-Core passes them normalised); block and warmup
    override the block geometry (for tests)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)):
        raise ValueError(f"blend weights must be a non-empty list of finite numbers, got {list(weights)}")
    return _greedy(w, int(size), None, block, warmup)


def build_exhaustive_blending_indices(sizes: Sequence[int], *, block: Optional[int] = None,
                                      warmup: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron-Core's helpers.build_exhaustive_blending_indices(sizes): every sample of every
    dataset exactly once, sizes[d] of dataset d, interleaved greedily in proportion to the sizes."""
    caps = np.asarray(sizes, dtype=np.int64)
    if caps.ndim != 1 or caps.size == 0 or np.any(caps <= 0):  # on a size of 0 the C++ loop runs past its arrays
        raise ValueError(f"dataset sizes must be a non-empty list of positive integers, got {list(sizes)}")
    total = int(caps.sum())
    w = caps.astype(np.float64) / float(total)  # as the C++ loop divides
    return _greedy(w, total, caps, block, warmup)


# ------------------------------------------------------------------------------------ stepping


class _Stepper:
    """The greedy step for K independent states at once (counts float64 [D, K], exact below 2**53).

    caps (exhaustive blends): a dataset that reached its cap gets the count +inf, so its error is
    -inf and it is never chosen again, as the C++ loop erases it from its set.
    """

    def __init__(self, w: np.ndarray, caps: Optional[np.ndarray]) -> None:
        self.w = w[:, None]  # [D, 1]
        self.caps = None if caps is None else caps.astype(np.float64)
        d = len(w)
        self.lookup = None
        if d <= _LOOKUP_MAX_DATASETS:
            # code (sum of 2**d over the maximal datasets) -> the first of them: the C++ loop's strict >
            codes = np.arange(1, 2 ** d)
            self.lookup = np.zeros(2 ** d, dtype=np.int64)
            self.lookup[1:] = np.log2(codes & -codes).astype(np.int64)
            self.bits = (2.0 ** np.arange(d)).astype(np.float32)[None, :]  # [1, D]

    def run(self, counts: np.ndarray, first_step: np.ndarray, steps: int, snapshot_at: Sequence[int],
            on_step: Callable[[int, np.ndarray, np.ndarray], None]) -> Dict[int, np.ndarray]:
        """Run `steps` steps from counts [D, K] (changed in place) at step numbers first_step [K].

        Calls on_step(s, dataset int16 [K], sample float64 [K]) after each step s (the arrays are
        reused: copy what you keep); returns {s: counts before step s} for s in snapshot_at.
        """
        d, k = counts.shape
        errors = np.empty((d, k))  # [D, K]
        best = np.empty(k)
        maximal = np.empty((d, k), dtype=np.float32)  # 1.0 where a dataset's error is the maximum
        code = np.empty(k, dtype=np.int64)
        flat = np.empty(k, dtype=np.int64)  # position of the chosen count in counts.reshape(-1)
        pick = np.empty(k, dtype=np.int16)
        sample = np.empty(k)
        column = np.arange(k)
        flat_counts = counts.reshape(-1)  # a view: counts is C-contiguous
        if self.lookup is not None:
            first_times_k = self.lookup * k  # code -> row offset of the first maximal dataset
            first_int16 = self.lookup.astype(np.int16)
        start = first_step.astype(np.float64)
        clamp_until = 2 if start.size and start.min() < 1 else 0  # the C++ loop's t = max(n, 1)
        t = np.empty(k)
        snapshots: Dict[int, np.ndarray] = {}
        marks = set(snapshot_at)
        with np.errstate(invalid="ignore"):  # past the end of an exhaustive blend every error is -inf
            for s in range(steps):
                if s in marks:
                    snapshots[s] = counts.copy()
                np.add(start, s, out=t)
                if s < clamp_until:
                    np.maximum(t, 1.0, out=t)
                np.multiply(self.w, t, out=errors)  # fl(w[d] * t)
                np.subtract(errors, counts, out=errors)  # fl(fl(w[d] * t) - count[d])
                if self.lookup is None:
                    np.copyto(pick, errors.argmax(axis=0), casting="unsafe")
                    np.multiply(pick, k, out=flat)
                else:
                    np.maximum.reduce(errors, axis=0, out=best)
                    np.equal(errors, best, out=maximal, casting="unsafe")
                    # sum of 2**d over the maximal datasets: exact in float32 (distinct powers of 2 below 2**16)
                    np.copyto(code, (self.bits @ maximal)[0], casting="unsafe")
                    np.take(first_int16, code, out=pick)
                    np.take(first_times_k, code, out=flat)
                flat += column
                np.take(flat_counts, flat, out=sample)
                on_step(s, pick, sample)
                sample += 1
                flat_counts[flat] = sample
                if self.caps is not None:  # erase the datasets that gave their last sample
                    flat_counts[flat[sample >= self.caps[pick]]] = np.inf
        if steps in marks:
            snapshots[steps] = counts.copy()
        return snapshots


# ------------------------------------------------------------------------------------ blocks


def _geometry(w: np.ndarray, size: int, block: Optional[int], warmup: Optional[int]) -> Tuple[int, int]:
    """(W, B): warm-up and block length. A dataset of weight w is chosen every 1/w steps, and a
    wrong start in its count takes about that long to wash out, so the warm-up spans the
    periods of all but very rare datasets (those are started low, see _plausible_counts)."""
    if warmup is None:
        common = w[w >= 1.0 / 4096]
        warmup = int(min(4096, max(128, math.ceil(2.0 / common.min())))) if common.size else 128
    if block is None:
        block = max(4 * warmup, min(8192, size // 2048))
    return int(warmup), int(max(block, warmup))


def _plausible_counts(w: np.ndarray, steps: np.ndarray, caps: Optional[np.ndarray], warmup: int) -> np.ndarray:
    """float64 [D, K]: counts near the greedy's at the given step numbers (any guess is safe).

    Largest remainders of w * n, except that a dataset chosen less often than once per warm-up
    gets floor(w * n) samples, the count it would have if chosen only when its error reaches 1:
    the greedy's own count is then rarely smaller, and a sample missing from the guess is picked
    up within a few steps, while an extra one would persist until the greedy chooses that
    dataset again, about 1 / w steps later.
    """
    n = steps.astype(np.float64)
    ideal = w[:, None] * n[None, :]  # [D, K]
    counts = np.floor(ideal)
    rare = w < 1.0 / warmup
    if rare.all():
        rare[:] = False
    # the n - sum(counts) samples still to hand out go to the common datasets with the largest remainders
    missing = (n - counts.sum(axis=0)).astype(np.int64)  # [K]
    remainder = np.where(rare[:, None], -np.inf, ideal - counts)
    rank = np.argsort(np.argsort(-remainder, axis=0, kind="stable"), axis=0, kind="stable")  # [D, K]
    common = int((~rare).sum())
    counts += ((missing // common)[None, :] + (rank < (missing % common)[None, :])) * (~rare)[:, None]
    if caps is not None:
        counts = np.where(counts >= caps[:, None], np.inf, counts)
    return np.ascontiguousarray(counts)


def _greedy(w: np.ndarray, size: int, caps: Optional[np.ndarray], block: Optional[int],
            warmup: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    if size < 0:
        raise ValueError(f"a blend needs a non-negative size, got {size}")
    d = len(w)
    if d >= np.iinfo(np.int16).max:
        raise ValueError(f"a blend holds at most {np.iinfo(np.int16).max - 1} datasets, got {d}")
    big_w, big_b = _geometry(w, size, block, warmup)
    if size <= 2 * (big_w + big_b):  # too short to cut: the loop itself (Python floats are IEEE doubles)
        return _sequential(w.tolist(), size, None if caps is None else caps.tolist())
    return _Blocks(_Stepper(w, caps), w, caps, size, big_w, big_b).build()


def _sequential(w: List[float], size: int, caps: Optional[List[int]]) -> Tuple[np.ndarray, np.ndarray]:
    """The C++ loop, one step at a time (for short blends)."""
    counts = [0] * len(w)
    order = range(len(w))
    index = np.empty(size, dtype=np.int16)
    sample = np.empty(size, dtype=np.int64)
    for n in range(size):
        t = float(max(n, 1))
        best, best_error = 0, -math.inf
        for d in order:
            error = w[d] * t - counts[d]
            if error > best_error and (caps is None or counts[d] < caps[d]):
                best, best_error = d, error
        index[n] = best
        sample[n] = counts[best]
        counts[best] += 1
    return index, sample


class _Blocks:
    """Block j runs steps [jB, jB + W + B) and owns the samples of steps [jB + W, (j + 1)B + W);
    block 0 also owns [0, W). It records its counts at step jB + W (where its samples start),
    (j + 1)B (where block j + 1 starts) and (j + 1)B + W (its end)."""

    def __init__(self, stepper: _Stepper, w: np.ndarray, caps: Optional[np.ndarray], size: int,
                 warmup: int, block: int) -> None:
        self.stepper, self.w, self.caps, self.size = stepper, w, caps, size
        self.W, self.B = warmup, block
        self.J = -(-(size - warmup) // block)
        length = warmup + self.J * block
        self.dataset_index = np.empty(length, dtype=np.int16)
        self.dataset_sample_index = np.empty(length, dtype=np.int64)
        # [J, B] views: row j holds the samples block j owns, so step s of every block of a run
        # is one column write (cache-friendly enough, and no transpose afterwards)
        self.index_by_block = self.dataset_index[warmup:].reshape(self.J, block)
        self.sample_by_block = self.dataset_sample_index[warmup:].reshape(self.J, block)
        d = len(w)
        self.at_own_start = np.empty((self.J, d))  # counts at step jB + W
        self.at_next_start = np.empty((self.J, d))  # counts at step (j + 1)B
        self.at_end = np.empty((self.J, d))  # counts at step (j + 1)B + W

    def build(self) -> Tuple[np.ndarray, np.ndarray]:
        """Both index arrays, exact: every block agrees with its predecessor where they overlap."""
        for begin in range(0, self.J, GROUP):
            blocks = np.arange(begin, min(self.J, begin + GROUP))
            counts = _plausible_counts(self.w, blocks * self.B, self.caps, self.W)
            if begin == 0:
                counts[:, 0] = 0.0  # the true start
            self._run(blocks, counts)
        suspects = np.arange(1, self.J)
        while suspects.size:
            wrong = suspects[np.any(self.at_end[suspects - 1] != self.at_own_start[suspects], axis=1)]
            for begin in range(0, len(wrong), GROUP):
                # start each disagreeing block from its predecessor's counts at its first step
                part = wrong[begin:begin + GROUP]
                self._run(part, np.ascontiguousarray(self.at_next_start[part - 1].T))
            suspects = np.unique(np.concatenate([wrong, wrong + 1]))
            suspects = suspects[suspects < self.J]
        return self.dataset_index[:self.size], self.dataset_sample_index[:self.size]

    def _run(self, blocks: np.ndarray, counts: np.ndarray) -> None:
        """Run `blocks` (ascending) from counts [D, K] at their first steps; store their samples."""
        warmup, steps = self.W, self.W + self.B
        rows = slice(int(blocks[0]), int(blocks[-1]) + 1) if blocks[-1] - blocks[0] + 1 == len(blocks) else blocks
        head = blocks[0] == 0  # block 0's warm-up is exact: its samples too
        # steps are gathered FLUSH at a time and written to the blocks' rows as [K, FLUSH] tiles:
        # one column per step would touch a page of every row at every step
        picks = np.empty((FLUSH, len(blocks)), dtype=np.int16)
        samples = np.empty((FLUSH, len(blocks)), dtype=np.int64)

        def store(s: int, pick: np.ndarray, sample: np.ndarray) -> None:
            if s < warmup:
                if head:
                    self.dataset_index[s] = pick[0]
                    self.dataset_sample_index[s] = sample[0]
                return
            row = (s - warmup) % FLUSH
            picks[row] = pick
            samples[row] = sample
            if row == FLUSH - 1 or s == steps - 1:
                first = s - warmup - row
                self.index_by_block[rows, first:first + row + 1] = picks[:row + 1].T
                self.sample_by_block[rows, first:first + row + 1] = samples[:row + 1].T

        snaps = self.stepper.run(counts, blocks * self.B, steps, (warmup, self.B, steps), store)
        self.at_own_start[blocks] = snaps[warmup].T
        self.at_next_start[blocks] = snaps[self.B].T
        self.at_end[blocks] = snaps[steps].T
