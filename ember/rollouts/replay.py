"""`ember rollouts replay`: rebuild batches from the retained input log with different settings.

The same `ShardEngine` as the live ETL runs over a range of the rollouts and rewards topics, fed
through the same `LogClock` merge (log order: broker append time, then rollouts before rewards), with
the policy version that was current at each timestamp: with the live ETL's settings, every deadline
decision is the one the live ETL made. At the end of the range time runs on past every deadline, as
it does live when nothing more is appended. Output goes to a topic or a directory
(`batches.arrow` with TRAIN_BATCH_SCHEMA rows, `outcomes.jsonl`, `summary.json`); the live ETL's
state, offsets and outputs are never touched. Batches to a topic are by reference, like the live
ETL's (the references are the input's own offsets and sha256, so they are the same bytes); batches to
a directory are resolved from the messages read, so the directory stands alone.
"""

from __future__ import annotations

import bisect
import json
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from ember.rollouts.batching import resolve_from_log
from ember.rollouts.config import EtlConfig
from ember.rollouts.engine import (
    REWARDS,
    ROLLOUTS,
    InputMessage,
    ShardEngine,
    ShardOutput,
    input_topics,
)
from ember.rollouts.log_clock import END_OF_TIME_MS, LogClock
from ember.rollouts.records import PolicyVersion
from ember.rollouts.transport import consumer_config, listed_offsets, producer_config, topic_partitions
from ember.schemas import TRAIN_BATCH_SCHEMA, TrainBatch, encode

# a source of the offsets spec: a local role, or a region's mirrored copy (`us.rollouts`, see `input_topics`)
_SOURCE = re.compile(rf"^([a-z][a-z0-9]{{0,15}}\.)?({ROLLOUTS}|{REWARDS})$")


@dataclass(frozen=True)
class ReplayStart:
    """Where to start: `earliest`, a time, or explicit offsets like `rollouts:0=120,us.rewards:0=80`. A region's
    source starts at offsets of its mirrored topic in central: the ones the batch references name."""

    earliest: bool = False
    at_ms: int | None = None
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)

    def check_sources(self, sources: Iterable[str]) -> None:
        """A spec naming a source this config does not read (a region not in `kafka.regions`) would be ignored
        silently: refuse it, naming what the config reads."""
        unknown = sorted({role for role, _ in self.offsets} - set(sources))
        if unknown:
            raise ValueError(f"--from names {', '.join(unknown)}, which this config does not read (it reads {', '.join(sources)})")


def parse_start(text: str) -> ReplayStart:
    text = text.strip()
    if text == "earliest":
        return ReplayStart(earliest=True)
    if "=" in text:
        offsets = {}
        for part in text.split(","):
            where, _, offset = part.partition("=")
            role, _, partition = where.partition(":")
            if not _SOURCE.match(role) or not partition.isdigit() or not offset.strip().isdigit():
                raise ValueError(
                    f"bad offset spec {part!r}: expected [<region>.]rollouts:<partition>=<offset> or [<region>.]rewards:<partition>=<offset>"
                )
            offsets[(role, int(partition))] = int(offset)
        return ReplayStart(offsets=offsets)
    try:
        return ReplayStart(at_ms=int(float(text) * 1000))
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--from {text!r}: use 'earliest', an ISO time (2026-01-31T12:00:00+00:00), unix seconds, "
            "or offsets like rollouts:0=120,rewards:0=80 (a region's mirrored copy: us.rollouts:0=120)"
        ) from None
    if moment.tzinfo is None:
        raise ValueError(f"--from {text!r}: give a timezone (e.g. +00:00) so the start is unambiguous")
    return ReplayStart(at_ms=int(moment.timestamp() * 1000))


def train_batches_to_table(batches: list[TrainBatch]) -> pa.Table:
    """TrainBatches as TRAIN_BATCH_SCHEMA rows; list columns are built from one concatenate each."""

    def lists(arrays: list[np.ndarray], arrow_type: pa.DataType, large: bool = True) -> pa.Array:
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64 if large else np.int32)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        values = pa.array(np.concatenate(arrays) if arrays else np.zeros(0), arrow_type)
        array_type = pa.LargeListArray if large else pa.ListArray
        return array_type.from_arrays(pa.array(offsets), values)

    experts = [b.routed_experts for b in batches]
    return pa.Table.from_pydict(
        {
            "batch_id": [b.batch_id for b in batches],
            "step": [b.step for b in batches],
            "tokens": lists([b.tokens for b in batches], pa.uint32()),
            "loss_mask": lists([b.loss_mask for b in batches], pa.uint8()),
            "advantages": lists([b.advantages for b in batches], pa.float32()),
            "sampler_logprobs": lists([b.sampler_logprobs for b in batches], pa.float32()),
            "cu_seqlens": lists([b.cu_seqlens for b in batches], pa.int32(), large=False),
            "policy_versions": lists([b.policy_versions for b in batches], pa.int64(), large=False),
            "rollout_ids": [list(b.rollout_ids) for b in batches],
            "source_offsets": [
                [{"topic": o.topic, "partition": o.partition, "start": o.start, "end": o.end} for o in b.source_offsets]
                for b in batches
            ],
            "routed_experts": [None if e is None else e.tobytes() for e in experts],
            "routed_experts_shape": [None if e is None else list(e.shape) for e in experts],
            "routed_experts_dtype": [None if e is None else e.dtype.name for e in experts],
            "created_at": pa.array([b.created_at_us for b in batches], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            "advantage_estimator": [b.advantage_estimator for b in batches],
            "episode_ids": [list(b.episode_ids) or None for b in batches],
            "advantage_estimators": [list(b.advantage_estimators) or None for b in batches],
        },
        schema=TRAIN_BATCH_SCHEMA,
    )


@dataclass
class ReplaySummary:
    batches: int = 0
    rollouts: int = 0
    tokens: int = 0
    messages: int = 0
    outcomes: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {
            "batches": self.batches,
            "rollouts": self.rollouts,
            "tokens": self.tokens,
            "messages": self.messages,
            "outcomes": {f"{k}/{r}": n for (k, r), n in sorted(self.outcomes.items())},
            "seconds": round(self.seconds, 3),
        }


class _Policy:
    """Policy versions by publish time, so staleness is judged against what was current then."""

    def __init__(self, records: list[tuple[int, int]]):
        records.sort()
        self.times = [t for t, _ in records]
        self.best = list(np.maximum.accumulate([v for _, v in records])) if records else []

    def at(self, ms: int) -> int | None:
        i = bisect.bisect_right(self.times, ms)
        return int(self.best[i - 1]) if i else None


def _read_range(consumer: KafkaConsumer, starts: dict[TopicPartition, int], ends: dict[TopicPartition, int]) -> list:
    live = {tp for tp in starts if starts[tp] < ends[tp]}
    messages = []
    if not live:
        return messages
    consumer.assign(sorted(live))
    for tp in live:
        consumer.seek(tp, starts[tp])
    while live:
        batch = consumer.poll(timeout_ms=1000)
        for tp, records in batch.items():
            messages.extend(r for r in records if r.offset < ends[tp])
        for tp in list(live):
            if consumer.position(tp) >= ends[tp]:
                live.discard(tp)
    return messages


def replay(config: EtlConfig, start: ReplayStart, *, to_topic: str | None = None, to_dir: Path | None = None) -> ReplaySummary:
    """With `source: product`, each shard is a `ProductShard` over a temporary spill store
    (`ember.rollouts.product_etl.replay_shards`)."""
    if (to_topic is None) == (to_dir is None):
        raise ValueError("give exactly one of to_topic or to_dir")
    if config.source == "product":
        from ember.rollouts.product_etl import replay_shards

        with replay_shards(config) as make_engine:
            return _replay(config, start, make_engine, to_topic, to_dir)
    return _replay(config, start, lambda shard, _inputs: ShardEngine(config, shard, config.kafka.topics), to_topic, to_dir)


def _replay(config: EtlConfig, start: ReplayStart, make_engine, to_topic: str | None, to_dir: Path | None) -> ReplaySummary:
    kafka = config.kafka
    topics = kafka.topics
    inputs = input_topics(topics, config.source, kafka.regions)
    start.check_sources(inputs)
    consumer = KafkaConsumer(**consumer_config(kafka.security, bootstrap_servers=kafka.bootstrap, group_id=None))
    producer = KafkaProducer(**producer_config(kafka.security, bootstrap_servers=kafka.bootstrap)) if to_topic else None
    summary = ReplaySummary()
    started = time.monotonic()
    batches: list[TrainBatch] = []
    outcome_lines: list[str] = []
    sent = []
    try:
        for topic in inputs.values():  # a typo'd prefix or a region not mirrored yet: named now, not a read timeout later
            # (and every input in the consumer's metadata before an offsets request: kafka-python 3.0 leaves out of its
            # answer a partition whose topic a request adds, and the lookup of it raised KeyError)
            topic_partitions(consumer, topic, kafka.security)
        policy_tp = TopicPartition(topics.policy_versions, 0)
        policy_records = []
        for message in _read_range(consumer, {policy_tp: 0}, consumer.end_offsets([policy_tp])):
            try:
                policy_records.append((message.timestamp, PolicyVersion.decode(message.value).policy_version))
            except ValueError:
                continue
        policy = _Policy(policy_records)
        shards = sorted(consumer.partitions_for_topic(topics.rollouts) or [])
        for shard in shards:
            tps = {role: TopicPartition(topic, shard) for role, topic in inputs.items()}
            ends = listed_offsets(consumer.end_offsets, list(tps.values()))
            starts = _start_offsets(consumer, start, tps)
            messages = _read_range(consumer, starts, ends)
            clock: LogClock[InputMessage] = LogClock(tps)
            role_of = {tp.topic: role for role, tp in tps.items()}
            for message in messages:
                timestamp = max(message.timestamp or 0, 0)  # as the live ETL reads an unstamped record
                item = InputMessage(message.topic, shard, message.offset, timestamp, message.key, message.value)
                clock.read(role_of[message.topic], timestamp, item)
            for role, tp in tps.items():  # read to its end, which is all there will be
                clock.end_offset(role, position=ends[tp], end=ends[tp], asked_at_ms=END_OF_TIME_MS)
            engine = make_engine(shard, inputs)
            for _role, item in clock.release():
                engine.ingest(item, latest_policy=policy.at(item.timestamp_ms))
            engine.finish(policy.at(engine.now_ms))
            output, _snapshot, _marks = engine.checkpoint("replay")
            summary.messages += len(messages)
            values = {(m.topic, m.partition, m.offset): m.value for m in messages} if to_dir is not None else {}
            sent += _collect(output, summary, batches, outcome_lines, producer, to_topic, values)
        if producer is not None:
            producer.flush()
            for future in sent:  # a batch the broker refused (ACLs) or lost is an error, never counted as replayed
                future.get()
    finally:
        consumer.close()
        if producer is not None:
            producer.close()
    summary.seconds = time.monotonic() - started
    if to_dir is not None:
        _write_dir(to_dir, batches, outcome_lines, summary)
    return summary


def _start_offsets(consumer: KafkaConsumer, start: ReplayStart, tps: dict[str, TopicPartition]) -> dict[TopicPartition, int]:
    beginnings = listed_offsets(consumer.beginning_offsets, list(tps.values()))
    if start.at_ms is not None:
        found = consumer.offsets_for_times({tp: start.at_ms for tp in tps.values()})
        ends = listed_offsets(consumer.end_offsets, list(tps.values()))
        return {tp: (found[tp].offset if found.get(tp) is not None else ends[tp]) for tp in tps.values()}
    return {
        tp: max(beginnings[tp], start.offsets.get((role, tp.partition), beginnings[tp])) for role, tp in tps.items()
    }


def _collect(output: ShardOutput, summary: ReplaySummary, batches: list, outcome_lines: list, producer, to_topic, values: dict) -> list:
    """Adds the shard's batches and outcomes to the summary and the output; returns the futures of the batches sent."""
    sent = []
    for emitted in output.batches:
        batch = emitted.batch
        summary.batches += 1
        summary.rollouts += batch.num_sequences
        summary.tokens += batch.num_tokens
        if producer is not None:
            sent.append(producer.send(to_topic, key=batch.batch_id.encode(), value=encode(batch)))
        else:
            batches.append(resolve_from_log(batch, values))
    for outcome in output.outcomes:
        summary.outcomes[(outcome.kind, outcome.reason)] += 1
        outcome_lines.append(outcome.encode().decode())
    return sent


def _write_dir(path: Path, batches: list[TrainBatch], outcome_lines: list[str], summary: ReplaySummary) -> None:
    from pyarrow import ipc

    path.mkdir(parents=True, exist_ok=True)
    table = train_batches_to_table(batches)
    with ipc.new_file(str(path / "batches.arrow"), table.schema) as writer:
        writer.write_table(table)
    (path / "outcomes.jsonl").write_text("".join(line + "\n" for line in outcome_lines))
    (path / "summary.json").write_text(json.dumps(summary.as_dict(), indent=2) + "\n")
