"""Opt-out honoured while completions wait (nothing of the user downstream, nor left in the spill file), and
memory that does not grow with the number of pending completions."""

import os

import numpy as np
import psutil
import pytest

from ember.rollouts.product.config import ProductSettings
from ember.rollouts.product.events import EventKind
from ember.rollouts.product.optout import OptOutError, OptOutFile, OptOutList
from ember.rollouts.product.reward import RewardFunction
from tests.rollouts.product.support import Feed, engine

SECRET = 913  # every token of the opted-out user's completions: a pattern no one else's carry


def test_opt_out_added_while_pending_leaves_nothing_downstream(tmp_path):
    settings = ProductSettings(reward=RewardFunction(horizon_s=60, unshown_horizon_s=60))
    feed = Feed(engine(tmp_path / "s.db", settings))
    for i in range(6):
        feed.served(i, f"alice-{i}", user="alice", org="acme", fill=SECRET)
        feed.served(i, f"bob-{i}", user="bob", org="other", fill=5)
        feed.event(10 + i, f"alice-{i}", EventKind.SHOWN)
        feed.event(10 + i, f"bob-{i}", EventKind.SHOWN)
        feed.event(20 + i, f"bob-{i}", EventKind.ACCEPTED)
    feed.join.advance(30)
    before = feed.join.checkpoint()
    feed.join.set_opt_out(OptOutList(users=frozenset({"alice"})))  # while all twelve wait for their horizon
    for i in range(6):
        feed.event(40 + i, f"alice-{i}", EventKind.ACCEPTED)  # her later events are dropped too
    feed.served(50, "alice-late", user="alice", org="acme", fill=SECRET)  # opted out at arrival: never stored
    feed.join.advance(10**6)
    after = feed.join.checkpoint()

    outcomes = before.outcomes + after.outcomes
    alice = [o for o in outcomes if o.rollout_id.startswith("alice")]
    assert {(o.kind, o.reason) for o in alice} == {("rollout_dropped", "opt_out"), ("reward_dropped", "opt_out")}
    assert {o.rollout_id for o in alice if o.kind == "rollout_dropped"} == {f"alice-{i}" for i in range(6)} | {"alice-late"}
    assert all(o.detail in ({"policy_version": 1}, {"grader": "product"}) for o in alice)  # the fact "opt_out", nothing of hers
    batches = before.batches + after.batches
    assert sorted(c for b in batches for c in b.rollout_ids) == sorted(f"bob-{i}" for i in range(6)[1:])  # bob-0 warms the baseline
    assert not any(SECRET in b.tokens for b in batches)
    feed.join.store.close()
    secret_bytes = np.full(8, SECRET, np.uint32).tobytes()
    for name in os.listdir(tmp_path):  # the spill file and its WAL: her tokens were zeroed on delete
        assert secret_bytes not in (tmp_path / name).read_bytes(), name


def test_opt_out_file_reloads_and_refuses_a_bad_line(tmp_path):
    path = tmp_path / "opt-out.txt"
    path.write_text("# privacy requests\nuser:alice\n")
    watched = OptOutFile(path)
    assert watched.current().excludes("alice", "") and not watched.current().excludes("bob", "acme")
    path.write_text("user:alice\norg:acme  # whole org\n")
    assert watched.current().excludes("bob", "acme")
    path.write_text("user:alice\nalice\n")
    with pytest.raises(OptOutError, match=r"opt-out.txt:2: 'alice' is not 'user:<id>' or 'org:<id>'"):
        watched.current()


def test_a_million_pending_completions_stay_on_disk(tmp_path):
    """10^6 pending completions cost the process at most 48 MB of resident memory (48 B each; a Rollout held in
    RAM is over 1 KB): they are rows in the spill file, and the engine keeps no per-completion object."""
    join = engine(tmp_path / "s.db", ProductSettings())
    process = psutil.Process()
    before = process.memory_info().rss
    # the rows the join writes per served completion, made by SQLite itself: a Python loop would take minutes
    join.store.db.execute(
        "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 999999) "
        "INSERT INTO pending SELECT printf('c%07d', i), i, 0, 3600000 + i, 1, 'py/inline', 'u' || (i % 1000), 'o', 8, "
        "zeroblob(64), 0, 0, NULL, NULL, NULL, NULL FROM n"
    )
    join.checkpoint()
    join.advance(1000)  # nothing due yet: the horizon index answers without reading the rows
    grown = process.memory_info().rss - before
    assert join.pending_count() == 1_000_000
    assert grown < 48 * 1_000_000, f"resident memory grew {grown / 1e6:.1f} MB for 10^6 pending completions"
    join.store.close()

