"""A rebalance never changes a decision: reward and group deadlines run on time in the log.

Every reward arrives 4 s after its rollout, well within the 8 s reward timeout. Two ETL processes
share the shards; while rewards are on their way one of them hangs (SIGSTOP) and a third one joins.
The group waits for the hung member until its session times out (15 s): meanwhile its partitions
fill up unread and the others' poll() returns nothing while they wait to rejoin; then a survivor takes
the hung member's shards over, rebuilds them from committed state and reads a backlog of 10-15 s.
A clock that let wall time run while not reading drops those rollouts as unrewarded and
their rewards as orphans (checked: with `engine.advance(wall time)` this test fails). None of this may
change a decision: the data was in Kafka all along, and a replay of the log writes the same ledger.

About 60-80 s (over the ~20 s budget: three processes start and join, and the group must wait out a 15 s
session timeout inside the reward window, then the survivors finish).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest

from ember.rollouts.records import Reason
from ember.schemas import Reward, Rollout
from tests.rollouts.etl_support import (
    Deployment,
    EtlProcess,
    Workload,
    check_books,
    check_replay,
    finish,
    publish_in_background,
    setup_etl,
    wait_for_books,
    wait_for_line,
    workload,
)

pytestmark = pytest.mark.integration

REWARD_AFTER_S = 4.0
REWARD_TIMEOUT_S = 8.0


def rewards_exactly_after_their_rollouts(work: Workload, delay_s: float) -> Workload:
    """The same run with every reward published exactly `delay_s` after its rollout (no duplicate rewards: one
    arriving after its group closed is rightly late, and would hide what this test looks for)."""
    published = {e.record.rollout_id: e.at_s for e in work.events if isinstance(e.record, Rollout) and not e.note}
    events = [
        replace(e, at_s=published[e.record.rollout_id] + delay_s + (0.01 if e.note else 0.0))
        if isinstance(e.record, Reward) else e
        for e in work.events
    ]
    return Workload(work.spec, sorted(events, key=lambda e: e.at_s))


def test_a_rebalance_inside_the_reward_window_declares_no_in_time_reward_late(kafka, tmp_path, processes):
    prefix, config, topics = setup_etl(
        tmp_path, Deployment.plaintext(), partitions=4,
        kafka={"session_timeout_ms": 15_000},
        rewards={"timeout_s": REWARD_TIMEOUT_S, "orphan_timeout_s": REWARD_TIMEOUT_S + 4},
        groups={"timeout_s": REWARD_TIMEOUT_S + 6},
    )
    work = rewards_exactly_after_their_rollouts(
        workload(prefix, groups=120, group_interval_s=0.3, p_missing_reward=0.0, p_duplicate_reward=0.0, regions={"us-east": 0.0}),
        REWARD_AFTER_S,
    )
    first, hung = EtlProcess(tmp_path / "etl.yaml", "a", tmp_path), EtlProcess(tmp_path / "etl.yaml", "b", tmp_path)
    processes.extend([first, hung])
    wait_for_line(hung, "owns shards [", 120)
    wait_for_line(first, "owns shards [", 60)
    thread, _ = publish_in_background(work, topics)
    time.sleep(REWARD_AFTER_S)
    os.kill(hung.proc.pid, signal.SIGSTOP)  # a member that stops answering, owning shards
    third = EtlProcess(tmp_path / "etl.yaml", "c", tmp_path)  # its join starts a rebalance that waits for the hung one
    processes.append(third)
    loads = first.output().count("loaded shard")
    deadline = time.monotonic() + 90
    while first.output().count("loaded shard") + third.output().count("loaded shard") <= loads:
        assert time.monotonic() < deadline, "nobody took the hung member's shards over within 90 s"
        time.sleep(0.2)
    assert thread.is_alive(), "the takeover came after the fleet stopped publishing: it was not inside the reward window"
    hung.kill()
    wait_for_line(third, "owns shards [", 90)
    thread.join(timeout=120)
    wait_for_books(topics, work, timeout_s=120, alive=lambda: first.proc.poll() is None and third.proc.poll() is None)
    finish([first, third])

    found = check_books(topics, work, REWARD_TIMEOUT_S)
    late = [o for o in found.rewards_dropped if o.reason == Reason.LATE_REWARD.value]
    unrewarded = [o for o in found.dropped if o.reason == Reason.UNREWARDED.value]
    assert not late, f"{len(late)} in-time rewards declared late across the rebalance, e.g. {late[:3]}"
    assert not unrewarded, f"{len(unrewarded)} rewarded rollouts dropped as unrewarded, e.g. {unrewarded[:3]}"
    check_replay(config, topics, tmp_path / "replayed")
