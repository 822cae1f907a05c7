"""The index math of the mid-training data order, as pure functions of (seed, sizes, weights).

Global sample position g is the only state training needs: it maps to a source by the blend, to
that source's k-th draw, to (epoch, position in epoch), and through the epoch's shuffle to one row.
A data-parallel rank reads the positions of its slice of each global micro-batch. Nothing depends
on the number of ranks, so resuming at position g with a different DP size continues the same
global order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


def apportion(weights: list[float], period: int) -> np.ndarray:
    """Integer draws per source in one blend period: largest remainder, each within one of w*period.

    Why: exact proportions need integer counts; a source that would get no draw at all is an
    error rather than silently dropped.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative, finite and not all zero, got {list(weights)}")
    if period < 1:
        raise ValueError(f"period must be >= 1, got {period}")
    quota = w / w.sum() * period
    counts = np.floor(quota).astype(np.int64)
    remainder = period - int(counts.sum())
    # Largest fractional part first; ties go to the earlier source so the result is deterministic.
    order = sorted(range(len(w)), key=lambda i: (-(quota[i] - counts[i]), i))
    for i in order[:remainder]:
        counts[i] += 1
    starved = [i for i in range(len(w)) if w[i] > 0 and counts[i] == 0]
    if starved:
        raise ValueError(
            f"sources {starved} get no sample in a blend period of {period}; raise data.blend_period "
            f"to at least {int(np.ceil(w.sum() / w[starved].min()))}"
        )
    return counts


def blend_period_order(counts: np.ndarray) -> np.ndarray:
    """Source of each position in one period, so that every prefix of length g holds within one
    sample of counts*g/period from each source (Tijdeman's chairman-assignment rule).

    Why: a plain stride/round-robin interleave can drift by several samples for a dominant source
    among many small ones; this rule provably stays below one.  Exact integer arithmetic keeps the
    order identical on every machine.
    """
    counts = [int(c) for c in counts]
    period = sum(counts)
    m = len(counts)
    order = np.empty(period, dtype=np.int32)
    if m == 1:
        order[:] = 0
        return order
    taken = [0] * m
    two_m1 = 2 * (m - 1)
    for g in range(1, period + 1):
        best = -1
        for s in range(m):
            # Eligible: the source's deficit counts[s]*g/period - taken[s] is at least 1/(2(m-1)).
            if counts[s] == 0 or two_m1 * (counts[s] * g - taken[s] * period) < period:
                continue
            # Deadline (taken + 1 - 1/(2(m-1))) / share, compared exactly by cross-multiplication.
            if best < 0 or (two_m1 * (taken[s] + 1) - 1) * counts[best] < (two_m1 * (taken[best] + 1) - 1) * counts[s]:
                best = s
        order[g - 1] = best
        taken[best] += 1
    return order


@dataclass(frozen=True)
class Blend:
    """Global position -> (source, that source's draw index), periodic with `period` positions."""

    counts: np.ndarray
    order: np.ndarray
    rank_in_period: np.ndarray

    @classmethod
    def build(cls, weights: list[float], period: int) -> "Blend":
        counts = apportion(weights, period)
        order = blend_period_order(counts)
        rank = np.empty_like(order)
        seen = np.zeros(len(counts), dtype=np.int64)
        for i, s in enumerate(order):
            rank[i] = seen[s]
            seen[s] += 1
        return cls(counts=counts, order=order, rank_in_period=rank)

    @property
    def period(self) -> int:
        return len(self.order)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, draw index within that source) for each global position."""
        positions = np.asarray(positions, dtype=np.int64)
        cycle, offset = np.divmod(positions, self.period)
        source = self.order[offset]
        return source, cycle * self.counts[source] + self.rank_in_period[offset]


def chunk_bounds(chunk_rows: list[int]) -> np.ndarray:
    """Start row of each chunk plus the total, from per-chunk row counts."""
    bounds = np.zeros(len(chunk_rows) + 1, dtype=np.int64)
    np.cumsum(chunk_rows, out=bounds[1:])
    return bounds


class EpochShuffle:
    """Seeded per-epoch permutation of one source's rows that keeps reads local.

    Why: shards are zstd record batches (chunks), so reading one row decompresses its chunk.  The
    epoch permutes whole chunks, then permutes rows within each window of `window_chunks`
    consecutive (permuted) chunks; a reader that caches `window_chunks` decoded chunks decodes
    each one once per epoch.  window_chunks >= number of chunks is a full uniform shuffle.
    Memory is O(chunks) per epoch plus O(window rows) per window, never O(rows).
    """

    def __init__(self, chunk_rows: list[int], seed: int, source: int, window_chunks: int):
        if not chunk_rows or min(chunk_rows) <= 0:
            raise ValueError("every chunk must hold at least one row")
        if window_chunks < 1:
            raise ValueError(f"window_chunks must be >= 1, got {window_chunks}")
        self.chunk_rows = np.asarray(chunk_rows, dtype=np.int64)
        self.bounds = chunk_bounds(chunk_rows)
        self.rows = int(self.bounds[-1])
        self.seed = seed
        self.source = source
        self.window_chunks = window_chunks
        self._epoch = lru_cache(maxsize=4)(self._epoch_layout)
        self._window = lru_cache(maxsize=64)(self._window_rows)

    def _epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.source, epoch])
        chunks = rng.permutation(len(self.chunk_rows))
        sizes = self.chunk_rows[chunks]
        windows = np.add.reduceat(sizes, np.arange(0, len(sizes), self.window_chunks))
        return chunks, chunk_bounds(sizes.tolist()), chunk_bounds(windows.tolist())

    def _window_rows(self, epoch: int, window: int) -> np.ndarray:
        chunks, _, _ = self._epoch(epoch)
        members = chunks[window * self.window_chunks : (window + 1) * self.window_chunks]
        rows = np.concatenate([np.arange(self.bounds[c], self.bounds[c + 1]) for c in members])
        return np.random.default_rng([self.seed, self.source, epoch, window + 1]).permutation(rows)

    def rows_of(self, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, source row) of many draws at once: `row` over an array, one lookup per window."""
        epochs, positions = np.divmod(np.asarray(draws, dtype=np.int64), self.rows)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            in_epoch = np.flatnonzero(epochs == epoch)
            _, _, window_bounds = self._epoch(int(epoch))
            windows = np.searchsorted(window_bounds, positions[in_epoch], side="right") - 1
            for window in np.unique(windows):
                at = in_epoch[windows == window]
                out[at] = self._window(int(epoch), int(window))[positions[at] - window_bounds[window]]
        return epochs, out

    def row(self, draw: int) -> tuple[int, int]:
        """(epoch, source row) of this source's `draw`-th sample; epochs follow each other."""
        epoch, position = divmod(int(draw), self.rows)
        _, _, window_bounds = self._epoch(epoch)
        window = int(np.searchsorted(window_bounds, position, side="right")) - 1
        return epoch, int(self._window(epoch, window)[position - window_bounds[window]])


def microbatch_positions(consumed: int, micro_batch_size: int, dp_size: int, dp_rank: int) -> range:
    """Global positions one DP rank reads for the global micro-batch that starts at `consumed`.

    Why: a global micro-batch is `micro_batch_size * dp_size` consecutive positions and rank r takes
    the r-th contiguous slice (Megatron's pretraining sampler), so the union over ranks is always
    the next block of the global order whatever the DP size.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
    start = consumed + dp_rank * micro_batch_size
    return range(start, start + micro_batch_size)


def upcoming_positions(
    consumed: int, total: int, micro_batch_size: int, dp_size: int, dp_rank: int, *,
    position: int, count: int, num_workers: int = 1,
) -> list[int]:
    """The next `count` positions one loader process will be asked for, from `position` on.

    Why: the read order is a deterministic function of the sampler, so a reader can fetch ahead
    exactly what it will need. Rank `dp_rank` reads its slice of each global micro-batch from
    `consumed` on; torch hands a rank's micro-batches to its `num_workers` worker processes in
    turn, so the process that reads `position` then reads every `num_workers`-th micro-batch after
    the one holding it. A position outside this rank's slices plans nothing beyond itself.
    """
    step = micro_batch_size * dp_size
    first = consumed + dp_rank * micro_batch_size
    batch, within = divmod(position - first, step)
    if position < first or within >= micro_batch_size or consumed + batch * step > total - step:
        return [position]
    out = list(range(position, first + batch * step + micro_batch_size))
    batch += max(1, num_workers)
    while len(out) < count and consumed + batch * step <= total - step:
        start = first + batch * step
        out.extend(range(start, start + micro_batch_size))
        batch += max(1, num_workers)
    return out[:count]


def num_microbatches(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per step on each rank; the global batch must split evenly over DP ranks."""
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size {micro_batch_size} "
            f"x data-parallel size {dp_size}"
        )
    return global_batch_size // per_step
