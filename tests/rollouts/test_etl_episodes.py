"""Agent episodes through the real ETL against the real broker: `kill -9` mid-episode loses and doubles no segment,
and a replay of the log writes the live ledger.

The count is independent of the ETL's own books: what the simulator published (segments by episode, rewards)
against what the trainer's topic and the ledger hold."""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import numpy as np
import pytest

from ember.rollouts.records import Outcome
from ember.schemas import Reward, Rollout, decode_train_batch
from tests.rollouts.etl_support import (
    Deployment,
    EtlProcess,
    check_replay,
    finish,
    ledger_counts,
    publish_in_background,
    read_topic,
    setup_etl,
    wait_for_books,
    wait_for_line,
    workload,
)

pytestmark = pytest.mark.integration


def test_kill_9_mid_episode_loses_no_segment_and_doubles_none(kafka, tmp_path, processes):
    prefix, config, topics = setup_etl(tmp_path, Deployment.plaintext(), partitions=2, groups={"timeout_s": 8})
    work = workload(prefix, groups=12, group_interval_s=0.4, max_segments=4, p_missing_segment=0.05, p_malformed=0.0)
    first = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path)
    processes.append(first)
    wait_for_line(first, "owns shards", 120)
    thread, _ = publish_in_background(work, topics)
    deadline = time.monotonic() + 60
    while ledger_counts(topics.outcomes)[0] == 0:  # it has committed work, and later episodes are still in flight
        assert time.monotonic() < deadline and first.proc.poll() is None, first.output()[-3000:]
        time.sleep(0.3)
    assert thread.is_alive(), "the fleet was done before the kill: it would not land mid-episode"
    first.kill()
    survivor = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path)
    processes.append(survivor)
    thread.join(timeout=120)
    wait_for_books(topics, work, timeout_s=120, alive=lambda: survivor.proc.poll() is None)
    finish([survivor])

    sent = [e.record for e in work.events if isinstance(e.record, Rollout)]
    segments_sent = Counter(r.rollout_id for r in sent)
    totals = {r.episode_id: r.segments_total for r in sent if r.segments_total is not None}
    rewarded = {e.record.rollout_id for e in work.events if isinstance(e.record, Reward)}
    batches = [decode_train_batch(r.value) for r in read_topic(topics.train_batches)]
    outcomes = [Outcome.decode(r.value) for r in read_topic(topics.outcomes)]

    batched = Counter(rid for b in batches for rid in b.rollout_ids)
    assert max(batched.values()) == 1, "a segment in two committed batches"
    dropped = Counter(o.rollout_id for o in outcomes if o.kind == "rollout_dropped")
    assert sum(batched.values()) + sum(dropped.values()) == sum(segments_sent.values()), "a segment message lost or doubled"
    assert set(batched) | set(dropped) == set(segments_sent)

    by_episode: dict[str, set] = defaultdict(set)
    for b in batches:
        for i, (rid, episode) in enumerate(zip(b.rollout_ids, b.episode_ids)):
            by_episode[episode].add((b.batch_id, float(b.sequence_advantages[i])))
            assert rid.startswith(episode)
    for episode, places in by_episode.items():
        assert len(places) == 1, f"episode {episode} split across batches or advantages: {places}"
        trained = sum(1 for rid in batched if rid.rsplit("-s", 1)[0] == episode)
        assert trained == totals[episode] and episode in rewarded, f"episode {episode} batched without all its segments or its reward"
    assert by_episode, "no episode was trained"
    dropped_whole = {o.rollout_id.rsplit("-s", 1)[0] for o in outcomes if o.kind == "rollout_dropped" and o.reason not in ("duplicate", "late_rollout")}
    assert not dropped_whole & set(by_episode), "an episode both trained and dropped"
    assert np.all(np.isfinite([a for places in by_episode.values() for _, a in places]))
    check_replay(config, topics, tmp_path / "replayed")  # `rollouts replay` of the log decides every segment alike
