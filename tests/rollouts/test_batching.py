"""Token-budget packing and TrainBatch assembly."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.rollouts.batching import (
    ScoredRollout,
    batch_id_for,
    build_train_batch,
    plan_batches,
    position_ids,
    split_by_budget,
)
from ember.rollouts.simulate import synthetic_rollout
from ember.schemas import SourceOffset


@given(
    st.lists(st.tuples(st.integers(1, 300), st.sampled_from(["a", "b"])), max_size=40),
    st.integers(50, 256),
    st.floats(0.1, 1.0),
    st.booleans(),
)
def test_plan_uses_every_group_once_within_budget(items, budget, min_fill, flush):
    sizes = [s for s, _ in items]
    keys = [k for _, k in items]
    emit, waiting = plan_batches(sizes, budget, min_fill=min_fill, flush=flush, keys=keys)
    used = [i for b in emit for i in b] + waiting
    assert sorted(used) == list(range(len(sizes)))
    for bin_ in emit:
        total = sum(sizes[i] for i in bin_)
        assert bin_ == sorted(bin_)
        assert len({keys[i] for i in bin_}) == 1
        assert total <= budget or len(bin_) == 1
        assert flush or total >= min_fill * budget
    if flush:
        assert waiting == []
    for i in waiting:
        assert sizes[i] <= budget


def test_plan_first_fit_keeps_arrival_order_and_waits_for_fill():
    emit, waiting = plan_batches([60, 50, 40, 30], 100, min_fill=0.9)
    assert emit == [[0, 2]] and waiting == [1, 3]
    emit, waiting = plan_batches([10, 20], 100, min_fill=0.9)
    assert emit == [] and waiting == [0, 1]
    emit, waiting = plan_batches([10, 20], 100, min_fill=0.9, flush=True)
    assert emit == [[0, 1]] and waiting == []


def test_oversized_group_gets_its_own_bin():
    emit, waiting = plan_batches([500, 20], 100, min_fill=1.0)
    assert emit == [[0]] and waiting == [1]


@given(st.lists(st.integers(1, 64), min_size=1, max_size=50), st.integers(64, 200))
def test_split_by_budget_is_consecutive_and_bounded(lengths, budget):
    chunks = split_by_budget(lengths, budget)
    assert [i for c in chunks for i in c] == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in c) <= budget for c in chunks)


def test_split_rejects_a_sequence_over_budget():
    with pytest.raises(ValueError, match="over the 10-token budget"):
        split_by_budget([5, 11], 10)


def _sequences(lengths, layers=2):
    rng = np.random.default_rng(7)
    return [
        ScoredRollout(
            synthetic_rollout(rng, group_id="g", prompt_id="p", num_tokens=n, prompt_tokens=4, layers=layers, top_k=2, policy_version=3 + i),
            advantage=float(i) - 1.0,
        )
        for i, n in enumerate(lengths)
    ]


def test_build_train_batch_packs_with_boundaries_and_masked_advantages():
    seqs = _sequences([16, 40, 24])
    offsets = [SourceOffset("x.rollouts", 0, 10, 13)]
    batch = build_train_batch(seqs, step=4, source_offsets=offsets, created_at_us=123).validate()
    np.testing.assert_array_equal(batch.cu_seqlens, [0, 16, 56, 80])
    assert batch.rollout_ids == [s.rollout.rollout_id for s in seqs]
    np.testing.assert_array_equal(batch.policy_versions, [3, 4, 5])
    assert batch.routed_experts.shape == (80, 2, 2)
    for i, seq in enumerate(seqs):
        lo, hi = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
        np.testing.assert_array_equal(batch.tokens[lo:hi], seq.rollout.tokens)
        np.testing.assert_array_equal(batch.routed_experts[lo:hi], seq.rollout.routed_experts)
        expected = np.where(seq.rollout.loss_mask == 1, seq.advantage, 0.0)
        np.testing.assert_array_equal(batch.advantages[lo:hi], expected.astype(np.float32))
    assert batch.batch_id == batch_id_for(batch.rollout_ids)
    assert batch.source_offsets == offsets and batch.step == 4


def test_batches_with_different_expert_layouts_are_refused():
    mixed = _sequences([16], layers=2) + _sequences([16], layers=3)
    with pytest.raises(ValueError, match="routed-expert layouts"):
        build_train_batch(mixed, step=0, source_offsets=[], created_at_us=0)


def test_batch_id_depends_on_content_and_order():
    assert batch_id_for(["a", "b"]) == batch_id_for(["a", "b"])
    assert batch_id_for(["a", "b"]) != batch_id_for(["b", "a"])
    assert batch_id_for(["ab"]) != batch_id_for(["a", "b"])


def test_position_ids_restart_per_sequence():
    np.testing.assert_array_equal(position_ids(np.array([0, 3, 5, 6])), [0, 1, 2, 0, 1, 0])
