"""Advantage estimators and reward shaping: known values plus properties over random groups."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.rollouts.advantages import (
    Estimator,
    combine_reward,
    dr_grpo_advantages,
    group_advantages,
    grpo_advantages,
    is_zero_variance,
    overlong_penalty,
    rloo_advantages,
    staleness,
    token_advantages,
)

groups = st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=16)


def test_grpo_known_values():
    adv = grpo_advantages([1.0, 0.0, 0.0, 1.0], epsilon=0.0)
    std = np.std([1, 0, 0, 1], ddof=1)
    np.testing.assert_allclose(adv, np.array([0.5, -0.5, -0.5, 0.5]) / std)


def test_rloo_known_values():
    np.testing.assert_allclose(rloo_advantages([3.0, 1.0, 2.0]), [3 - 1.5, 1 - 2.5, 2 - 2.0])


def test_dr_grpo_does_not_divide_by_std():
    np.testing.assert_allclose(dr_grpo_advantages([10.0, 0.0]), [5.0, -5.0])


@given(groups)
def test_rloo_is_leave_one_out_and_a_rescaled_dr_grpo(rewards):
    r = np.array(rewards)
    brute = [r[i] - np.delete(r, i).mean() for i in range(len(r))]
    np.testing.assert_allclose(rloo_advantages(r), brute, atol=1e-9)
    np.testing.assert_allclose(rloo_advantages(r), len(r) / (len(r) - 1) * dr_grpo_advantages(r), atol=1e-9)


@given(groups, st.floats(-50, 50), st.floats(0.5, 20))
def test_grpo_is_invariant_to_shift_and_scale(rewards, shift, scale):
    r = np.array(rewards)
    if np.ptp(r) < 1e-3:
        return
    np.testing.assert_allclose(grpo_advantages(r * scale + shift, 0.0), grpo_advantages(r, 0.0), atol=1e-6)


@given(groups, st.sampled_from(list(Estimator)))
def test_every_estimator_centres_the_group(rewards, estimator):
    adv = group_advantages(rewards, estimator)
    assert abs(adv.sum()) < 1e-6 * max(1.0, np.abs(adv).max() * len(adv))
    assert adv.shape == (len(rewards),)


def test_rloo_rejects_single_sample_and_bad_input():
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages([1.0])
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages([1.0, float("nan")])
    with pytest.raises(ValueError, match="non-empty"):
        dr_grpo_advantages([])


def test_zero_variance_detects_equal_rewards_only():
    assert is_zero_variance([0.5, 0.5, 0.5])
    assert not is_zero_variance([0.5, 0.5, 0.6])
    assert np.all(grpo_advantages([1.0, 1.0, 1.0]) == 0)


@given(st.integers(1, 4096), st.integers(0, 1024), st.integers(0, 5000))
def test_overlong_penalty_is_a_ramp_from_zero_to_minus_one(max_tokens, cache, length):
    cache = min(cache, max_tokens)
    penalty = overlong_penalty(length, max_tokens, cache)
    assert -1.0 <= penalty <= 0.0
    if length <= max_tokens - cache:
        assert penalty == 0.0
    if length > max_tokens:
        assert penalty == -1.0
    if length + 1 <= max_tokens:
        assert overlong_penalty(length + 1, max_tokens, cache) <= penalty


def test_overlong_penalty_midpoint_and_bad_settings():
    assert overlong_penalty(900, 1000, 200) == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="cache_tokens"):
        overlong_penalty(10, 100, 200)


def test_combine_reward_weights_and_names_missing_components():
    assert combine_reward({"tests": 1.0, "style": 0.5, "extra": 9.0}, {"tests": 1.0, "style": 0.2}) == pytest.approx(1.1)
    with pytest.raises(KeyError, match="style"):
        combine_reward({"tests": 1.0}, {"tests": 1.0, "style": 0.2})


def test_token_advantages_only_on_policy_tokens():
    mask = np.array([0, 1, 1, 0, 1], dtype=np.uint8)
    out = token_advantages(-0.75, mask)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [0, -0.75, -0.75, 0, -0.75])


def test_staleness_in_versions_and_seconds():
    assert staleness(3, 7, 1_000_000, 3_500_000) == (4, 2.5)
    assert staleness(9, 7, 0, 0) == (0, 0.0)
    assert staleness(3, None, 0, 1_000_000) == (0, 1.0)
