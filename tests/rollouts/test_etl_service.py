"""The ETL service in-process against the real broker: dead letters, books, reader, metrics, stats, replay."""

import uuid

import pyarrow.ipc as ipc
import pytest
from rich.console import Console

from ember.rollouts.config import parse_config
from ember.rollouts.etl import EtlService, TopologyError, prepare_topics
from ember.rollouts.metrics import EtlMetrics
from ember.rollouts.reader import RolloutBatchReader
from ember.rollouts.replay import parse_start, replay
from ember.rollouts.stats import collect_stats, render_stats
from ember.rollouts.topics import Topics, TopicSpec
from ember.rollouts.admin import ensure_topics
from ember.schemas import TRAIN_BATCH_SCHEMA
from ember.schemas import decode_train_batch
from tests.rollouts.etl_support import check_books, etl_settings, publish_in_background, read_topic, workload

pytestmark = pytest.mark.integration

REWARD_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def pipeline(kafka):
    """One ETL run over a faulty workload (published while the ETL runs) plus an oversized message."""
    prefix = f"test-etl-{uuid.uuid4().hex[:8]}"
    settings = etl_settings(
        prefix,
        partitions=2,
        rewards={"timeout_s": REWARD_TIMEOUT_S, "orphan_timeout_s": 4},
        groups={"timeout_s": 5},
        dead_letter={"max_message_bytes": 16_384},
    )
    config = parse_config(settings)
    topics = prepare_topics(config, create=True)
    work = workload(prefix, groups=12, group_interval_s=0.1, p_late_reward=0.1, late_delay_s=4.0, p_malformed=0.1)
    work.events.append(type(work.events[0])(0.0, "rollouts", b"huge", raw=b"\0" * 20_000, note="oversized"))
    metrics = EtlMetrics()
    service = EtlService(config, "inproc", metrics)
    thread, _stats = publish_in_background(work, topics)
    service.run(until_idle_s=4.0)
    thread.join(timeout=60)
    return config, topics, work, service, metrics


def test_every_rollout_is_batched_once_or_dropped_with_a_reason(pipeline):
    _config, topics, work, service, _ = pipeline
    found = check_books(topics, work, REWARD_TIMEOUT_S)
    reasons = {o.reason for o in found.dropped}
    assert "duplicate" in reasons and "unrewarded" in reasons
    assert {o.reason for o in found.rewards_dropped} >= {"late_reward"}
    assert service.transactions >= 1


def test_malformed_and_oversized_messages_are_dead_lettered_with_their_source(pipeline):
    _config, topics, work, _service, _ = pipeline
    records = check_books(topics, work, REWARD_TIMEOUT_S).dead_letter_records
    headers = [dict(r.headers) for r in records]
    assert all(h["ember.source_topic"] == topics.rollouts.encode() for h in headers)
    assert len({(h["ember.source_partition"], h["ember.source_offset"]) for h in headers}) == len(records)
    assert {h["ember.reason"] for h in headers} <= {b"oversized", b"malformed"}, "the reason is a Reason, the detail says more"
    oversized = [r for r, h in zip(records, headers) if h["ember.detail"].startswith(b"20000 bytes > dead_letter.max_message_bytes")]
    assert len(oversized) == 1 and oversized[0].value is None and dict(oversized[0].headers)["ember.payload_kept"] == b"0"
    kept = [r for r, h in zip(records, headers) if h["ember.payload_kept"] == b"1"]
    assert kept and all(r.value for r in kept), "a malformed payload is kept for inspection"


def test_metrics_count_what_was_committed(pipeline):
    _config, topics, work, _service, metrics = pipeline
    found = check_books(topics, work, REWARD_TIMEOUT_S)
    value = metrics.registry.get_sample_value
    assert value("ember_etl_batches_total") == len(found.batch_ids)
    assert value("ember_etl_batched_rollouts_total") == len(found.batched)
    assert value("ember_etl_outcomes_total", {"kind": "rollout_dropped", "reason": "duplicate"}) == sum(
        1 for o in found.dropped if o.reason == "duplicate"
    )
    assert value("ember_etl_reward_join_latency_seconds_count") > 0
    assert value("ember_etl_transactions_total", {"result": "committed"}) >= 1


def test_stats_summarise_the_ledger_and_lag(pipeline, capsys):
    config, topics, work, _service, _ = pipeline
    found = check_books(topics, work, REWARD_TIMEOUT_S)
    stats = collect_stats(config, window_s=0)
    assert stats.batches == len(found.batch_ids) and stats.batched_rollouts == len(found.batched)
    assert sum(stats.dropped.values()) == len(found.dropped)
    assert sum(stats.dead_letters.values()) == work.malformed
    assert all(p.lag == 0 for p in stats.partitions), [(p.topic, p.partition, p.lag) for p in stats.partitions]
    render_stats(stats, Console(width=160))
    out = capsys.readouterr().out
    assert "rollout: duplicate" in out and "input lag" in out


def test_reader_resumes_exactly_from_a_checkpoint(pipeline):
    _config, topics, _work, _service, _ = pipeline
    group = f"trainer-{uuid.uuid4().hex[:6]}"
    with RolloutBatchReader(topics.train_batches, group_id=group, idle_timeout_s=5) as reader:
        first = next(reader)
        reader.commit()
        second = next(reader)
        reader.commit()
        checkpoint = reader.state_dict()
        third = next(reader)
    assert len({first.batch.batch_id, second.batch.batch_id, third.batch.batch_id}) == 3
    with RolloutBatchReader(topics.train_batches, group_id=f"other-{group}", state=checkpoint, idle_timeout_s=5) as resumed:
        again = next(resumed)
        assert again.batch.batch_id == third.batch.batch_id
        assert again.position == {"topic": topics.train_batches, "offsets": {str(again.partition): again.offset + 1}}
    with RolloutBatchReader(topics.train_batches, group_id=group, idle_timeout_s=5) as committed:
        assert next(committed).batch.batch_id == third.batch.batch_id, "the group resumes after the last commit"
    with pytest.raises(ValueError, match="reader state is for topic"):
        RolloutBatchReader(topics.outcomes, state=checkpoint)


def test_replay_rebuilds_batches_with_another_estimator(pipeline, tmp_path):
    config, topics, work, _service, _ = pipeline
    live = check_books(topics, work, REWARD_TIMEOUT_S)
    ablation = config.with_overrides(advantages={"estimator": "rloo"})
    summary = replay(ablation, parse_start("earliest"), to_dir=tmp_path)
    table = ipc.open_file(str(tmp_path / "batches.arrow")).read_all()
    assert table.schema.equals(TRAIN_BATCH_SCHEMA, check_metadata=False)
    assert table.num_rows == summary.batches > 0
    assert set(table.column("advantage_estimator").to_pylist()) == {"rloo"}, "each batch names its advantages' estimator"
    dropped = sum(n for (kind, _), n in summary.outcomes.items() if kind == "rollout_dropped")
    assert summary.rollouts + dropped == work.rollout_messages
    assert summary.outcomes[("dead_letter", "oversized")] == 1
    replayed = {rid for ids in table.column("rollout_ids").to_pylist() for rid in ids}
    assert work.complete_groups(REWARD_TIMEOUT_S) <= replayed
    assert len(replayed) == summary.rollouts
    assert set(live.batched) & replayed, "replay sees the same log"


def test_replay_to_a_topic_writes_the_live_batches_references(pipeline):
    """Batches are by reference: replay with the live settings names each rollout both batched by the same
    topic/partition/offset/sha256 and gives it the same advantage (the packing into batches follows the
    log's clock, so batch boundaries may differ; what a trainer resolves per rollout does not)."""
    config, topics, _work, _service, _ = pipeline

    def per_rollout(topic: str) -> dict:
        batches = [decode_train_batch(r.value) for r in read_topic(topic)]
        assert batches and all(b.by_reference for b in batches)
        return {
            rid: (ref, float(advantage))
            for b in batches
            for rid, ref, advantage in zip(b.rollout_ids, b.rollout_refs, b.sequence_advantages)
        }

    replayed_topic = f"{topics.prefix}.replayed"
    ensure_topics(config.kafka.bootstrap, [TopicSpec(replayed_topic, 1)])
    replay(config, parse_start("earliest"), to_topic=replayed_topic)
    live, again = per_rollout(topics.train_batches), per_rollout(replayed_topic)
    common = set(live) & set(again)
    assert len(common) >= len(live) // 2, "replay batches what the live ETL batched"
    assert {rid: again[rid] for rid in common} == {rid: live[rid] for rid in common}


def test_topology_errors_are_explained(kafka):
    prefix = f"test-topo-{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix)
    ensure_topics(kafka, [TopicSpec(topics.rollouts, 2), TopicSpec(topics.rewards, 3)])
    with pytest.raises(TopologyError, match="same partition count"):
        prepare_topics(parse_config(etl_settings(prefix)), create=True)
