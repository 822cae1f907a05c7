"""Product rewards and single-sample baselines, against hand-computed values."""

import pytest

from ember.rollouts.product.baselines import BaselineSettings, ema_step, loo_baseline
from ember.rollouts.product.config import ProductSettings
from ember.rollouts.product.events import EventKind
from ember.rollouts.product.reward import RewardFunction
from tests.rollouts.product.support import Feed, engine

REWARD = RewardFunction(horizon_s=10, unshown_horizon_s=10, accepted=1.0, kept=0.5, reverted=-1.0, edit_distance=-0.01, kept_after_min=1)


def advantages(out) -> dict[str, float]:
    found = {}
    for batch in out.batches:
        for cid, (start, end) in zip(batch.rollout_ids, zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:])):
            found[cid] = float(batch.advantages[end - 1])  # the last token is a policy token
    return found


def test_ema_step_by_hand():
    assert ema_step(0.0, 0, 1.0, 0.5) == (1.0, 1)  # a fresh key starts at its first reward
    assert ema_step(1.0, 1, 0.0, 0.5) == (0.5, 2)
    assert ema_step(0.5, 2, 1.0, 0.5) == (0.75, 3)
    assert loo_baseline([1.0, 0.0, 0.5]) == pytest.approx(0.5)


def test_ema_per_context_and_version_through_the_join(tmp_path):
    """alpha 0.5: rewards 1.5 (accepted+kept), 0 - 0.1 (edited 10), -1 (reverted) in context py, version 1;
    then version 2 starts from version 1's baseline; context go has its own."""
    settings = ProductSettings(reward=REWARD, baseline=BaselineSettings(alpha=0.5))
    feed = Feed(engine(tmp_path / "s.db", settings))
    script = [
        ("a", "py", 1, [(EventKind.ACCEPTED, {}), (EventKind.KEPT, {"kept_minutes": 1})]),  # 1.5: warm-up, b = 1.5
        ("b", "py", 1, [(EventKind.EDITED, {"edit_distance": 10})]),  # -0.1: adv -1.6, b = 0.7
        ("c", "py", 1, [(EventKind.REVERTED, {})]),  # -1: adv -1.7, b = -0.15
        ("d", "py", 2, [(EventKind.ACCEPTED, {})]),  # 1: v2 inherits -0.15: adv 1.15
        ("e", "go", 1, [(EventKind.ACCEPTED, {})]),  # go's first: warm-up
    ]
    for i, (cid, context, version, events) in enumerate(script):
        t = i * 100_000
        feed.served(t, cid, context=context, version=version)
        feed.event(t + 1, cid, EventKind.SHOWN)
        for kind, extra in events:
            feed.event(t + 2, cid, kind, **extra)
    feed.join.advance(10**7)
    out = feed.join.checkpoint()
    assert advantages(out) == pytest.approx({"b": -1.6, "c": -1.7, "d": 1.15})
    dropped = {o.rollout_id: o.reason for o in out.outcomes if o.kind == "rollout_dropped"}
    assert dropped == {"a": "baseline_warmup", "e": "baseline_warmup"}
    assert {b.advantage_estimator for b in out.batches} == {"product_ema"}
    assert feed.join.store.ema("py", 2) == (pytest.approx(-0.15 + 0.5 * 1.15), 4)


def test_leave_one_out_over_a_window(tmp_path):
    """window 150 s: c's baseline is mean(a, b); d (horizon at 175 s) sees only c (a and b decided before 25 s)."""
    settings = ProductSettings(reward=REWARD, baseline=BaselineSettings(kind="loo", window_s=150))
    feed = Feed(engine(tmp_path / "s.db", settings))
    rewards = {"a": EventKind.ACCEPTED, "b": EventKind.REVERTED, "c": EventKind.ACCEPTED, "d": EventKind.REVERTED}
    for t, cid in zip((0, 10_000, 20_000, 165_000), rewards):
        feed.served(t, cid)
        feed.event(t + 1, cid, EventKind.SHOWN)
        feed.event(t + 2, cid, rewards[cid])
    feed.join.advance(10**7)
    out = feed.join.checkpoint()
    assert advantages(out) == pytest.approx({"b": -1 - 1.0, "c": 1 - 0.0, "d": -1 - 1.0})
    assert {b.advantage_estimator for b in out.batches} == {"product_loo"}


def test_no_signal_is_dropped_not_scored_zero(tmp_path):
    feed = Feed(engine(tmp_path / "s.db", ProductSettings(reward=REWARD)))
    feed.served(0, "shown-only")
    feed.event(5, "shown-only", EventKind.SHOWN)
    feed.served(10, "never-shown")
    feed.event(20, "lost", EventKind.ACCEPTED)  # its completion never arrives
    feed.join.advance(10**8)
    out = feed.join.checkpoint()
    assert not out.batches
    assert {(o.rollout_id, o.kind, o.reason) for o in out.outcomes} == {
        ("shown-only", "rollout_dropped", "no_signal"),
        ("never-shown", "rollout_dropped", "no_signal"),
        ("lost", "reward_dropped", "orphan_reward"),
    }
