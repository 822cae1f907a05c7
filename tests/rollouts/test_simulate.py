"""The load generator's records look like a fleet's: routers never pick an expert twice for a token."""

import numpy as np
import pytest

from ember.rollouts.simulate import distinct_top_k, synthetic_rollout


@pytest.mark.parametrize("top_k,num_experts", [(1, 1), (2, 4), (8, 256), (8, 512), (16, 16)])
def test_top_k_sets_are_distinct_in_range_and_compact(top_k, num_experts):
    experts = distinct_top_k(np.random.default_rng(top_k), (500, 3), top_k, num_experts)
    assert experts.shape == (500, 3, top_k)
    assert experts.dtype == (np.uint8 if num_experts <= 256 else np.uint16)
    assert int(experts.max()) < num_experts
    assert (np.diff(np.sort(experts, axis=-1), axis=-1) > 0).all()
    if num_experts > top_k:
        assert len(np.unique(experts[..., 0])) > num_experts // 2, "starts spread over the experts"


def test_impossible_layouts_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        distinct_top_k(np.random.default_rng(0), (4,), 2, 6)
    with pytest.raises(ValueError, match="power of two >= top_k"):
        distinct_top_k(np.random.default_rng(0), (4,), 8, 4)


def test_synthetic_rollout_carries_router_like_experts():
    rollout = synthetic_rollout(np.random.default_rng(1), group_id="g", prompt_id="p", num_tokens=64, layers=61)
    assert rollout.routed_experts.shape == (64, 61, 8)
    assert (np.diff(np.sort(rollout.routed_experts, axis=-1), axis=-1) > 0).all()
