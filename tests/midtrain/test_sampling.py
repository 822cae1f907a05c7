"""Properties of the data-order math: exact blend, per-epoch shuffle, DP sharding and resume."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.midtrain.data import GlobalOrderSampler
from ember.midtrain.sampling import (
    Blend,
    EpochShuffle,
    apportion,
    blend_period_order,
    microbatch_positions,
    num_microbatches,
    upcoming_positions,
)

weights_st = st.lists(st.floats(min_value=0.01, max_value=100.0), min_size=1, max_size=7)


@settings(max_examples=60, deadline=None)
@given(weights=weights_st, period=st.integers(min_value=7, max_value=400))
def test_apportion_is_within_one_sample_of_the_quota(weights, period):
    quota = np.asarray(weights) / sum(weights) * period
    try:
        counts = apportion(weights, period)
    except ValueError as exc:  # only a source whose quota is below one sample can be starved
        assert "get no sample" in str(exc) and quota.min() < 1
        return
    assert counts.sum() == period
    assert np.all(np.abs(counts - quota) < 1)


def test_apportion_refuses_a_period_that_starves_a_source():
    with pytest.raises(ValueError, match=r"sources \[1, 2\] get no sample .* to at least 10000$"):
        apportion([99.0, 0.99, 0.01], 10)
    assert apportion([99.0, 0.99, 0.01], 10000).tolist() == [9900, 99, 1]


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(min_value=1, max_value=60), min_size=1, max_size=7), cycles=st.integers(1, 3))
def test_blend_is_exact_within_one_sample_per_source_in_every_window(counts, cycles):
    """Every prefix holds within one sample of each source's share, every period exactly its count."""
    blend = Blend.build([float(c) for c in counts], sum(counts))
    period = blend.period
    positions = np.arange(cycles * period)
    source, draw = blend.locate(positions)
    share = np.asarray(counts) / period
    taken = np.zeros(len(counts), dtype=np.int64)
    for g, s in enumerate(source, start=1):
        taken[s] += 1
        assert np.all(np.abs(taken - share * g) < 1), (g, taken, share * g)
    for c in range(cycles):
        window = source[c * period : (c + 1) * period]
        assert np.bincount(window, minlength=len(counts)).tolist() == counts
    # each source's draws are 0, 1, 2, ... in order: nothing skipped, nothing drawn twice
    for s in range(len(counts)):
        assert draw[source == s].tolist() == list(range(cycles * counts[s]))


def test_blend_order_for_a_dominant_source_interleaves_evenly():
    assert blend_period_order(np.array([7, 3])).tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]


chunks_st = st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=12)


@settings(max_examples=50, deadline=None)
@given(chunk_rows=chunks_st, window=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_each_epoch_is_a_permutation_read_window_by_window(chunk_rows, window, seed):
    shuffle = EpochShuffle(chunk_rows, seed=seed, source=0, window_chunks=window)
    n = sum(chunk_rows)
    bounds = np.cumsum([0, *chunk_rows])
    chunk_of = np.searchsorted(bounds, np.arange(n), side="right") - 1
    epochs = []
    for epoch in range(2):
        got = [shuffle.row(epoch * n + q) for q in range(n)]
        assert all(e == epoch for e, _ in got)
        rows = [r for _, r in got]
        assert sorted(rows) == list(range(n))
        epochs.append(rows)
        # window locality: the rows of each window come from at most `window` chunks
        chunk_order, _, window_bounds = shuffle._epoch(epoch)
        for w in range(len(window_bounds) - 1):
            members = {int(chunk_of[r]) for r in rows[window_bounds[w] : window_bounds[w + 1]]}
            assert members == set(chunk_order[w * window : (w + 1) * window].tolist())
    again = EpochShuffle(chunk_rows, seed=seed, source=0, window_chunks=window)
    assert [again.row(q)[1] for q in range(n)] == epochs[0]


def test_epochs_and_sources_shuffle_differently():
    a = EpochShuffle([8] * 8, seed=1, source=0, window_chunks=8)
    b = EpochShuffle([8] * 8, seed=1, source=1, window_chunks=8)
    first = [a.row(q)[1] for q in range(64)]
    assert first != [a.row(64 + q)[1] for q in range(64)]
    assert first != [b.row(q)[1] for q in range(64)]
    assert first != list(range(64))


def _consume(sampler: GlobalOrderSampler, steps: int) -> list[list[int]]:
    it = iter(sampler)
    return [next(it) for _ in range(steps)]


@settings(max_examples=60, deadline=None)
@given(
    mbs=st.integers(1, 4),
    dp_before=st.integers(1, 4),
    dp_after=st.integers(1, 4),
    micro_steps_before=st.integers(0, 6),
    total_micro=st.integers(1, 12),
)
def test_resume_with_a_different_dp_size_keeps_the_global_order(mbs, dp_before, dp_after, micro_steps_before, total_micro):
    """Positions trained before the restart (dp_before ranks) then after it (dp_after ranks) are
    exactly 0..N-1 in global order, each once, whatever the two DP sizes."""
    consumed_before = micro_steps_before * mbs * dp_before
    total = consumed_before + total_micro * mbs * dp_after
    trained: list[int] = []
    before = [_consume(GlobalOrderSampler(0, total, mbs, dp_before, r), micro_steps_before) for r in range(dp_before)]
    for step in range(micro_steps_before):
        trained += [p for r in range(dp_before) for p in before[r][step]]
    after = [list(GlobalOrderSampler(consumed_before, total, mbs, dp_after, r)) for r in range(dp_after)]
    assert {len(a) for a in after} == {total_micro}
    for step in range(total_micro):
        trained += [p for r in range(dp_after) for p in after[r][step]]
    assert trained == list(range(total))


def test_microbatch_positions_are_contiguous_rank_slices():
    assert [list(microbatch_positions(16, 2, 4, r)) for r in range(4)] == [[16, 17], [18, 19], [20, 21], [22, 23]]
    with pytest.raises(ValueError):
        microbatch_positions(0, 2, 4, 4)


def test_global_batch_must_split_over_dp_ranks():
    assert num_microbatches(32, 2, 4) == 4
    with pytest.raises(ValueError, match="not a multiple of micro_batch_size 2 x data-parallel size 3"):
        num_microbatches(32, 2, 3)


@settings(max_examples=80, deadline=None)
@given(
    mbs=st.integers(1, 4), dp=st.integers(1, 3), workers=st.integers(1, 3), consumed_steps=st.integers(0, 3),
    total_micro=st.integers(1, 10), count=st.integers(1, 30), data=st.data(),
)
def test_upcoming_positions_are_what_the_process_is_asked_for_next(mbs, dp, workers, consumed_steps, total_micro, count, data):
    """From any position a loader process reads, the plan is exactly its next reads in order: the
    sampler's micro-batches for this rank, dealt to `workers` processes in turn (torch's order)."""
    consumed = consumed_steps * mbs * dp
    total = consumed + total_micro * mbs * dp + data.draw(st.integers(0, mbs * dp - 1))  # a ragged tail is never read
    rank = data.draw(st.integers(0, dp - 1))
    batches = list(GlobalOrderSampler(consumed, total, mbs, dp, rank))
    worker = data.draw(st.integers(0, min(workers, len(batches)) - 1))
    reads = [p for batch in batches[worker::workers] for p in batch]
    i = data.draw(st.integers(0, len(reads) - 1))
    plan = upcoming_positions(consumed, total, mbs, dp, rank, position=reads[i], count=count, num_workers=workers)
    assert plan == reads[i : i + count]
    outside = total + 5 if data.draw(st.booleans()) else consumed + ((rank + 1) % dp) * mbs if dp > 1 else total
    assert upcoming_positions(consumed, total, mbs, dp, rank, position=outside, count=count, num_workers=workers) == [outside]


@settings(max_examples=40, deadline=None)
@given(chunk_rows=chunks_st, window=st.integers(1, 20), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_rows_of_many_draws_are_the_rows_of_each(chunk_rows, window, seed, data):
    shuffle = EpochShuffle(chunk_rows, seed=seed, source=3, window_chunks=window)
    draws = data.draw(st.lists(st.integers(0, 3 * sum(chunk_rows) - 1), min_size=1, max_size=40))
    epochs, rows = shuffle.rows_of(np.asarray(draws))
    assert list(zip(epochs.tolist(), rows.tolist())) == [shuffle.row(d) for d in draws]
