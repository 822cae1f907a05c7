"""Bad product input costs its own record only: dead-lettered with a reason, its bytes kept for the dead-letter
topic (unless oversized), and it survives a restart's re-send like any output."""

from dataclasses import replace

from ember.rollouts.product.events import EventKind
from ember.rollouts.product.join import EVENTS, SERVED, ProductOutput
from tests.rollouts.product.support import LIMITS, Feed, engine, event, served


def test_malformed_mismatched_and_oversized_records_are_dead_lettered(tmp_path):
    feed = Feed(engine(tmp_path / "s.db", limits=replace(LIMITS, max_message_bytes=4096)))
    feed.send(SERVED, 0, "x", b"not a served completion")
    feed.send(SERVED, 1, "other-key", served("c1"))
    feed.send(SERVED, 2, "c2", served("c2", fill=5000))  # token ids past vocab_size 1000
    feed.send(EVENTS, 3, "c1", b'{"completion_id": "c1", "kind": "liked"}')
    feed.send(EVENTS, 4, "c1", event("c1", EventKind.EDITED, edit_distance=2).replace(b'"edit_distance":2', b'"edit_distance":-2'))
    feed.send(EVENTS, 5, "big", b"x" * 5000)
    feed.served(6, "fine")
    out = feed.join.checkpoint()
    dead = [(o.topic, o.offset, o.reason, o.detail["error"]) for o in out.outcomes if o.kind == "dead_letter"]
    assert [(t, off, reason) for t, off, reason, _ in dead] == [
        ("rollouts", 0, "malformed"), ("rollouts", 1, "key_mismatch"), ("rollouts", 2, "token_out_of_vocab"),
        ("events", 0, "malformed"), ("events", 1, "malformed"), ("events", 2, "oversized"),
    ]
    assert "not a served completion" in dead[0][3] and "'liked' not in" in dead[3][3] and "non-negative" in dead[4][3]
    assert [r.value is not None for r in out.rejected] == [True] * 5 + [False]
    assert feed.join.pending_count() == 1  # "fine" still waits: nothing else was lost with the bad records
    again = ProductOutput.from_outbox(out.txn, feed.join.store.outbox(out.txn))
    assert again.rejected == out.rejected and again.outcomes == out.outcomes
