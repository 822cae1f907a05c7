"""`RolloutBatchReader`: the trainer's side of the train-batches topic.

It reads only committed batches (`read_committed`, so an ETL transaction that aborted is never seen),
yields schema `TrainBatch`es with where they were read, and advances its position only when the
trainer says the step is done (`commit()`). `state_dict()` is that position: store it in the trainer
checkpoint and pass it back as `state=` on restart, and the trainer resumes on exactly the batch after
the checkpointed step, even if it had stepped (and committed) further before it crashed. Each batch
also carries `position`, the `state_dict()` the reader will have once that batch is committed.

`next_message()` hands out the next record undecoded: a multi-rank trainer reads on one rank and each
rank decodes only its own share of the batch (`ember.midtrain.rl_batch.rl_batch_share`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from ember.rollouts.config import kafka_bootstrap
from ember.rollouts.security import KafkaSecurity
from ember.rollouts.transport import READY_TIMEOUT_S, consumer_config, topic_partitions, wait_for_group_coordinator
from ember.schemas import DecodeError, TrainBatch, decode_train_batch


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

    def __iter__(self) -> Iterator[ReadBatch]:
        return self

    def __next__(self) -> ReadBatch:
        raw = self.next_message()
        if raw is None:
            raise StopIteration
        try:
            batch = decode_train_batch(raw.value)
        except DecodeError as exc:
            raise DecodeError(f"{self.topic}[{raw.partition}]@{raw.offset}: {exc}") from None
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

    def __enter__(self) -> "RolloutBatchReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
