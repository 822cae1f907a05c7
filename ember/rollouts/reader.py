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


class RolloutFetcher:
    """Reads the rollouts a by-reference batch names: assign + seek on the rollouts topic (no group,
    `read_committed`, large fetches), each message's value checked against its reference's sha256.

    Positions are kept between calls, so consecutive batches (whose rollouts are mostly consecutive in
    a partition) read on without a seek and the consumer's prefetch is not thrown away. The Kafka
    client is made on first use: a rank that only ever sees inline batches never connects."""

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
                    receive_buffer_bytes=SOCKET_BUFFER_BYTES,
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
            if tp not in assigned or consumer.position(tp) != min(offsets):
                consumer.seek(tp, min(offsets))
        values: list[bytes | None] = [None] * len(refs)
        missing = sum(len(o) for o in wanted.values())
        deadline = time.monotonic() + self.timeout_s
        while missing:
            try:
                records = consumer.poll(timeout_ms=500)
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
        for ref in refs:
            start = starts[TopicPartition(ref.topic, ref.partition)]
            if ref.offset < start:
                return MissingRollout(
                    f"rollout {ref} is gone: the partition now starts at offset {start} (retention deleted it; the "
                    "rollouts topic must be retained at least as long as the train-batches topic)"
                )
        first = next((r for i, r in enumerate(refs) if values is None or values[i] is None), refs[0])
        return MissingRollout(f"rollout {first} could not be read: {why}")

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
