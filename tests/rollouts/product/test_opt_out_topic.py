"""Opt-outs from the compacted `<prefix>.opt-out` topic on the real broker, next to the opt-out file: what the
topic held at start is honoured before the first decision, a tombstone opts back in, and an opt-out published
while a user's completions wait for their horizon drops them (and their later events) before any batch."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from kafka import KafkaProducer

from ember.rollouts.admin import delete_topics, ensure_topics, topic_configs
from ember.rollouts.engine import REWARDS, ROLLOUTS, InputMessage
from ember.rollouts.product.config import ProductSettings
from ember.rollouts.product.events import EventKind
from ember.rollouts.product.optout import OptOutFile, OptOutSources
from ember.rollouts.product.reward import RewardFunction
from ember.rollouts.product_etl import OptOutTopic, ProductShard
from ember.rollouts.topics import Topics
from ember.rollouts.transport import producer_config
from tests.rollouts.product.support import engine, event, served

pytestmark = pytest.mark.integration

SECRET = 913  # every token of alice's completions


def test_opt_out_published_while_completions_are_pending(kafka, tmp_path):
    topics = Topics(f"test-optout-{uuid.uuid4().hex[:8]}")
    ensure_topics(kafka, [topics.specs()["opt_out"]])
    producer = KafkaProducer(**producer_config(None, bootstrap_servers=kafka))
    reader = None
    try:
        assert topic_configs(kafka, [topics.opt_out])[topics.opt_out]["cleanup.policy"] == "compact"
        for key, value in ((b"user:carol", b"1"), (b"user:dave", b"1"), (b"user:dave", None), (b"alice", b"1")):
            producer.send(topics.opt_out, key=key, value=value)  # dave opts back in; `alice` is no id
        producer.flush()
        (tmp_path / "opt-out.txt").write_text("org:evil\n")
        reader = OptOutTopic(kafka, topics.opt_out)  # read to its end before any decision
        assert reader.current().users == {"carol"} and reader.invalid == 1
        sources = OptOutSources([OptOutFile(tmp_path / "opt-out.txt"), reader])

        join = engine(tmp_path / "s.db", ProductSettings(reward=RewardFunction(horizon_s=60, unshown_horizon_s=60)))
        shard = ProductShard(join, {ROLLOUTS: "p.rollouts", REWARDS: "p.events"}, sources)
        shard.join.set_opt_out(sources.current())
        offsets = {"p.rollouts": 0, "p.events": 0}

        def send(topic: str, at_ms: int, cid: str, value: bytes) -> None:
            shard.ingest(InputMessage(topic, 0, offsets[topic], at_ms, cid.encode(), value))
            offsets[topic] += 1

        people = {"alice": "acme", "bob": "other", "carol": "other", "dave": "other", "erin": "evil"}
        for i in range(4):
            for user, org in people.items():
                cid = f"{user}-{i}"
                send("p.rollouts", i, cid, served(cid, user=user, org=org, fill=SECRET if user == "alice" else 5))
                send("p.events", 10 + i, cid, event(cid, EventKind.SHOWN))
        shard.advance(30)
        before, _, _ = shard.checkpoint()
        assert not [o for o in before.outcomes if o.rollout_id.startswith("alice")], "hers still pending"

        producer.send(topics.opt_out, key=b"user:alice", value=b"1").get(timeout=30)  # all of hers are pending
        deadline = time.monotonic() + 30
        while "alice" not in reader.current().users and time.monotonic() < deadline:
            reader.poll(timeout_ms=200)
        assert "alice" in reader.current().users
        for i in range(4):
            for user in people:
                send("p.events", 40 + i, f"{user}-{i}", event(f"{user}-{i}", EventKind.ACCEPTED))
        shard.advance(10**6)
        after, _, _ = shard.checkpoint()
    finally:
        if reader is not None:
            reader.close()
        producer.close(timeout=5)
        delete_topics(kafka, [topics.opt_out])

    outcomes = before.outcomes + after.outcomes
    dropped = {o.rollout_id for o in outcomes if (o.kind, o.reason) == ("rollout_dropped", "opt_out")}
    assert dropped == {f"{u}-{i}" for u in ("alice", "carol", "erin") for i in range(4)}
    trained = {c for b in before.batches + after.batches for c in b.batch.rollout_ids}
    assert {c.split("-")[0] for c in trained} == {"bob", "dave"}
    assert not any(np.any(b.batch.tokens == SECRET) for b in before.batches + after.batches if not b.batch.by_reference)
    assert not [o for o in outcomes if o.rollout_id.startswith("alice") and o.reason != "opt_out"]
    join.store.close()
