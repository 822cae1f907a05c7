"""`ember rollouts grade CONFIG`: the consumer-group service that turns rollouts into rewards, exactly once.

Run several: they share the rollouts topic's partitions as one consumer group (static members, so a restarted
instance takes its partitions straight back). Each poll's rollouts are decoded, found in the task set by
`prompt_id`, detokenized (the loss-masked tokens: what the policy wrote) and graded by every configured grader;
one Reward per grader goes to the rewards partition of the same index (the ETL joins partition p with p), and
a rollout that cannot be graded goes to the dead-letter topic with its reason. All of it is committed in one
Kafka transaction together with the consumed offsets (`send_offsets_to_transaction` with the consumer's group
metadata, so a fenced zombie or a member that lost its partitions cannot commit). Nothing is held across polls,
so any Kafka error or rebalance is survived the same way: abort, rebuild the clients, re-read from the
committed offsets. A grader killed at any moment therefore neither loses nor doubles a reward.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import AuthorizationError, KafkaError, SaslAuthenticationFailedError
from kafka.structs import OffsetAndMetadata

from ember.rollouts.admin import READY_TIMEOUT_S, wait_until_ready
from ember.rollouts.faults import crash_point
from ember.rollouts.grading.base import Grade, Task
from ember.rollouts.grading.config import BuiltGrader, GraderConfig
from ember.rollouts.grading.metrics import GraderMetrics
from ember.rollouts.transport import consumer_config, producer_config, topic_partitions
from ember.schemas import DecodeError, Reward, Rollout, decode_rollout, encode

log = logging.getLogger("ember.grader")

LAG_REFRESH_S = 1.0  # how often the owned partitions' end offsets are asked for (lag gauge, --until-idle)


class DeadReason(StrEnum):
    """Why a rollout got no reward from this service: a closed set, safe as a metrics label."""

    MALFORMED = "malformed"  # not a Rollout on the wire
    UNKNOWN_PROMPT = "unknown_prompt"  # its prompt_id is not in the task set
    UNDECODABLE = "undecodable"  # its completion tokens are not text under the configured tokenizer
    INVALID_GRADE = "invalid_grade"  # a grader returned a grade no Reward can carry (not finite, ...)


class GraderTopologyError(RuntimeError):
    """The topics cannot carry graded rewards (rollouts and rewards partition counts differ)."""


@dataclass
class GradeTotals:
    """What one grading process committed since it started: the status lines' rates and the exit summary."""

    rollouts: int = 0
    rewards: int = 0
    verdicts: Counter = field(default_factory=Counter)
    dead: Counter = field(default_factory=Counter)


@dataclass
class _Dead:
    message: ConsumerRecord
    reason: DeadReason
    detail: str


@dataclass
class _Outcome:
    """One poll's work, ready to commit: rewards per partition, dead letters, and the offsets to commit."""

    rewards: list[tuple[int, Reward]] = field(default_factory=list)
    dead: list[_Dead] = field(default_factory=list)
    offsets: dict[TopicPartition, int] = field(default_factory=dict)
    graded: int = 0


def _counts(counts: Counter, width: int) -> str:
    """'failed 12, passed 3' within `width` columns, the rest as '+N'."""
    parts = [f"{key} {n}" for key, n in counts.most_common()]
    text = ""
    for i, part in enumerate(parts):
        candidate = f"{text}, {part}" if text else part
        if len(candidate) > width:
            return f"{text}, +{len(parts) - i}" if text else f"+{len(parts)}"
        text = candidate
    return text


def status_line(totals: GradeTotals, previous: GradeTotals, seconds: float, lag: int) -> str:
    """One line within 80 columns: grading rate since the last line, lag, dead letters, verdicts since the start."""
    rate = (totals.rollouts - previous.rollouts) / max(seconds, 1e-9)
    head = f"graded {rate:.1f}/s lag {lag} dead {sum(totals.dead.values())}"
    return f"{head} ({_counts(totals.verdicts, 80 - len(head) - 3)})" if totals.verdicts else head


def summary_lines(totals: GradeTotals, seconds: float, recoveries: int) -> list[str]:
    lines = [f"stopped after {seconds:.1f}s: {totals.rollouts} rollouts graded, {totals.rewards} rewards, "
             f"{sum(totals.dead.values())} dead letters"]
    if totals.verdicts:
        lines.append(f"  verdicts: {_counts(totals.verdicts, 64)}")
    if totals.dead:
        lines.append(f"  dead letters: {_counts(totals.dead, 60)}")
    if recoveries:
        lines.append(f"  {recoveries} recoveries (clients rebuilt after Kafka errors)")
    return lines


class GradingService:
    def __init__(
        self,
        config: GraderConfig,
        tasks: Mapping[str, Task],
        detokenize: Callable[[list[int]], str],
        graders: Sequence[BuiltGrader],
        instance: str = "0",
        metrics: GraderMetrics | None = None,
    ):
        """`detokenize` turns token ids into text or raises ValueError saying why not (the tokenizer's `decode`)."""
        self.config = config
        self.tasks = tasks
        self.detokenize = detokenize
        self.graders = list(graders)
        self.instance = instance
        self.metrics = metrics or GraderMetrics()
        self.topics = config.kafka.topics
        self.totals = GradeTotals()
        self.recoveries = 0
        self.lag = 0
        self._consumer: KafkaConsumer | None = None
        self._producer: KafkaProducer | None = None
        self._lag_at = float("-inf")
        self._lag_of: frozenset[TopicPartition] = frozenset()
        self._quiet_since: float | None = None
        self._status_at = time.monotonic()
        self._status_from = GradeTotals()
        self._last_input = time.monotonic()
        for built in self.graders:  # once: a grader's own metrics (the judge's latency, errors) on the same endpoint
            bind = getattr(built.grader, "bind_metrics", None)
            if bind is not None:
                bind(self.metrics.registry)

    @property
    def member_id(self) -> str:
        return f"{self.config.kafka.group_id}-{self.instance}"

    # ---- lifecycle ---------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None, *, until_idle_s: float | None = None,
            ready_timeout_s: float = READY_TIMEOUT_S) -> GradeTotals:
        """Grade until `stop` is set, or (with `until_idle_s`) until every owned partition is read to its end and
        nothing came for that long. Refusals and a broker not ready at start raise; later Kafka errors are
        recovered from without limit."""
        stop = stop or threading.Event()
        kafka = self.config.kafka
        started = time.monotonic()
        failures = 0
        try:
            wait_until_ready(
                kafka.bootstrap, kafka.security, topics=[self.topics.rollouts, self.topics.rewards], group_id=kafka.group_id,
                transactional_id=self.member_id, who=f"grader {self.member_id}", timeout_s=ready_timeout_s,
            )
            while not stop.is_set():
                try:
                    self._connect()
                    failures = 0
                    while not stop.is_set():
                        self._step()
                        if until_idle_s is not None and self._idle_for(until_idle_s):
                            stop.set()
                except (AuthorizationError, SaslAuthenticationFailedError, GraderTopologyError):
                    raise
                except (KafkaError, OSError, TimeoutError) as exc:
                    failures += 1
                    self.recoveries += 1
                    self.metrics.recoveries.inc()
                    log.warning("grader %s: %r; rebuilding clients, re-reading from committed offsets (attempt %d)",
                                self.member_id, exc, failures)
                    self._disconnect()
                    stop.wait(min(0.5 * 2**failures, 10.0))
        finally:
            self._disconnect()
            for line in summary_lines(self.totals, time.monotonic() - started, self.recoveries):
                log.info("grader %s %s", self.instance, line)
        return self.totals

    def _connect(self) -> None:
        kafka = self.config.kafka
        producer = KafkaProducer(**producer_config(
            kafka.security, bootstrap_servers=kafka.bootstrap, transactional_id=self.member_id,
            transaction_timeout_ms=kafka.transaction_timeout_ms, client_id=f"{self.member_id}-producer", linger_ms=0,
        ))
        try:
            producer.init_transactions()  # fences the previous incarnation of this instance and aborts its open transaction
            consumer = KafkaConsumer(**consumer_config(
                kafka.security, bootstrap_servers=kafka.bootstrap, group_id=kafka.group_id, group_instance_id=self.member_id,
                client_id=f"{self.member_id}-consumer", session_timeout_ms=kafka.session_timeout_ms,
                heartbeat_interval_ms=kafka.heartbeat_interval_ms, max_poll_records=kafka.max_poll_records,
            ))
        except BaseException:
            producer.close(timeout=5)
            raise
        self._producer, self._consumer = producer, consumer
        rollouts = topic_partitions(consumer, self.topics.rollouts, kafka.security)
        rewards = topic_partitions(consumer, self.topics.rewards, kafka.security)
        if len(rollouts) != len(rewards):
            raise GraderTopologyError(
                f"{self.topics.rollouts} has {len(rollouts)} partitions but {self.topics.rewards} has {len(rewards)}: a "
                "rollout's rewards go to the partition of the same index, where the ETL joins them; give both the same count"
            )
        consumer.subscribe([self.topics.rollouts])
        log.info("grader %s reads %s as %s with %s", self.member_id, self.topics.rollouts, kafka.security.describe(),
                 ", ".join(f"{b.spec.name} ({b.spec.kind} v{b.version})" for b in self.graders))

    def _disconnect(self) -> None:
        consumer, producer, self._consumer, self._producer = self._consumer, self._producer, None, None
        for close in (lambda: consumer and consumer.close(autocommit=False), lambda: producer and producer.close(timeout=5)):
            try:
                close()
            except Exception as exc:  # closing after a failure must never mask the failure itself
                log.debug("ignoring error while closing a client: %r", exc)

    def _idle_for(self, seconds: float) -> bool:
        """Settled for `seconds` without interruption: partitions assigned, no lag by end offsets asked for after the
        last input came and for the partitions owned now. A lag measured before the group assigned anything is 0
        while the topic is full (a loaded broker takes seconds to assign): it must not count."""
        assignment = frozenset(self._consumer.assignment()) if self._consumer else frozenset()
        settled = bool(assignment) and assignment == self._lag_of and self.lag == 0 and self._lag_at > self._last_input
        if not settled:
            self._quiet_since = None
            return False
        if self._quiet_since is None:
            self._quiet_since = time.monotonic()
        return time.monotonic() - self._quiet_since >= seconds

    # ---- the loop ----------------------------------------------------------------------------

    def _step(self) -> None:
        assert self._consumer is not None
        records = self._consumer.poll(timeout_ms=self.config.kafka.poll_timeout_ms)
        messages = [m for batch in records.values() for m in batch]
        if messages:
            self._last_input = time.monotonic()
            outcome = self._grade(messages)
            self._commit(outcome)
        self._refresh_lag()
        self._report_status()

    def _grade(self, messages: list[ConsumerRecord]) -> _Outcome:
        outcome = _Outcome()
        work: list[tuple[ConsumerRecord, Rollout, Task, str]] = []
        for message in messages:
            tp = TopicPartition(message.topic, message.partition)
            outcome.offsets[tp] = max(outcome.offsets.get(tp, 0), message.offset + 1)
            found = self._prepare(message)
            if isinstance(found, _Dead):
                outcome.dead.append(found)
            else:
                work.append((message, *found))
        if not work:
            return outcome
        items = [(task, text) for _m, _r, task, text in work]
        keys = [hashlib.sha256(message.value).hexdigest() for message, *_ in work]
        now_us = time.time_ns() // 1000
        for built in self.graders:
            began = time.perf_counter()
            grades = built.grader.grade_batch(items, keys=keys) if built.keyed else built.grader.grade_batch(items)
            self.metrics.grading_seconds.labels(built.spec.name).observe(time.perf_counter() - began)
            if len(grades) != len(items):
                raise RuntimeError(f"grader {built.spec.name} returned {len(grades)} grades for {len(items)} completions")
            for (message, rollout, _task, _text), grade in zip(work, grades):
                reward = self._reward(built, rollout, grade, now_us)
                if isinstance(reward, str):
                    outcome.dead.append(_Dead(message, DeadReason.INVALID_GRADE, f"grader {built.spec.name}: {reward}"))
                else:
                    outcome.rewards.append((message.partition, reward))
        outcome.graded = len(work)
        return outcome

    def _prepare(self, message: ConsumerRecord) -> tuple[Rollout, Task, str] | _Dead:
        """The rollout, its task and its completion's text, or why it cannot be graded."""
        try:
            rollout = decode_rollout(message.value)
        except DecodeError as exc:
            return _Dead(message, DeadReason.MALFORMED, str(exc))
        task = self.tasks.get(rollout.prompt_id)
        if task is None:
            return _Dead(message, DeadReason.UNKNOWN_PROMPT, f"rollout {rollout.rollout_id}: prompt_id {rollout.prompt_id!r} is not in the task set")
        ids = np.asarray(rollout.tokens)[np.asarray(rollout.loss_mask) == 1].tolist()
        try:
            text = self.detokenize(ids)
        except ValueError as exc:
            return _Dead(message, DeadReason.UNDECODABLE, f"rollout {rollout.rollout_id}: {exc}")
        return rollout, task, text

    @staticmethod
    def _reward(built: BuiltGrader, rollout: Rollout, grade: Grade, now_us: int) -> Reward | str:
        reward = Reward(
            rollout_id=rollout.rollout_id, group_id=rollout.group_id, grader=built.spec.name, score=float(grade.score),
            created_at_us=now_us, components=dict(grade.components), grader_version=built.version, verdict=grade.verdict.value,
        )
        issues = reward.issues()
        return "; ".join(str(issue) for issue in issues) if issues else reward

    def _commit(self, outcome: _Outcome) -> None:
        producer, consumer = self._producer, self._consumer
        assert producer is not None and consumer is not None
        producer.begin_transaction()
        try:
            for partition, reward in outcome.rewards:
                producer.send(self.topics.rewards, key=reward.group_id.encode(), value=encode(reward), partition=partition)
            for dead in outcome.dead:
                self._send_dead(producer, dead)
            crash_point("grader.before_send_offsets")
            producer.send_offsets_to_transaction(
                {tp: OffsetAndMetadata(o, "", -1) for tp, o in outcome.offsets.items()}, consumer.group_metadata()
            )
            crash_point("grader.before_commit")
            producer.commit_transaction()
        except BaseException:
            self.metrics.transactions.labels("aborted").inc()
            try:
                producer.abort_transaction()
            except Exception as exc:  # the original error decides what happens next
                log.debug("abort after a failed transaction also failed: %r", exc)
            raise
        self.metrics.transactions.labels("committed").inc()
        self._count(outcome)

    def _send_dead(self, producer: KafkaProducer, dead: _Dead) -> None:
        source = dead.message
        log.warning("grader %s: %s[%d]@%d dead-lettered (%s): %s", self.member_id, source.topic, source.partition,
                    source.offset, dead.reason.value, dead.detail)
        headers = [
            ("ember.reason", dead.reason.value.encode()),
            ("ember.detail", dead.detail.encode("utf-8", errors="replace")),
            ("ember.source_topic", source.topic.encode()),
            ("ember.source_partition", str(source.partition).encode()),
            ("ember.source_offset", str(source.offset).encode()),
            ("ember.source_timestamp_ms", str(source.timestamp).encode()),
            ("ember.payload_kept", b"0"),  # the rollout stays in its topic; the offsets above point at it
            ("ember.stage", b"grader"),
            ("ember.grader_group", self.config.kafka.group_id.encode()),
        ]
        producer.send(self.topics.dead_letter, key=source.key, value=None, headers=headers)

    def _count(self, outcome: _Outcome) -> None:
        t, m = self.totals, self.metrics
        t.rollouts += outcome.graded
        t.rewards += len(outcome.rewards)
        m.rollouts.inc(outcome.graded)
        for _partition, reward in outcome.rewards:
            t.verdicts[reward.verdict] += 1
            m.verdicts.labels(reward.grader, reward.verdict).inc()
        for dead in outcome.dead:
            t.dead[dead.reason.value] += 1
            m.dead_letters.labels(dead.reason.value).inc()

    def _refresh_lag(self) -> None:
        """Every LAG_REFRESH_S, not after every batch: asking the broker for end offsets delays the next poll."""
        consumer = self._consumer
        if consumer is None or time.monotonic() - self._lag_at < LAG_REFRESH_S:
            return
        self._lag_at = time.monotonic()
        owned = list(consumer.assignment())
        ends = consumer.end_offsets(owned) if owned else {}
        self._lag_of = frozenset(owned)
        self.lag = 0
        for tp, end in ends.items():
            behind = max(0, end - consumer.position(tp))
            self.lag += behind
            self.metrics.lag.labels(str(tp.partition)).set(behind)

    def _report_status(self) -> None:
        interval = self.config.metrics.status_interval_s
        now = time.monotonic()
        if not interval or now - self._status_at < interval:
            return
        log.info("grader %s %s", self.instance, status_line(self.totals, self._status_from, now - self._status_at, self.lag))
        self._status_from = replace(self.totals, verdicts=Counter(self.totals.verdicts), dead=Counter(self.totals.dead))
        self._status_at = now
