import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.schemas.shards import packed_sequence_issues
from ember.tokenize.packing import (
    Segment,
    assemble,
    best_fit_decreasing,
    concat_and_chunk,
    locate,
    pack,
    window_count,
    window_of,
)
from ember.tokenize.shuffle import FeistelPermutation

STRATEGIES = ["best_fit", "concat_chunk"]


@st.composite
def corpora(draw):
    seq_len = draw(st.integers(1, 64))
    lengths = draw(st.lists(st.integers(1, 3 * seq_len + 5), max_size=60))
    return seq_len, lengths


def doc_tokens(lengths):
    """Every token of document d at index i is distinct: (d << 16) | i."""
    return [(np.arange(n, dtype=np.uint32) | np.uint32(d << 16)) for d, n in enumerate(lengths)]


@settings(max_examples=300, deadline=None)
@given(corpora(), st.sampled_from(STRATEGIES))
def test_no_token_is_lost_or_duplicated(corpus, strategy):
    seq_len, lengths = corpus
    packing = pack(lengths, seq_len, strategy)
    covered = Counter((p.doc, i) for pieces in packing.bins for p in pieces for i in range(p.start, p.end))
    assert set(covered) == {(d, i) for d, n in enumerate(lengths) for i in range(n)}
    assert set(covered.values()) <= {1}
    assert packing.tokens == sum(lengths)
    assert packing.padding_tokens == len(packing.bins) * seq_len - sum(lengths)


@settings(max_examples=300, deadline=None)
@given(corpora(), st.sampled_from(STRATEGIES), st.integers(0, 2**32 - 1))
def test_every_sequence_is_exactly_L_and_cu_seqlens_match_provenance(corpus, strategy, pad_id):
    seq_len, lengths = corpus
    tokens = doc_tokens(lengths)
    for pieces in pack(lengths, seq_len, strategy).bins:
        assert pieces and sum(p.length for p in pieces) <= seq_len
        row = assemble([Segment(f"d{p.doc}", p.start, p.end, tokens[p.doc][p.start : p.end]) for p in pieces], seq_len, pad_id)
        assert len(row.tokens) == seq_len and row.tokens.dtype == np.uint32
        assert packed_sequence_issues(row.tokens, row.cu_seqlens, row.segments, seq_len) == []
        for span, (segment, piece) in enumerate(zip(row.segments, pieces)):
            lo, hi = row.cu_seqlens[span], row.cu_seqlens[span + 1]
            assert (segment["doc_token_start"], segment["doc_token_end"]) == (piece.start, piece.end)
            np.testing.assert_array_equal(row.tokens[lo:hi], tokens[piece.doc][piece.start : piece.end])
            position = int(lo + (hi - lo) // 2)
            assert locate(row.cu_seqlens, row.segments, position) == (segment, piece.start + position - lo)
        assert np.all(row.tokens[row.cu_seqlens[-1] :] == pad_id)
        if row.cu_seqlens[-1] < seq_len:
            assert locate(row.cu_seqlens, row.segments, seq_len - 1) is None


@settings(max_examples=300, deadline=None)
@given(corpora())
def test_best_fit_splits_only_documents_longer_than_L(corpus):
    seq_len, lengths = corpus
    packing = best_fit_decreasing(lengths, seq_len)
    pieces_of = Counter(p.doc for pieces in packing.bins for p in pieces)
    for doc, n in enumerate(lengths):
        assert pieces_of[doc] == math.ceil(n / seq_len)
    assert packing.split_documents == sum(1 for n in lengths if n > seq_len)
    assert best_fit_decreasing(lengths, seq_len) == packing  # deterministic


@settings(max_examples=200, deadline=None)
@given(corpora())
def test_concat_and_chunk_uses_the_fewest_bins(corpus):
    seq_len, lengths = corpus
    packing = concat_and_chunk(lengths, seq_len)
    assert len(packing.bins) == math.ceil(sum(lengths) / seq_len)
    assert len(best_fit_decreasing(lengths, seq_len).bins) >= len(packing.bins)


def test_best_fit_decreasing_fills_the_tightest_bin_first():
    packing = best_fit_decreasing([6, 5, 4, 3, 2, 12], 10)
    layout = [[(p.doc, p.start, p.end) for p in b] for b in packing.bins]
    # pieces longest first: 6, 5, 4 (fills the 6-bin exactly), 3 and 2 (fill the 5-bin), the 12-doc remainder 2
    assert layout == [[(5, 0, 10)], [(0, 0, 6), (2, 0, 4)], [(1, 0, 5), (3, 0, 3), (4, 0, 2)], [(5, 10, 12)]]
    assert packing.padding_tokens == 8 and packing.split_documents == 1


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="have no tokens"):
        best_fit_decreasing([3, 0], 4)
    with pytest.raises(ValueError, match="unknown packing strategy"):
        pack([1], 4, "first_fit")
    with pytest.raises(ValueError, match="more than seq_len"):
        assemble([Segment("d", 0, 5, np.zeros(5, np.uint32))], 4, 0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3000), st.integers(0, 2**63 - 1))
def test_shuffle_is_a_permutation(n, seed):
    permutation = FeistelPermutation(n, seed)
    assert sorted(permutation(i) for i in range(n)) == list(range(n))


def test_shuffle_depends_on_the_seed_and_nothing_else():
    first = [FeistelPermutation(1000, 7)(i) for i in range(1000)]
    assert first == [FeistelPermutation(1000, 7)(i) for i in range(1000)]
    assert first != [FeistelPermutation(1000, 8)(i) for i in range(1000)]
    assert first != list(range(1000))
    with pytest.raises(IndexError):
        FeistelPermutation(10, 0)(10)


@given(st.text(min_size=1), st.integers(1, 500), st.integers(0, 2**63 - 1))
def test_window_assignment_is_in_range_and_stable(doc_id, windows, seed):
    assert 0 <= window_of(doc_id, windows, seed) < windows
    assert window_of(doc_id, windows, seed) == window_of(doc_id, windows, seed)


def test_window_count():
    assert [window_count(n, 10) for n in (0, 1, 10, 11, 100)] == [1, 1, 1, 2, 10]
