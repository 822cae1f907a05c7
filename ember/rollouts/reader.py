"""`RolloutBatchReader`: the trainer's side of the train-batches topic.

It reads only committed batches (`read_committed`, so an ETL transaction that aborted is never seen),
yields schema `TrainBatch`es with where they were read, and advances its position only when the
trainer says the step is done (`commit()`). `state_dict()` is that position: store it in the trainer
checkpoint and pass it back as `state=` on restart, and the trainer resumes on exactly the batch after
the checkpointed step, even if it had stepped (and committed) further before it crashed. Each batch
also carries `position`, the `state_dict()` the reader will have once that batch is committed.

`next_message()` hands out the next record undecoded: a multi-rank trainer reads on one rank and each
rank decodes only its own share of the batch (`ember.midtrain.rl.batch.rl_batch_share`).

The ETL writes batches by reference (claim check: see `TrainBatch`); iterating the reader yields them
resolved, the rollouts fetched by a `RolloutFetcher` from the rollouts topic itself, each message's
sha256 checked against the batch's reference. A rank that trains a share fetches only that share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
from kafka import KafkaConsumer, TopicPartition
from kafka.errors import OffsetOutOfRangeError
from kafka.structs import OffsetAndMetadata

from ember.rollouts.batching import MissingRollout, referenced_rollout, resolve_train_batch
from ember.rollouts.config import kafka_bootstrap
from ember.rollouts.security import KafkaSecurity
from ember.rollouts.topics import MAX_MESSAGE_BYTES
from ember.rollouts.transport import READY_TIMEOUT_S, consumer_config, topic_partitions, wait_for_group_coordinator
from ember.schemas import DecodeError, Rollout, RolloutRef, TrainBatch, decode_train_batch

FETCH_BYTES = 4 * MAX_MESSAGE_BYTES  # one fetch may carry a whole batch's rollouts
SOCKET_BUFFER_BYTES = 8 * 1024 * 1024
READ_THROUGH = 16  # records: librdkafka's fetcher reads a forward gap this small (one 64 MB fetch of 4 MB rollouts) through
PARTITION_FETCH_BYTES = 1024 * 1024  # kafka-python's fetcher: per partition and fetch; a larger record batch still comes whole, alone


class RolloutFetcher:
    """Reads the rollouts a by-reference batch names: assign + seek on the rollouts topic (no group,
    `read_committed`, large fetches), each message's value checked against its reference's sha256.

    Positions are kept between calls, so consecutive batches (whose rollouts are mostly consecutive in
    a partition) read on without a seek and the consumer's prefetch is not thrown away. A rank of several
    wants every other run of offsets (the other ranks' shares lie between its own), so each fetch asks a
    partition for at most `PARTITION_FETCH_BYTES` (a 4 MB rollout is a batch of its own and comes alone, per
    KIP-74; small rollouts come many to a fetch) and a gap is sought over: a seek drops at most that much fetched
    ahead, where 64 MB fetches made every rank receive every rank's rollouts. The Kafka client is made on first
    use: a rank that only ever sees inline batches never connects."""

    read_through = 0  # records of a forward gap read rather than sought over

    def __init__(self, *, bootstrap: str | None = None, security: KafkaSecurity | None = None, timeout_s: float = 60.0):
        self.bootstrap, self.security, self.timeout_s = bootstrap, security, timeout_s
        self._consumer: KafkaConsumer | None = None
        self.bytes = 0  # rollout message bytes fetched and used

    @property
    def consumer(self) -> KafkaConsumer:
        if self._consumer is None:
            self._consumer = KafkaConsumer(
                **consumer_config(
                    self.security, bootstrap_servers=self.bootstrap or kafka_bootstrap(), group_id=None,
                    auto_offset_reset="none", max_poll_records=1, fetch_max_bytes=FETCH_BYTES,
                    max_partition_fetch_bytes=PARTITION_FETCH_BYTES, receive_buffer_bytes=SOCKET_BUFFER_BYTES,
                )
            )
        return self._consumer

    def fetch(self, refs: Sequence[RolloutRef]) -> list[bytes]:
        """The referenced messages' values, in reference order; MissingRollout names the first one that
        is gone (retention) or skipped (not in the log). `rollouts` checks their sha256."""
        wanted: dict[TopicPartition, dict[int, int]] = {}
        for index, ref in enumerate(refs):
            wanted.setdefault(TopicPartition(ref.topic, ref.partition), {})[ref.offset] = index
        consumer = self.consumer
        assigned = consumer.assignment()
        if not set(wanted) <= assigned:
            consumer.assign(sorted(assigned | set(wanted)))
        consumer.pause(*(consumer.assignment() - set(wanted)))
        consumer.resume(*wanted)
        for tp, offsets in wanted.items():  # a new partition has no position yet (and no reset policy)
            if tp not in assigned or not 0 <= min(offsets) - consumer.position(tp) <= self.read_through:
                consumer.seek(tp, min(offsets))
        values: list[bytes | None] = [None] * len(refs)
        missing = sum(len(o) for o in wanted.values())
        deadline = time.monotonic() + self.timeout_s
        while missing:
            try:
                # timeout 0 first: kafka-python parks a paused partition's fetched records and gives a resumed one's
                # back only on a later call, so at a switch of partitions the first poll finds nothing buffered and
                # nothing in flight, and with a timeout it sleeps retry_backoff_ms (100 ms) before that later call
                records = consumer.poll(timeout_ms=0) or consumer.poll(timeout_ms=500)
            except OffsetOutOfRangeError as exc:
                raise self._gone(refs, wanted, f"the broker answered {exc!r}") from None
            for tp, messages in records.items():
                for message in messages:
                    index = wanted.get(tp, {}).get(message.offset)
                    if index is None or values[index] is not None:
                        continue
                    values[index] = message.value
                    self.bytes += len(message.value)
                    missing -= 1
            for tp, offsets in wanted.items():
                if consumer.position(tp) > max(offsets) and any(values[i] is None for i in offsets.values()):
                    raise self._gone(refs, wanted, f"{tp.topic}[{tp.partition}] was read past it without finding it")
            if missing and time.monotonic() > deadline:
                raise self._gone(refs, wanted, f"not readable within {self.timeout_s:.0f}s", values=values)
        return values  # type: ignore[return-value]

    def _gone(self, refs: Sequence[RolloutRef], wanted: dict, why: str, values: list | None = None) -> MissingRollout:
        starts = self.consumer.beginning_offsets(list(wanted))
        return missing_rollout(refs, lambda ref: starts[TopicPartition(ref.topic, ref.partition)], why, values)

    def rollouts(self, refs: Sequence[RolloutRef]) -> list[Rollout]:
        """The referenced rollouts, decoded (structure checked; the ETL validated these very bytes)."""
        return [referenced_rollout(ref, value) for ref, value in zip(refs, self.fetch(refs))]

    def resolve(self, batch: TrainBatch) -> TrainBatch:
        """`batch` inline: fetched and resolved if it is by reference, else as it is."""
        return resolve_train_batch(batch, self.rollouts(batch.rollout_refs)) if batch.by_reference else batch

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


LIBRDKAFKA_NAMES = {"security_protocol": "security.protocol", "ssl_cafile": "ssl.ca.location", "sasl_mechanism": "sasl.mechanism",
                    "sasl_plain_username": "sasl.username", "sasl_plain_password": "sasl.password"}


def librdkafka_security(security: KafkaSecurity | None) -> dict[str, object]:
    """The same TLS/SASL settings under librdkafka's names (from `client_kwargs`, the one place they are read)."""
    kwargs = (security or KafkaSecurity()).client_kwargs()
    conf: dict[str, object] = {LIBRDKAFKA_NAMES[k]: v for k, v in kwargs.items() if k in LIBRDKAFKA_NAMES}
    if "ssl_check_hostname" in kwargs:
        conf["ssl.endpoint.identification.algorithm"] = "https" if kwargs["ssl_check_hostname"] else "none"
    return conf


class RdkafkaRolloutFetcher(RolloutFetcher):
    """`RolloutFetcher` on confluent-kafka (librdkafka): the same references, `read_committed`, sha256 checks and
    errors, but the fetches run in librdkafka's own thread in C, ahead of the Python that decodes and checks.

    kafka-python's fetch path (frame reads, `bytes.join`, record decoding, all in Python under the GIL) was 55%
    of a rank's time; here a rank's Python only copies each value out once. librdkafka fetches ahead into its own
    queue, which a seek empties, so this fetcher reads a gap of up to `READ_THROUGH` records through."""

    read_through = READ_THROUGH

    @property
    def consumer(self):
        if self._consumer is None:
            from confluent_kafka import Consumer

            self._consumer = Consumer({
                "bootstrap.servers": self.bootstrap or kafka_bootstrap(), **librdkafka_security(self.security),
                "group.id": "ember-rollout-fetcher", "enable.auto.commit": False, "enable.auto.offset.store": False,
                "isolation.level": "read_committed", "auto.offset.reset": "error",
                "fetch.max.bytes": FETCH_BYTES, "max.partition.fetch.bytes": MAX_MESSAGE_BYTES,
                "receive.message.max.bytes": FETCH_BYTES + 1024 * 1024, "socket.receive.buffer.bytes": SOCKET_BUFFER_BYTES,
                "queued.max.messages.kbytes": 2 * MAX_MESSAGE_BYTES // 1024,
            })
            self._assigned: dict[tuple[str, int], int] = {}  # partition -> next offset this fetcher will see
        return self._consumer

    def fetch(self, refs: Sequence[RolloutRef]) -> list[bytes]:
        from confluent_kafka import KafkaError, TopicPartition as RdPartition

        wanted: dict[tuple[str, int], dict[int, int]] = {}
        for index, ref in enumerate(refs):
            wanted.setdefault((ref.topic, ref.partition), {})[ref.offset] = index
        consumer = self.consumer
        moved = [key for key, offsets in wanted.items()
                 if key not in self._assigned or not 0 <= min(offsets) - self._assigned[key] <= self.read_through]
        if moved:  # a new partition, or not where the prefetch stands: (re)start it at the first wanted offset
            for key in moved:
                self._assigned[key] = min(wanted[key])
            consumer.assign([RdPartition(t, p, o) for (t, p), o in self._assigned.items()])
        idle = [RdPartition(t, p) for key in self._assigned if key not in wanted for t, p in [key]]
        if idle:
            consumer.pause(idle)
        consumer.resume([RdPartition(t, p) for t, p in wanted])
        values: list[bytes | None] = [None] * len(refs)
        missing = sum(len(o) for o in wanted.values())
        deadline = time.monotonic() + self.timeout_s
        while missing:
            for message in consumer.consume(num_messages=64, timeout=0.5):
                error = message.error()
                key = (message.topic(), message.partition())
                if error is not None:
                    if error.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                        raise self._gone(refs, {TopicPartition(*key): wanted.get(key, {})}, f"the broker answered {error}")
                    if error.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise MissingRollout(f"rollout {refs[0]} could not be read: {error}")
                self._assigned[key] = message.offset() + 1
                index = wanted.get(key, {}).get(message.offset())
                if index is None or values[index] is not None:
                    continue
                values[index] = message.value()
                self.bytes += len(values[index])
                missing -= 1
            for key, offsets in wanted.items():
                if self._assigned[key] > max(offsets) and any(values[i] is None for i in offsets.values()):
                    raise self._gone(refs, {TopicPartition(*key): offsets}, f"{key[0]}[{key[1]}] was read past it without finding it")
            if missing and time.monotonic() > deadline:
                raise self._gone(refs, {TopicPartition(*k): o for k, o in wanted.items()}, f"not readable within {self.timeout_s:.0f}s", values=values)
        return values  # type: ignore[return-value]

    def _gone(self, refs: Sequence[RolloutRef], wanted: dict, why: str, values: list | None = None) -> MissingRollout:
        from confluent_kafka import TopicPartition as RdPartition

        def start_of(ref: RolloutRef) -> int:
            return self.consumer.get_watermark_offsets(RdPartition(ref.topic, ref.partition), timeout=10)[0]

        return missing_rollout(refs, start_of, why, values)



def missing_rollout(refs: Sequence[RolloutRef], start_of, why: str, values: list | None = None) -> MissingRollout:
    """Why `refs` could not be read: a reference below its partition's first offset (`start_of`) was deleted by
    retention, which says what to fix; otherwise the first unread reference and `why`. Both fetchers report this way."""
    for ref in refs:
        start = start_of(ref)
        if ref.offset < start:
            return MissingRollout(
                f"rollout {ref} is gone: the partition now starts at offset {start} (retention deleted it; the "
                "rollouts topic must be retained at least as long as the train-batches topic)"
            )
    first = next((r for i, r in enumerate(refs) if values is None or values[i] is None), refs[0])
    return MissingRollout(f"rollout {first} could not be read: {why}")

@dataclass
class ReadBatch:
    """One batch as the trainer gets it: the record (ids, offsets, step, arrays) and where it was read."""

    batch: TrainBatch
    partition: int
    offset: int
    position: dict[str, Any]

    @property
    def max_seqlen(self) -> int:
        return int(np.diff(self.batch.cu_seqlens).max())


@dataclass
class RawBatch:
    """One batch record as read, not decoded: its bytes, where it was read and the position after it."""

    value: bytes
    partition: int
    offset: int
    position: dict[str, Any]


class RolloutBatchReader:
    def __init__(
        self,
        topic: str,
        *,
        group_id: str = "ember-trainer",
        state: dict[str, Any] | None = None,
        bootstrap: str | None = None,
        idle_timeout_s: float | None = None,
        security: KafkaSecurity | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ):
        """`state` is a previous `state_dict()`; without it the group's committed position is used.

        `security` defaults to EMBER_KAFKA_* (see `ember.rollouts.security`). On a freshly formatted broker the
        group's coordinator is waited for, at most `ready_timeout_s` (then `BrokerNotReady`)."""
        self.topic = topic
        self.idle_timeout_s = idle_timeout_s
        self.consumer = KafkaConsumer(
            **consumer_config(security, bootstrap_servers=bootstrap or kafka_bootstrap(), group_id=group_id, max_poll_records=1)
        )
        try:
            self.partitions = topic_partitions(self.consumer, topic, security)
            wait_for_group_coordinator(self.consumer, self.partitions[0], ready_timeout_s, f"trainer reader of {topic}")
        except BaseException:
            self.consumer.close()
            raise
        self.consumer.assign(self.partitions)
        if state is not None:
            if state.get("topic") != topic:
                self.consumer.close()
                raise ValueError(f"reader state is for topic {state.get('topic')!r}, not {topic!r}")
            for tp in self.partitions:
                offset = state["offsets"].get(str(tp.partition))
                if offset is None:
                    self.consumer.seek_to_beginning(tp)
                else:
                    self.consumer.seek(tp, int(offset))
        self._stepped = {tp.partition: self.consumer.position(tp) for tp in self.partitions}
        self._consumed = dict(self._stepped)
        self._buffer: list = []
        self.fetcher = RolloutFetcher(bootstrap=bootstrap, security=security)

    def __iter__(self) -> Iterator[ReadBatch]:
        return self

    def __next__(self) -> ReadBatch:
        raw = self.next_message()
        if raw is None:
            raise StopIteration
        try:
            batch = self.fetcher.resolve(decode_train_batch(raw.value))
        except DecodeError as exc:
            raise type(exc)(f"{self.topic}[{raw.partition}]@{raw.offset}: {exc}") from None
        return ReadBatch(batch, raw.partition, raw.offset, raw.position)

    def next_message(self) -> RawBatch | None:
        """The next record undecoded, or None when none arrived within `idle_timeout_s` (None: wait)."""
        deadline = None if self.idle_timeout_s is None else time.monotonic() + self.idle_timeout_s
        while not self._buffer:
            for messages in self.consumer.poll(timeout_ms=500).values():
                self._buffer.extend(messages)
            if not self._buffer and deadline is not None and time.monotonic() > deadline:
                return None
        message = self._buffer.pop(0)
        self._consumed[message.partition] = message.offset + 1
        return RawBatch(message.value, message.partition, message.offset, self._position(self._consumed))

    def commit(self) -> None:
        """The trainer finished the step on every batch yielded so far: advance and commit the position."""
        self._stepped = dict(self._consumed)
        self.consumer.commit({TopicPartition(self.topic, p): OffsetAndMetadata(o, "", -1) for p, o in self._stepped.items()})

    def state_dict(self) -> dict[str, Any]:
        """Position after the last committed step, for the trainer checkpoint."""
        return self._position(self._stepped)

    def _position(self, offsets: dict[int, int]) -> dict[str, Any]:
        return {"topic": self.topic, "offsets": {str(p): o for p, o in sorted(offsets.items())}}

    def close(self) -> None:
        self.consumer.close(autocommit=False)
        self.fetcher.close()

    def __enter__(self) -> "RolloutBatchReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
