"""The wire codec through the real Kafka broker: idempotent zstd producer, read_committed consumer."""

import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from ember.rollouts.simulate import synthetic_reward, synthetic_rollout
from ember.rollouts.topics import Topics, TopicSpec
from ember.rollouts.admin import ensure_topics
from ember.rollouts.transport import (
    BadMessage,
    BrokerNotReady,
    DecodedMessage,
    RecordWriter,
    RewardWriter,
    RolloutWriter,
    consumer_config,
    listed_offsets,
    producer_config,
    read_messages,
)
from ember.schemas import encode
from tests.schemas.strategies import assert_same

pytestmark = pytest.mark.integration


def make_topic(kafka: str, name: str, partitions: int = 3) -> str:
    ensure_topics(kafka, [TopicSpec(name, partitions)])
    return name


def consume_all(topic: str, limit: int) -> list:
    consumer = KafkaConsumer(topic, **consumer_config(group_id=None))
    try:
        return list(read_messages(consumer, limit=limit, idle_timeout_s=10))
    finally:
        consumer.close()


def test_10k_rollouts_round_trip_exactly_through_the_broker(kafka, topic_prefix):
    topic = make_topic(kafka, Topics(topic_prefix).rollouts)
    rng = np.random.default_rng(0)
    sent = {}
    with RecordWriter(topic) as writer:
        assert writer.producer.config["enable_idempotence"] and writer.producer.config["compression_type"] == "zstd"
        for i in range(10_000):
            rollout = synthetic_rollout(
                rng, group_id=f"g{i // 8}", prompt_id=f"p{i // 8}", num_tokens=int(rng.integers(16, 96)), layers=2, top_k=2
            )
            sent[rollout.rollout_id] = rollout
            writer.write(rollout)
    received = consume_all(topic, limit=10_000)
    assert all(isinstance(m, DecodedMessage) for m in received)
    assert len(received) == 10_000
    assert {m.record.rollout_id for m in received} == set(sent)
    for message in received:
        assert_same(message.record, sent[message.record.rollout_id])


def test_rollouts_travel_uncompressed_and_their_topic_keeps_them_so(kafka, topic_prefix):
    """Routed experts are close to incompressible: zstd saved <1% of a rollout and cost CPU at every hop (BENCHMARKS.md)."""
    assert Topics(topic_prefix).specs()["rollouts"].configs()["compression.type"] == "producer"
    assert Topics(topic_prefix).specs()["train_batches"].configs()["compression.type"] == "zstd"
    with RolloutWriter(topic_prefix, bootstrap_servers=kafka) as writer:
        assert writer.producer.config["compression_type"] is None
    with RolloutWriter(topic_prefix, bootstrap_servers=kafka, compression_type="zstd") as writer:
        assert writer.producer.config["compression_type"] == "zstd"


def test_reading_stops_at_the_limit_even_inside_one_poll(kafka, topic_prefix):
    topic = make_topic(kafka, Topics(topic_prefix).rollouts, partitions=1)
    rng = np.random.default_rng(2)
    with RecordWriter(topic) as writer:
        for i in range(50):
            writer.write(synthetic_rollout(rng, group_id=f"g{i}", prompt_id="p", num_tokens=16, layers=None))
    assert len(consume_all(topic, limit=50)) == 50  # all there, so one poll could return them all
    assert len(consume_all(topic, limit=7)) == 7


def test_a_group_lives_in_one_partition(kafka, topic_prefix):
    topic = make_topic(kafka, Topics(topic_prefix).rewards, partitions=6)
    rng = np.random.default_rng(1)
    with RecordWriter(topic) as writer:
        for i in range(120):
            rollout = synthetic_rollout(rng, group_id=f"g{i % 10}", prompt_id="p", num_tokens=16, layers=None)
            writer.write(synthetic_reward(rng, rollout))
    partitions_by_group: dict[str, set[int]] = {}
    for message in consume_all(topic, limit=120):
        partitions_by_group.setdefault(message.record.group_id, set()).add(message.partition)
    assert len(partitions_by_group) == 10
    assert all(len(p) == 1 for p in partitions_by_group.values())


def test_worker_and_grader_writers_copartition_a_group_and_count_bytes_per_token(kafka, topic_prefix):
    topics = Topics(topic_prefix)
    ensure_topics(kafka, [TopicSpec(topics.rollouts, 4), TopicSpec(topics.rewards, 4)])
    rng = np.random.default_rng(3)
    with RolloutWriter(topic_prefix) as rollouts, RewardWriter(topic_prefix) as rewards:
        for i in range(40):
            rollout = synthetic_rollout(rng, group_id=f"g{i % 8}", prompt_id="p", num_tokens=256, layers=61)
            rollouts.write(rollout)
            rewards.write(synthetic_reward(rng, rollout))
        with pytest.raises(TypeError, match="RolloutWriter writes Rollout records"):
            rollouts.write(synthetic_reward(rng, rollout))
    assert rollouts.tokens == 40 * 256 and 488 < rollouts.bytes_per_token < 520
    partition_of: dict[tuple[str, str], set[int]] = {}
    for role, topic in (("rollouts", topics.rollouts), ("rewards", topics.rewards)):
        for message in consume_all(topic, limit=40):
            partition_of.setdefault((role, message.record.group_id), set()).add(message.partition)
    for g in range(8):
        assert partition_of[("rollouts", f"g{g}")] == partition_of[("rewards", f"g{g}")] and len(partition_of[("rewards", f"g{g}")]) == 1


def test_aborted_transaction_is_invisible_to_read_committed(kafka, topic_prefix):
    topic = make_topic(kafka, f"{topic_prefix}.txn", partitions=1)
    rng = np.random.default_rng(2)
    producer = KafkaProducer(**producer_config(transactional_id=f"{topic_prefix}-txn"))
    producer.init_transactions()
    committed = synthetic_rollout(rng, group_id="kept", prompt_id="p", num_tokens=32, layers=None)
    aborted = synthetic_rollout(rng, group_id="dropped", prompt_id="p", num_tokens=32, layers=None)
    producer.begin_transaction()
    producer.send(topic, key=b"dropped", value=encode(aborted))
    producer.flush()
    producer.abort_transaction()
    producer.begin_transaction()
    producer.send(topic, key=b"kept", value=encode(committed))
    producer.commit_transaction()
    producer.close()

    received = consume_all(topic, limit=10)
    assert [m.record.rollout_id for m in received] == [committed.rollout_id]

    uncommitted = KafkaConsumer(topic, **consumer_config(group_id=None, isolation_level="read_uncommitted"))
    seen = [m.record.rollout_id for m in read_messages(uncommitted, limit=10, idle_timeout_s=5)]
    uncommitted.close()
    assert aborted.rollout_id in seen, "the aborted record must exist in the log, or the test proves nothing"


def test_malformed_message_is_reported_with_its_position_not_a_crash(kafka, topic_prefix):
    topic = make_topic(kafka, f"{topic_prefix}.poison", partitions=1)
    rng = np.random.default_rng(3)
    good = synthetic_rollout(rng, group_id="g", prompt_id="p", num_tokens=32, layers=None)
    producer = KafkaProducer(**producer_config())
    producer.send(topic, key=b"g", value=encode(good))
    producer.send(topic, key=b"g", value=encode(good)[:-9])
    producer.send(topic, key=b"g", value=b'{"rollout_id": "json is not the wire format"}')
    producer.send(topic, key=b"g", value=encode(good))
    producer.flush()
    producer.close()

    received = consume_all(topic, limit=4)
    assert [type(m).__name__ for m in received] == ["DecodedMessage", "BadMessage", "BadMessage", "DecodedMessage"]
    truncated, not_ember = received[1], received[2]
    assert isinstance(truncated, BadMessage)
    assert (truncated.topic, truncated.partition, truncated.offset) == (topic, 0, 1)
    assert "Expected to be able to read" in truncated.reason
    assert str(not_ember).startswith(f"{topic}[0]@2: bad magic")


def test_offsets_are_asked_again_while_a_partitions_leader_is_unknown_and_then_named():
    """kafka-python 3.0 raises KeyError for a partition whose leader its metadata does not know yet (a mirrored topic
    just after its region was cut off): asked again until it answers, and past the bound the partition is named."""
    tp = TopicPartition("us.run.rollouts", 0)
    answers = [KeyError(tp), KeyError(tp), {tp: 7}]

    def end_offsets(tps):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert listed_offsets(end_offsets, [tp], timeout_s=10) == {tp: 7}
    assert not answers

    def never(tps):
        raise KeyError(tp)

    with pytest.raises(BrokerNotReady, match="us.run.rollouts"):
        listed_offsets(never, [tp], timeout_s=0.6)
