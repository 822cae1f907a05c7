"""The spill store's fence against a previous owner, and per-version counts that agree between the store
(Prometheus) and the ledger (`rollouts stats`)."""

import pytest

from ember.rollouts.product.config import ProductSettings
from ember.rollouts.product.events import EventKind
from ember.rollouts.product.reward import RewardFunction
from ember.rollouts.product.store import Fenced, PendingStore
from ember.rollouts.stats import EtlStats, _add
from tests.rollouts.product.support import Feed, engine


def test_a_previous_owner_cannot_commit_after_a_takeover(tmp_path):
    old = PendingStore(tmp_path / "s.db", durable=False)
    old.db.execute("ROLLBACK")  # between its checkpoints, as if paused: the new owner gets the file
    new = PendingStore(tmp_path / "s.db", durable=False)
    assert new.epoch == old.epoch + 1
    new.db.execute("ROLLBACK")
    old.db.execute("BEGIN IMMEDIATE")
    old.set("pos.served", 99)
    with pytest.raises(Fenced, match="another process"):
        old.commit([])
    assert new.get("pos.served") is None
    old.db.close()
    new.db.close()


def test_per_version_counts_agree_between_store_and_ledger(tmp_path):
    feed = Feed(engine(tmp_path / "s.db", ProductSettings(reward=RewardFunction(horizon_s=10, unshown_horizon_s=10))))
    kinds = [EventKind.ACCEPTED, EventKind.REVERTED, None, EventKind.ACCEPTED, None, EventKind.EDITED]
    for i, kind in enumerate(kinds):
        cid = f"c{i}"
        feed.served(i, cid, version=1 + i % 2)
        feed.event(i + 1, cid, EventKind.SHOWN)
        if kind is EventKind.EDITED:
            feed.event(i + 2, cid, kind, edit_distance=3)
        elif kind is not None:
            feed.event(i + 2, cid, kind)
    feed.join.advance(10**6)
    out = feed.join.checkpoint()
    stats = EtlStats(window_s=0)
    for outcome in out.outcomes:
        _add(stats, outcome)
    store = feed.join.store.counts()
    for version in (1, 2):
        assert stats.versions[version]["served"] == store[version]["served"] == 3
        assert stats.versions[version]["rewarded"] == store[version]["rewarded"]
        assert stats.versions[version]["trained"] == store[version].get("trained", 0)
    assert sum(c["trained"] for c in stats.versions.values()) == sum(len(b.rollout_ids) for b in out.batches) > 0
