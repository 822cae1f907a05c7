"""Kafka producers and consumers for ember records, with the wire codec on both ends.

Writers are idempotent (acks=all, zstd; rollouts uncompressed, see `ROLLOUT_COMPRESSION`) and key records by
group_id so one group lives in one partition. Readers never crash on a bad message: it comes back as a `BadMessage` naming its
topic/partition/offset and the reason, for the caller to dead-letter and count. Every client config
built here carries `KafkaSecurity.client_kwargs()` (the settings given, else EMBER_KAFKA_*).

Nothing here assumes a warm broker: a writer that gets no metadata and a reader whose group has no
coordinator yet (a broker formatted seconds ago is still creating `__consumer_offsets`) wait a bounded
time and then raise `BrokerNotReady` naming what they waited for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaTimeoutError

from ember.rollouts.config import kafka_bootstrap
from ember.rollouts.security import KafkaSecurity
from ember.rollouts.topics import MAX_MESSAGE_BYTES, Topics
from ember.schemas import DecodeError, Reward, Rollout, TrainBatch, decode, encode


# Routed experts are ~98% of a rollout's bytes and close to incompressible (top-k ids from a skewed popularity): zstd-3
# saved 0.7% of a realistic 8192-token rollout and cost every writer, the broker and every reader CPU (BENCHMARKS.md,
# issue 33), so rollouts go uncompressed and their topic keeps what the producer sent.
ROLLOUT_COMPRESSION = None
READY_TIMEOUT_S = 300.0  # a new broker takes 10-30 s to create its internal topics; a restarting one with thousands of partitions on a loaded small machine, minutes


class BrokerNotReady(TimeoutError):
    """The broker did not serve what a client needs (topic metadata, a group or transaction coordinator) in time."""


def client_config(security: KafkaSecurity | None = None) -> dict[str, object]:
    """Brokers and TLS/SASL settings shared by producers, consumers and admin clients."""
    return {"bootstrap_servers": kafka_bootstrap(), **(security or KafkaSecurity()).client_kwargs()}


def producer_config(security: KafkaSecurity | None = None, **overrides: object) -> dict[str, object]:
    config: dict[str, object] = {
        **client_config(security),
        "enable_idempotence": True,
        "acks": "all",
        "compression_type": "zstd",
        "linger_ms": 5,
        "batch_size": 1024 * 1024,
        "max_request_size": MAX_MESSAGE_BYTES,
    }
    config.update(overrides)
    return config


def consumer_config(security: KafkaSecurity | None = None, **overrides: object) -> dict[str, object]:
    config: dict[str, object] = {
        **client_config(security),
        "isolation_level": "read_committed",
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_partition_fetch_bytes": MAX_MESSAGE_BYTES,
        "fetch_max_bytes": MAX_MESSAGE_BYTES,
    }
    config.update(overrides)
    return config


def end_offsets(topics: list[str], security: KafkaSecurity | None = None) -> dict[TopicPartition, int]:
    """The current end (next offset) of every partition of `topics`: where "from now on" starts."""
    consumer = KafkaConsumer(**consumer_config(security, group_id=None))
    try:
        partitions = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or [])]
        return listed_offsets(consumer.end_offsets, partitions)
    finally:
        consumer.close()


def listed_offsets(
    list_offsets: Callable[[list[TopicPartition]], dict[TopicPartition, int]], tps: list[TopicPartition], timeout_s: float = 30.0
) -> dict[TopicPartition, int]:
    """`list_offsets(tps)` (a consumer's beginning_offsets or end_offsets), asked again while kafka-python 3.0 leaves out
    a partition whose leader its metadata does not know yet: it raises KeyError for it and refreshes the metadata
    (seen on a mirrored topic just after a region was cut off). Bounded: then it names the partition."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return list_offsets(tps)
        except KeyError as missing:
            if time.monotonic() > deadline:
                raise BrokerNotReady(f"no leader known for {missing.args[0]} within {timeout_s:.0f}s") from missing
            time.sleep(0.5)


class TopicUnavailable(ValueError):
    """A topic this client cannot see: missing, or hidden from its principal by the ACLs (Kafka does not say which)."""


def topic_partitions(consumer: KafkaConsumer, topic: str, security: KafkaSecurity | None = None) -> list[TopicPartition]:
    """Every partition of `topic`, or `TopicUnavailable` naming the principal, instead of silently reading nothing."""
    partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        who = (security or KafkaSecurity()).describe()
        raise TopicUnavailable(
            f"topic {topic} does not exist, or {who} may not read it "
            "(is the topic prefix right? does this role read it: `ember rollouts acls`?)"
        )
    return [TopicPartition(topic, p) for p in sorted(partitions)]


def wait_for_group_coordinator(consumer: KafkaConsumer, partition: TopicPartition, timeout_s: float, who: str) -> None:
    """Block until the consumer's group coordinator answers (it reads `partition`'s committed offset), at most `timeout_s`.

    On a freshly formatted broker the coordinator answers NotCoordinator / CoordinatorNotAvailable until
    `__consumer_offsets` is created and loaded; kafka-python retries those, this bounds the wait and names it.
    """
    try:
        consumer.committed(partition, timeout_ms=int(timeout_s * 1000))
    except KafkaTimeoutError:
        group = consumer.config.get("group_id")
        raise BrokerNotReady(
            f"{who}: the coordinator of consumer group {group!r} on {consumer.config.get('bootstrap_servers')} did not "
            f"answer within {timeout_s:.0f}s (a broker formatted moments ago is still creating __consumer_offsets; "
            "otherwise is it running: `ember dev status`?)"
        ) from None


class WriteFailed(RuntimeError):
    """Records a writer sent that the broker never took: raised at the next write, flush or close, never ignored."""


class RecordWriter:
    """Publishes Rollouts, Rewards or TrainBatches to one topic; counts records and wire bytes. A record the producer
    gives up on (a refused ACL, a fatal producer error) fails the next write, flush or close with `WriteFailed`:
    flushing alone reports nothing, so without this a writer could lose records and exit 0."""

    def __init__(
        self, topic: str, producer: KafkaProducer | None = None, security: KafkaSecurity | None = None, **producer_overrides: object
    ):
        self.topic = topic
        self.producer = producer or KafkaProducer(**producer_config(security, **producer_overrides))
        self.records = 0
        self.bytes = 0
        self.failed = 0
        self._first_failure: BaseException | None = None

    def _record_failure(self, exc: BaseException) -> None:
        self.failed += 1
        self._first_failure = self._first_failure or exc

    def _raise_if_failed(self) -> None:
        if self.failed:
            raise WriteFailed(
                f"{self.failed} of {self.records} records sent to {self.topic} were not written: {self._first_failure!r} "
                f"(may this principal write the topic: `ember rollouts acls`? is the broker up: `ember dev status`?)"
            )

    def write(self, record: Rollout | Reward | TrainBatch):
        self._raise_if_failed()
        key = getattr(record, "group_id", None) or getattr(record, "batch_id")
        value = encode(record)
        try:
            future = self.producer.send(self.topic, key=key.encode("utf-8"), value=value)
        except KafkaTimeoutError as exc:  # send() waits up to max_block_ms for the topic's metadata
            config = self.producer.config
            raise BrokerNotReady(
                f"writer for {self.topic}: no metadata for the topic from {config.get('bootstrap_servers')} within "
                f"{config.get('max_block_ms', 0) / 1000:.0f}s ({exc}): is the broker running (`ember dev status`), "
                f"and does the topic exist (`ember rollouts topics create`)?"
            ) from None
        future.add_errback(self._record_failure)
        self.records += 1
        self.bytes += len(value)
        return future

    def flush(self) -> None:
        """Every record sent so far acknowledged, or `WriteFailed`."""
        self.producer.flush()
        self._raise_if_failed()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.producer.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the body's exception is the one to report; closing still sends what it can
            self.producer.close()


class RolloutWriter(RecordWriter):
    """What an inference worker holds: Rollouts to `<prefix>.rollouts`, keyed by group_id."""

    def __init__(
        self, prefix: str = "ember", producer: KafkaProducer | None = None, security: KafkaSecurity | None = None, **producer_overrides: object
    ):
        super().__init__(Topics(prefix).rollouts, producer, security, **{"compression_type": ROLLOUT_COMPRESSION, **producer_overrides})
        self.tokens = 0

    def write(self, record: Rollout):
        if not isinstance(record, Rollout):
            raise TypeError(f"RolloutWriter writes Rollout records, got {type(record).__name__}")
        self.tokens += record.num_tokens
        return super().write(record)

    @property
    def bytes_per_token(self) -> float:
        """Encoded bytes per rollout token so far (routed experts dominate: 488 B at 61 layers x top-8)."""
        return self.bytes / self.tokens if self.tokens else 0.0


class RewardWriter(RecordWriter):
    """What a grader holds: Rewards to `<prefix>.rewards`, keyed by group_id like their rollouts."""

    def __init__(
        self, prefix: str = "ember", producer: KafkaProducer | None = None, security: KafkaSecurity | None = None, **producer_overrides: object
    ):
        super().__init__(Topics(prefix).rewards, producer, security, **producer_overrides)

    def write(self, record: Reward):
        if not isinstance(record, Reward):
            raise TypeError(f"RewardWriter writes Reward records, got {type(record).__name__}")
        return super().write(record)


@dataclass(frozen=True)
class BadMessage:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    reason: str

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}: {self.reason}"


@dataclass(frozen=True)
class DecodedMessage:
    topic: str
    partition: int
    offset: int
    record: Rollout | Reward | TrainBatch


def decode_message(message: ConsumerRecord) -> DecodedMessage | BadMessage:
    try:
        record = decode(message.value)
    except DecodeError as exc:
        return BadMessage(message.topic, message.partition, message.offset, message.key, str(exc))
    return DecodedMessage(message.topic, message.partition, message.offset, record)


def read_messages(consumer: KafkaConsumer, *, limit: int, idle_timeout_s: float = 10.0) -> Iterator[DecodedMessage | BadMessage]:
    """Poll until `limit` messages arrived or nothing came for `idle_timeout_s`; never more than `limit`."""
    seen = 0
    while seen < limit:
        batch = consumer.poll(timeout_ms=int(idle_timeout_s * 1000), max_records=min(500, limit - seen))
        if not batch:
            return
        for messages in batch.values():
            for message in messages:
                seen += 1
                yield decode_message(message)
