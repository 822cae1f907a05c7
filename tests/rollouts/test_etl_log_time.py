"""A rebalance never changes a decision: reward and group deadlines run on time in the log.

Every reward arrives 4 s after its rollout, well within the 8 s reward timeout. While it is on its way
a second ETL process joins the group (a rebalance: poll() returns nothing while it runs) and is then
killed with -9 while it owns shards, so its partitions sit unread until the session timeout (6 s) hands
them back to the first process, which rebuilds them from committed state and reads on. None of that
may turn an in-time reward late or a rewarded rollout unrewarded: the data was in Kafka all along.

About 40 s (over the ~20 s budget: a process must start and join, own shards, die, and the group must
wait out its 6 s session timeout before the survivor takes over, all inside the reward window).
"""

from __future__ import annotations

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
    finish,
    publish_in_background,
    setup_etl,
    wait_for_books,
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


def wait_for_line(proc: EtlProcess, needle: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while needle not in proc.output():
        assert proc.proc.poll() is None, proc.output()[-3000:]
        assert time.monotonic() < deadline, f"{needle!r} not logged within {timeout_s}s:\n{proc.output()[-3000:]}"
        time.sleep(0.2)


def test_a_rebalance_inside_the_reward_window_declares_no_in_time_reward_late(kafka, tmp_path, processes):
    prefix, _config, topics = setup_etl(
        tmp_path, Deployment.plaintext(), partitions=4,
        rewards={"timeout_s": REWARD_TIMEOUT_S, "orphan_timeout_s": REWARD_TIMEOUT_S + 4},
        groups={"timeout_s": REWARD_TIMEOUT_S + 6},
    )
    work = rewards_exactly_after_their_rollouts(
        workload(prefix, groups=30, group_interval_s=0.3, p_missing_reward=0.0, p_duplicate_reward=0.0, regions={"us-east": 0.0}),
        REWARD_AFTER_S,
    )
    first = EtlProcess(tmp_path / "etl.yaml", "a", tmp_path)
    processes.append(first)
    wait_for_line(first, "owns shards [0, 1, 2, 3]", 120)
    thread, _ = publish_in_background(work, topics)
    joiner = EtlProcess(tmp_path / "etl.yaml", "b", tmp_path)  # joins while rewards are on their way
    processes.append(joiner)
    wait_for_line(joiner, "loaded shard", 60)
    time.sleep(1.0)
    joiner.kill()  # leaves without a word, owning shards whose rewards are still to come
    thread.join(timeout=120)
    wait_for_books(topics, work, timeout_s=120, alive=lambda: first.proc.poll() is None)
    finish([first])

    found = check_books(topics, work, REWARD_TIMEOUT_S)
    late = [o for o in found.rewards_dropped if o.reason == Reason.LATE_REWARD.value]
    unrewarded = [o for o in found.dropped if o.reason == Reason.UNREWARDED.value]
    assert not late, f"in-time rewards declared late across the rebalance: {[o.detail for o in late][:5]}"
    assert not unrewarded, f"rewarded rollouts dropped as unrewarded: {[o.detail for o in unrewarded][:5]}"
    output = first.output()
    assert output.count("owns shards") >= 3, "no rebalance happened: the test injured nothing\n" + output[-3000:]
    last = output[output.rfind("owns shards"):].splitlines()[0]
    assert last.startswith("owns shards [0, 1, 2, 3]"), f"the survivor never took every shard back: {last}"
