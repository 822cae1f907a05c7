"""`ember rollouts etl CONFIG`: the consumer-group service that turns rollouts and rewards into batches.

One process per core, all in one consumer group; the unit of work is a shard (rollouts partition p
with rewards partition p, kept together by `CopartitionedCooperativeAssignor`). Exactly-once:

- every output (batches, ledger outcomes, dead letters), the shard's state snapshot and the input
  offsets are committed in one Kafka transaction (`send_offsets_to_transaction` with the consumer's
  group metadata, so a fenced zombie cannot commit);
- the committed input offset of a partition is the oldest message still held in memory, and the
  snapshot records which later offsets are already in committed output, so a restarted (or new)
  owner re-reads from the committed offset, skips what is done and rebuilds exactly the pending state;
- any Kafka error tears the clients down and rebuilds them and the state the same way, which is also
  how a broker restart or a rebalance is survived.

Decisions run on `LogClock`, time in the log as the broker stamped it (the input topics must use
LogAppendTime; the service refuses to start otherwise): messages reach the engine in log order, and a
deadline is decided only once nothing stamped before it can still be unread, so a rebalance, a broker
outage, a slow fetch or a loaded host never changes a decision, and `ember rollouts replay` of the same
log decides the same. On a freshly formatted broker the service first waits, bounded, for its topics'
leaders and its group and transaction coordinators (`wait_until_ready`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import AuthorizationError, KafkaError, KafkaTimeoutError, SaslAuthenticationFailedError
from kafka.structs import OffsetAndMetadata

from ember.rollouts.assignor import CopartitionedCooperativeAssignor
from ember.rollouts.config import EtlConfig
from ember.rollouts.engine import (
    ROLLOUTS, InputMessage, ShardEngine, ShardOutput, StateMismatch, input_topics, mirrored_sources, source_kind,
)
from ember.rollouts.faults import crash_point
from ember.rollouts.log_clock import LogClock
from ember.rollouts.metrics import EtlMetrics
from ember.rollouts.mirror import RegionProofs
from ember.rollouts.records import ClosedGroup, PolicyVersion, Reason, ShardSnapshot
from ember.rollouts.security import KafkaSecurity
from ember.rollouts.topics import Topics, reference_retention_problem, timestamp_problem
from ember.rollouts.admin import READY_TIMEOUT_S, BrokerNotReady, describe_topics, ensure_topics, list_topics, topic_configs, wait_until_ready
from ember.rollouts.transport import consumer_config, producer_config
from ember.schemas import encode

log = logging.getLogger("ember.etl")

ENDS_REFRESH_S = 0.25  # how often the broker is asked for the input partitions' end offsets (the clock's wall-time proofs)
ENDS_TIMEOUT_MS = 1000  # a broker that does not answer within this proves nothing this time, and the loop goes on
BROKER_CLOCK_LAG_MS = 100  # how far a broker's clock (LogAppendTime) may lag this host's (NTP keeps both within ms): see `LogClock`
LOG_APPEND_TIME = 1  # a record's timestamp_type when the broker stamped it


class TopologyError(RuntimeError):
    """The topics cannot carry the ETL (e.g. rollouts and rewards partition counts differ)."""


class MissingTopics(TopologyError):
    """The prefix's topics do not exist: the ETL creates none unless told to, so a typo cannot fork a deployment."""


def prepare_topics(config: EtlConfig, *, create: bool | None = None) -> Topics:
    """Check the ETL's topics exist and co-partition; with `create` (default: `kafka.create_topics`), create
    missing ones first, the state topic sized to the rollouts topic."""
    kafka = config.kafka
    topics = kafka.topics
    specs = topics.specs(kafka.partitions)
    specs.pop("rewards" if config.source == "product" else "events")
    if not (config.source == "product" and config.product.opt_out_topic):
        specs.pop("opt_out")
    inputs = input_topics(topics, config.source, kafka.regions)
    if not (kafka.create_topics if create is None else create):
        existing = set(list_topics(kafka.bootstrap, kafka.security))
        missing = [s.name for s in specs.values() if s.name not in existing]
        if missing:
            raise MissingTopics(
                f"topic prefix {topics.prefix!r}: {', '.join(missing)} do not exist or are hidden from "
                f"{kafka.security.describe()} (a typo in kafka.topic_prefix?). Create them with\n"
                f"  ember rollouts topics create --prefix {topics.prefix} --partitions {kafka.partitions}\n"
                "or let the ETL create them: --create-topics (kafka.create_topics: true)"
            )
    state = specs.pop("etl_state")
    ensure_topics(kafka.bootstrap, list(specs.values()), kafka.security)
    mirrored = [inputs[s] for s in mirrored_sources(inputs)]
    absent = sorted(set(mirrored) - set(list_topics(kafka.bootstrap, kafka.security))) if mirrored else []
    if absent:
        raise MissingTopics(
            f"{', '.join(absent)} do not exist in {kafka.bootstrap}: MirrorMaker 2 makes them once the region has "
            f"its topics (ember rollouts topics create --prefix {topics.prefix} --region R, with the same partitions)"
        )
    counts = {row["name"]: int(row["partitions"]) for row in describe_topics(kafka.bootstrap, list(inputs.values()), kafka.security)}
    rollouts = counts[inputs[ROLLOUTS]]
    differ = [f"{name} has {n}" for name, n in counts.items() if n != rollouts]
    if differ:
        raise TopologyError(
            f"{inputs[ROLLOUTS]} has {rollouts} partitions but {', '.join(differ)}: a group's rollouts and rewards, "
            "from every region, must share a partition index; give every input topic the same partition count"
        )
    _check_topic_configs(config)
    ensure_topics(kafka.bootstrap, [replace(state, partitions=rollouts)], kafka.security)
    (row,) = describe_topics(kafka.bootstrap, [topics.etl_state], kafka.security)
    if int(row["partitions"]) < rollouts:
        raise TopologyError(
            f"{topics.etl_state} has {row['partitions']} partitions for {rollouts} rollout partitions; "
            "add partitions to the state topic before running the ETL"
        )
    return topics


def _check_topic_configs(config: EtlConfig) -> None:
    """Refuse local input topics stamped by producers (CreateTime) and topics where batches could outlive the rollouts
    they reference (mirrored topics are CreateTime by design: see `_check_stamp`); warn when this principal may not
    read the topics' configs (DESCRIBE_CONFIGS), so the checks are the operator's."""
    kafka, topics = config.kafka, config.kafka.topics
    inputs = list(input_topics(topics, config.source).values())
    names = [*inputs, topics.train_batches]
    try:
        configs = topic_configs(kafka.bootstrap, names, kafka.security)
        unread = [name for name in names if not configs.get(name)]  # without DESCRIBE_CONFIGS a topic's come back empty
        if unread:
            raise AuthorizationError(f"no configs returned for {', '.join(unread)}")
    except (AuthorizationError, KafkaError) as exc:
        log.warning(
            "cannot read the configs of %s as %s (%r): make sure %s and %s use message.timestamp.type=LogAppendTime and "
            "the rollouts topic is retained at least as long as train-batches, whose batches reference it",
            ", ".join(names), kafka.security.describe(), exc, *inputs,
        )
        return
    problem = reference_retention_problem(configs[topics.rollouts], configs[topics.train_batches])
    if problem:
        raise TopologyError(f"{topics.rollouts}: {problem}")
    for name in inputs:
        problem = timestamp_problem(name, configs[name], kafka.bootstrap)
        if problem:
            raise TopologyError(problem)


class PolicyWatcher:
    """Follows the policy-versions topic; `latest` is the highest version any trainer announced."""

    def __init__(self, bootstrap: str, topic: str, security: KafkaSecurity | None = None):
        self.consumer = KafkaConsumer(**consumer_config(security, bootstrap_servers=bootstrap, group_id=None))
        self.tp = TopicPartition(topic, 0)
        self.consumer.assign([self.tp])
        self.consumer.seek_to_beginning(self.tp)
        self.latest: int | None = None
        self.invalid = 0

    def poll(self, timeout_ms: int = 0) -> None:
        for messages in self.consumer.poll(timeout_ms=timeout_ms).values():
            for message in messages:
                try:
                    version = PolicyVersion.decode(message.value).policy_version
                except ValueError as exc:
                    self.invalid += 1
                    log.warning("ignoring policy-version record %s@%d: %s", self.tp.topic, message.offset, exc)
                    continue
                self.latest = version if self.latest is None else max(self.latest, version)

    def catch_up(self, timeout_s: float = 30.0) -> None:
        end = self.consumer.end_offsets([self.tp])[self.tp]
        deadline = time.monotonic() + timeout_s
        while self.consumer.position(self.tp) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {self.tp.topic} to offset {end} within {timeout_s}s")
            self.poll(timeout_ms=200)

    def close(self) -> None:
        self.consumer.close()


def read_shard_state(
    consumer: KafkaConsumer, topic: str, shard: int, state_offset: int | None, since_ms: int, timeout_s: float = 60.0
) -> tuple[ShardSnapshot | None, list[ClosedGroup]]:
    """The snapshot at `state_offset` and every group closed since `since_ms` (the dedup window)."""
    tp = TopicPartition(topic, shard)
    consumer.assign([tp])
    found = consumer.offsets_for_times({tp: max(0, since_ms)}).get(tp)
    end = consumer.end_offsets([tp])[tp]
    target = state_offset if state_offset is not None else end - 1
    start = found.offset if found is not None else end
    if state_offset is not None:
        start = min(start, state_offset)
    consumer.seek(tp, start)
    closed: list[ClosedGroup] = []
    snapshot: ShardSnapshot | None = None
    deadline = time.monotonic() + timeout_s
    while consumer.position(tp) <= target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"could not read {topic}[{shard}] up to offset {target} within {timeout_s}s")
        for messages in consumer.poll(timeout_ms=200).values():
            for message in messages:
                if message.offset > target:
                    continue
                record = ShardSnapshot.decode(message.value)
                closed.extend(record.closed)
                if message.offset == target or state_offset is None:
                    snapshot = record
    if state_offset is not None and snapshot is None:
        raise StateMismatch(f"{topic}[{shard}] has no committed snapshot at offset {state_offset} (expired retention?)")
    return (snapshot if state_offset is not None else None), closed


class _Listener(ConsumerRebalanceListener):
    """Runs inside poll(); only records what changed, the service acts on it after poll returns."""

    def __init__(self) -> None:
        self.events: list[tuple[str, set[int]]] = []

    def on_partitions_revoked(self, revoked) -> None:
        self.events.append(("revoked", {tp.partition for tp in revoked}))

    def on_partitions_assigned(self, assigned) -> None:
        self.events.append(("assigned", {tp.partition for tp in assigned}))

    def on_partitions_lost(self, lost) -> None:
        self.events.append(("revoked", {tp.partition for tp in lost}))


@dataclass
class RunTotals:
    """What one ETL process committed since it started: the status lines' rates and the exit summary."""

    messages: int = 0
    batches: int = 0
    rollouts: int = 0
    tokens: int = 0
    dropped: Counter = field(default_factory=Counter)
    rewards_dropped: Counter = field(default_factory=Counter)
    dead_letters: int = 0


def _top(counts: Counter, width: int) -> str:
    """'stale 12, duplicate 3, +2' cut to fit `width` columns ('' if not even one fits): a status line stays one line."""
    parts = [f"{reason} {n}" for reason, n in counts.most_common()]
    text = ""
    for i, part in enumerate(parts):
        rest = len(parts) - i - 1
        candidate = f"{text}, {part}" if text else part
        if len(candidate) + (len(f", +{rest}") if rest else 0) > width:
            return f"{text}, +{len(parts) - i}" if text else ""
        text = candidate
    return text


def _rate(count: int, seconds: float) -> str:
    rate = count / seconds
    return f"{rate:.1f}" if rate < 10 else f"{rate:.0f}"


def status_line(totals: RunTotals, previous: RunTotals, seconds: float, unread: int, held: int, groups: int) -> str:
    """One line of about 80 columns (after the CLI's 20-column log prefix, within 100): rates since the last line,
    input not read yet (`unread`: behind on reading), input read but not committed (`held`: waiting in open
    groups, for a decision), the groups pending in memory, and drops by reason since the start."""
    per_s = max(seconds, 1e-9)
    dropped = sum(totals.dropped.values())
    rates = f"rollouts {_rate(totals.rollouts - previous.rollouts, per_s)}/s batches {_rate(totals.batches - previous.batches, per_s)}/s"
    tail = f" dead {totals.dead_letters}" if totals.dead_letters else ""
    holders = f" in {groups} groups" if groups else ""
    head = f"{rates} unread {unread} held {held}{holders} dropped {dropped}"
    if len(head) + len(tail) > 80:  # large counts: the groups in short, so the line still fits
        head = f"{rates} unread {unread} held {held}/{groups}g dropped {dropped}"
    room = 80 - len(head) - len(tail) - 3
    reasons = _top(totals.dropped, room)
    return head + (f" ({reasons})" if reasons else "") + tail


def summary_lines(totals: RunTotals, seconds: float, recoveries: int) -> list[str]:
    """The exit summary: totals over the whole run, each line within 75 columns."""
    lines = [
        f"stopped after {seconds:.1f}s: {totals.messages} messages in, {totals.batches} batches, "
        f"{totals.rollouts} rollouts",
        f"  {totals.tokens} tokens batched, {sum(totals.dropped.values())} rollouts dropped, "
        f"{sum(totals.rewards_dropped.values())} rewards dropped, {totals.dead_letters} dead letters",
    ]
    if totals.dropped:
        lines.append(f"  rollouts dropped: {_top(totals.dropped, 55)}")
    if totals.rewards_dropped:
        lines.append(f"  rewards dropped: {_top(totals.rewards_dropped, 56)}")
    if recoveries:
        lines.append(f"  {recoveries} recoveries (clients and state rebuilt after Kafka errors)")
    return lines


@dataclass
class _Clients:
    producer: KafkaProducer
    consumer: KafkaConsumer
    state_reader: KafkaConsumer
    policy: PolicyWatcher
    listener: _Listener

    def close(self) -> None:
        for close in (
            lambda: self.consumer.close(autocommit=False),
            self.state_reader.close,
            self.policy.close,
            lambda: self.producer.close(timeout=5),
        ):
            try:
                close()
            except Exception as exc:  # closing after a failure must never mask the failure itself
                log.debug("ignoring error while closing a client: %r", exc)


class EtlService:
    def __init__(self, config: EtlConfig, instance: str = "0", metrics: EtlMetrics | None = None):
        self.config = config
        self.instance = instance
        self.metrics = metrics or EtlMetrics()
        self.topics = config.kafka.topics
        self.inputs = input_topics(self.topics, config.source, config.kafka.regions)
        self.engines: dict[int, ShardEngine] = {}
        self._clients: _Clients | None = None
        self._touched: set[int] = set()
        self._committed_marks: dict[int, dict[str, int]] = {}
        self._last_commit = 0.0
        self._ends: dict[TopicPartition, int] = {}
        self._ends_at = float("-inf")
        self._asked_at_ms = 0  # wall time the last end offsets that came back were asked for
        self._start_ends: dict[TopicPartition, int] | None = None  # input end offsets when the service first connected
        self._caught_up: set[int] = set()  # shards read to end offsets asked for after the last records arrived
        self._quiet_since: float | None = None  # when the service last became assigned, caught up and without pending work
        self._clocks: dict[int, LogClock[InputMessage]] = {}
        self._mirrored_topics = {self.inputs[s] for s in mirrored_sources(self.inputs)}
        # mirrored source -> (region, the region's own topic), where `RegionProofs` asks what is not copied yet
        self._mirror_of = {s: (s.split(".", 1)[0], self.inputs[source_kind(s)]) for s in mirrored_sources(self.inputs)}
        self._region_proofs: RegionProofs | None = None
        self._create_time_seen: set[str] = set()  # input topics a producer-stamped record came from (warned once each)
        self.transactions = 0
        self.totals = RunTotals()
        self._status_from = RunTotals()
        self._status_at = time.monotonic()
        self._recoveries = 0
        self._unread = 0  # input messages not read yet, over the owned partitions (from the last end offsets)
        self._held = 0  # input messages read but not committed: held by open groups until their decision
        self._waiting_said_at = 0.0  # when --until-idle last said what it waits for
        self._quiet_input_since: float | None = time.monotonic()  # when the last input arrived (or the service started)

    @property
    def member_id(self) -> str:
        return f"{self.config.kafka.group_id}-{self.instance}"

    # ---- lifecycle ---------------------------------------------------------------------------

    def run(
        self, stop: threading.Event | None = None, *, until_idle_s: float | None = None, ready_timeout_s: float = READY_TIMEOUT_S
    ) -> None:
        """Process until `stop` is set, or (with `until_idle_s`) until it has been idle that long: every owned
        partition assigned and read to the end offsets seen at start and to fresh ones, nothing pending, no input.

        A broker that is not ready at start (unreachable, just formatted) is waited for at most `ready_timeout_s`,
        then `BrokerNotReady` says what was missing; once running, Kafka errors are recovered from without limit.
        """
        stop = stop or threading.Event()
        prepared = False
        failures = 0
        started = time.monotonic()
        kafka = self.config.kafka
        if kafka.regions:
            self._region_proofs = RegionProofs(
                kafka.bootstrap, kafka.regions, [self.topics.rollouts, self.topics.rewards], security=kafka.security
            ).start()
        try:
            while not stop.is_set():
                try:
                    if not prepared:  # inside the retry: a broker that is (re)starting is waited for, not fatal
                        who = f"ETL {self.member_id}"
                        wait_until_ready(kafka.bootstrap, kafka.security, who=who, timeout_s=ready_timeout_s)
                        prepare_topics(self.config)
                        wait_until_ready(
                            kafka.bootstrap, kafka.security, topics=list(self.inputs.values()), group_id=kafka.group_id,
                            transactional_id=self.member_id, who=who,
                            timeout_s=max(1.0, started + ready_timeout_s - time.monotonic()),
                        )
                        prepared = True
                    self._connect()
                    failures = 0
                    while not stop.is_set():
                        self._step()
                        if until_idle_s is not None and self._idle_for(until_idle_s):
                            stop.set()
                        elif until_idle_s is not None:
                            self._say_what_idle_waits_for(until_idle_s)
                    self._commit(force=True)
                except (AuthorizationError, SaslAuthenticationFailedError, BrokerNotReady):
                    raise  # refused stays refused, and a start-up wait is bounded: retrying would only hide either
                except (KafkaError, OSError, TimeoutError) as exc:
                    if not prepared and time.monotonic() - started > ready_timeout_s:
                        raise BrokerNotReady(
                            f"ETL {self.member_id}: could not prepare its topics on {kafka.bootstrap} in "
                            f"{time.monotonic() - started:.0f}s (limit {ready_timeout_s:.0f}s): {exc!r}. "
                            "Is the broker running (`ember dev status`)?"
                        ) from exc
                    failures += 1
                    self._recoveries += 1
                    self.metrics.recoveries.inc()
                    log.warning(
                        "ETL %s: %r; rebuilding clients and state from committed offsets (attempt %d)",
                        self.member_id, exc, failures,
                    )
                    self._disconnect()
                    stop.wait(min(0.5 * 2**failures, 10.0))
        finally:
            self._disconnect()
            if self._region_proofs is not None:
                self._region_proofs.close()
            if prepared:
                for line in summary_lines(self.totals, time.monotonic() - started, self._recoveries):
                    log.info("ETL %s %s", self.instance, line)

    def _connect(self) -> None:
        kafka = self.config.kafka
        producer = KafkaProducer(
            **producer_config(
                kafka.security,
                bootstrap_servers=kafka.bootstrap,
                transactional_id=self.member_id,
                transaction_timeout_ms=kafka.transaction_timeout_ms,
                client_id=f"{self.member_id}-producer",
                linger_ms=0,
            )
        )
        try:
            producer.init_transactions()
            listener = _Listener()
            consumer = KafkaConsumer(
                **consumer_config(
                    kafka.security,
                    bootstrap_servers=kafka.bootstrap,
                    group_id=kafka.group_id,
                    group_instance_id=self.member_id,
                    client_id=f"{self.member_id}-consumer",
                    partition_assignment_strategy=[CopartitionedCooperativeAssignor()],
                    session_timeout_ms=kafka.session_timeout_ms,
                    heartbeat_interval_ms=kafka.heartbeat_interval_ms,
                    max_poll_records=kafka.max_poll_records,
                )
            )
            consumer.subscribe(list(self.inputs.values()), listener=listener)
            state_reader = KafkaConsumer(**consumer_config(kafka.security, bootstrap_servers=kafka.bootstrap, group_id=None))
            policy = PolicyWatcher(kafka.bootstrap, self.topics.policy_versions, kafka.security)
        except BaseException:
            producer.close(timeout=5)
            raise
        self._clients = _Clients(producer, consumer, state_reader, policy, listener)
        policy.catch_up()
        if self._start_ends is None:
            tps = [TopicPartition(t, p) for t in self.inputs.values() for p in sorted(consumer.partitions_for_topic(t) or ())]
            self._start_ends = consumer.end_offsets(tps)
        self.engines = {}
        self._clocks = {}
        self._caught_up = set()
        self._quiet_since = None
        self._touched = set()
        self._committed_marks = {}
        log.info("ETL %s connected to %s (%s)", self.member_id, kafka.bootstrap, kafka.security.describe())

    def _disconnect(self) -> None:
        if self._clients is not None:
            self._clients.close()
        self._clients = None
        self.engines = {}
        self._clocks = {}

    def _say_what_idle_waits_for(self, seconds: float, every_s: float = 30.0) -> None:
        """With --until-idle: once all input is read and nothing arrived for `seconds`, what keeps the run going is
        a decision only time brings (a group timeout, an orphan reward's wait): say which, and when, every `every_s`."""
        now = time.monotonic()
        if self._unread or now - self._waiting_said_at < every_s or not self.engines or not self._caught_up >= set(self.engines):
            return
        if self._quiet_input_since is None or now - self._quiet_input_since < seconds:
            return
        waits = []
        for engine in self.engines.values():
            found = engine.waiting_on()
            if found is not None:
                waits.append((found[0] - engine.now_ms, found[1]))
        if not waits:
            return
        left_ms, what = min(waits)
        groups = sum(len(e.groups) for e in self.engines.values())
        log.info("ETL %s: all input read; --until-idle waits for %d open group(s) that only time decides: next, %s, in %.0f s",
                 self.instance, groups, what, max(0, left_ms) / 1000)
        self._waiting_said_at = now

    def _idle_for(self, seconds: float) -> bool:
        """Settled (see `_settled`) for `seconds` without interruption."""
        if not self._settled():
            self._quiet_since = None
            return False
        if self._quiet_since is None:
            self._quiet_since = time.monotonic()
        return time.monotonic() - self._quiet_since >= seconds

    def _settled(self) -> bool:
        """Partitions assigned and loaded, each read to the end offsets seen at start and to end offsets asked for
        after the last records arrived, and nothing pending.

        No input for a while is not the same as nothing left: on a broker formatted seconds ago the group
        coordinator answers `NotCoordinatorError` for a while, no partition is assigned and no record arrives
        although the topics are full; during a rebalance poll() returns nothing.
        """
        clients = self._clients
        if clients is None or not self.engines or self._start_ends is None:
            return False
        assignment = clients.consumer.assignment()
        if {tp.partition for tp in assignment} != set(self.engines) or not self._caught_up >= set(self.engines):
            return False
        if any(clock.held() for clock in self._clocks.values()):
            return False
        for shard, engine in self.engines.items():
            for role, topic in self.inputs.items():
                if (engine.positions.get(role) or 0) < self._start_ends.get(TopicPartition(topic, shard), 0):
                    return False
        return all(e.pending_count() == 0 and not e.groups and not e.ready for e in self.engines.values())

    # ---- the loop ----------------------------------------------------------------------------

    def _step(self) -> None:
        clients = self._clients
        assert clients is not None
        timeout_ms = self.config.kafka.poll_timeout_ms
        wanted = self._proof_wanted_ms()
        if wanted is not None:  # a message waits for a proof from the broker: wait in poll() no longer than that
            timeout_ms = max(0, min(timeout_ms, wanted - int(time.time() * 1000)))
        records = clients.consumer.poll(timeout_ms=timeout_ms)
        loaded = self._apply_rebalance(clients)
        clients.policy.poll()
        roles = {topic: role for role, topic in self.inputs.items()}
        for tp, messages in records.items():
            engine = self.engines.get(tp.partition)
            if engine is None or tp.partition in loaded or not messages:
                continue
            clock = self._clocks[tp.partition]
            for message in messages:
                self._check_stamp(tp.topic, message.timestamp_type)
                timestamp = max(message.timestamp or 0, 0)  # the replay reads an unstamped record the same way
                item = InputMessage(tp.topic, tp.partition, message.offset, timestamp, message.key, message.value)
                clock.read(roles[tp.topic], timestamp, item)
            self.metrics.messages.labels(tp.topic, roles[tp.topic]).inc(len(messages))
            self.totals.messages += len(messages)
            self._touched.add(tp.partition)
            self._caught_up.discard(tp.partition)
            self._quiet_since = None
            self._quiet_input_since = time.monotonic()
        latest = clients.policy.latest
        if latest is not None:
            self.metrics.policy_version.set(latest)
        self._refresh_ends(clients)
        for shard, engine in self.engines.items():
            clock = self._clocks[shard]
            for _role, message in clock.release():
                engine.ingest(message, latest_policy=latest)
                self._touched.add(shard)
            engine.advance(clock.now_ms, latest)
            self.metrics.pending.labels(str(shard)).set(engine.pending_count())
            self.metrics.open_groups.labels(str(shard)).set(len(engine.groups))
        self._commit()
        self._report_status()

    def _check_stamp(self, topic: str, timestamp_type: int) -> None:
        """A producer-stamped record (the topic's config changed after the start-up check, or was unreadable) voids
        the promise that a replay decides the same: say so once per topic, and go on as before. A mirrored topic's
        records are CreateTime by design and accepted: MM2 copies each record's timestamp, which on the regional
        topic (LogAppendTime) is the region broker's append time, but not the topic's timestamp type."""
        if topic in self._mirrored_topics:
            return
        if timestamp_type != LOG_APPEND_TIME and topic not in self._create_time_seen:
            self._create_time_seen.add(topic)
            log.warning(
                "%s holds producer-stamped (CreateTime) records: deadlines then depend on producers' clocks and delays, and "
                "a replay may decide differently; set message.timestamp.type=LogAppendTime on it", topic,
            )

    def _report_status(self) -> None:
        interval = self.config.metrics.status_interval_s
        now = time.monotonic()
        if not interval or now - self._status_at < interval:
            return
        groups = sum(len(e.groups) for e in self.engines.values())
        line = status_line(self.totals, self._status_from, now - self._status_at, self._unread, self._held, groups)
        log.info("ETL %s %s", self.instance, line)
        self._status_from = replace(self.totals, dropped=Counter(self.totals.dropped), rewards_dropped=Counter(self.totals.rewards_dropped))
        self._status_at = now

    def _apply_rebalance(self, clients: _Clients) -> set[int]:
        events, clients.listener.events = clients.listener.events, []
        to_load: set[int] = set()
        for kind, shards in events:
            for shard in shards:
                if kind == "revoked":
                    self.engines.pop(shard, None)
                    self._clocks.pop(shard, None)
                    self._caught_up.discard(shard)
                    self._touched.discard(shard)
                    self._committed_marks.pop(shard, None)
                    to_load.discard(shard)
                else:
                    to_load.add(shard)
        assignment = clients.consumer.assignment()
        for shard in sorted(to_load):
            pair = [TopicPartition(topic, shard) for topic in self.inputs.values()]
            if all(tp in assignment for tp in pair):
                self._load_shard(clients, shard, pair)
        if events:
            self._quiet_since = None
            log.info("ETL %s owns shards %s", self.member_id, sorted(self.engines))
        return to_load

    def _load_shard(self, clients: _Clients, shard: int, pair: list[TopicPartition]) -> None:
        committed = {role: clients.consumer.committed(tp, metadata=True) for role, tp in zip(self.inputs, pair)}
        state_offset = None
        meta = committed[ROLLOUTS].metadata if committed[ROLLOUTS] is not None else ""
        if meta:
            try:
                state_offset = int(json.loads(meta)["state_offset"])
            except (ValueError, KeyError, TypeError):
                raise StateMismatch(f"{pair[0].topic}[{shard}] committed metadata {meta!r} is not an ember ETL state pointer") from None
        now_ms = int(time.time() * 1000)
        snapshot, closed = read_shard_state(
            clients.state_reader,
            self.topics.etl_state,
            shard,
            state_offset,
            now_ms - int(self.config.filters.dedup_window_s * 1000),
        )
        offsets = {role: c.offset for role, c in committed.items() if c is not None and c.offset >= 0}
        starts = dict(offsets)
        for role, tp in zip(self.inputs, pair):
            if role in offsets:
                clients.consumer.seek(tp, offsets[role])
            else:
                clients.consumer.seek_to_beginning(tp)
                starts[role] = clients.consumer.position(tp)
        engine = self._make_engine(clients, shard, pair, snapshot=snapshot, committed=starts, closed=closed, now_ms=now_ms, meta=meta)
        self.engines[shard] = engine
        self._committed_marks[shard] = dict(offsets)
        self._clocks[shard] = LogClock(self.inputs, skew_ms=BROKER_CLOCK_LAG_MS, mirrored=mirrored_sources(self.inputs))
        self._caught_up.discard(shard)
        log.info("ETL %s loaded shard %d from offsets %s (%d pending to rebuild)", self.member_id, shard, offsets, engine.pending_count())

    def _make_engine(self, clients: _Clients, shard: int, pair: list[TopicPartition], *, meta: str, **restore) -> ShardEngine:
        """The shard's engine, restored from its snapshot (a seam: the product path builds its own)."""
        return ShardEngine(self.config, shard, self.topics, **restore)

    def _pointer(self, shard: int, state_offset: int) -> str:
        """The committed offsets' metadata: where the shard's state snapshot is."""
        return json.dumps({"state_offset": state_offset, "etl": self.member_id})

    # ---- transactions ------------------------------------------------------------------------

    def _commit(self, force: bool = False) -> None:
        clients = self._clients
        if clients is None or not self.engines:
            return
        ready = any(e.has_batches() for e in self.engines.values())
        interval = self.config.commit.interval_ms / 1000
        if not (force or ready or time.monotonic() - self._last_commit >= interval):
            return
        shards = sorted(s for s in self._touched | {s for s, e in self.engines.items() if e.has_output()} if s in self.engines)
        prepared: list[tuple[int, ShardOutput, ShardSnapshot, dict[str, int]]] = []
        for shard in shards:
            output, snapshot, marks = self.engines[shard].checkpoint(self.member_id)
            if output.empty() and not snapshot.closed and marks == self._committed_marks.get(shard):
                self._count(output)
                continue
            prepared.append((shard, output, snapshot, marks))
        self._touched.clear()
        self._last_commit = time.monotonic()
        if not prepared:
            return
        producer = clients.producer
        producer.begin_transaction()
        try:
            state_futures = {}
            for shard, output, snapshot, _marks in prepared:
                self._send_output(producer, output)
                state_futures[shard] = producer.send(
                    self.topics.etl_state, key=str(shard).encode(), value=snapshot.encode(), partition=shard
                )
            producer.flush()
            offsets = {}
            for shard, _output, _snapshot, marks in prepared:
                pointer = self._pointer(shard, state_futures[shard].get(timeout=30).offset)
                for role, mark in marks.items():
                    offsets[TopicPartition(self.inputs[role], shard)] = OffsetAndMetadata(mark, pointer, -1)
            crash_point("etl.before_send_offsets")
            producer.send_offsets_to_transaction(offsets, clients.consumer.group_metadata())
            crash_point("etl.before_commit")
            producer.commit_transaction()
            crash_point("etl.after_commit")
        except BaseException:
            self.metrics.transactions.labels("aborted").inc()
            try:
                producer.abort_transaction()
            except Exception as exc:  # the original error decides what happens next
                log.debug("abort after a failed transaction also failed: %r", exc)
            raise
        self.transactions += 1
        self.metrics.transactions.labels("committed").inc()
        for shard, output, _snapshot, marks in prepared:
            self._committed_marks[shard] = marks
            self._count(output)

    def _send_output(self, producer: KafkaProducer, output: ShardOutput) -> None:
        for emitted in output.batches:
            batch = emitted.batch
            producer.send(self.topics.train_batches, key=batch.batch_id.encode(), value=encode(batch))
        for outcome in output.outcomes:
            producer.send(self.topics.outcomes, key=(outcome.group_id or outcome.kind).encode(), value=outcome.encode())
        for dead in output.dead_letters:
            source = dead.source
            headers = [
                ("ember.reason", dead.reason.value.encode()),
                ("ember.detail", dead.detail.encode("utf-8", errors="replace")),
                ("ember.source_topic", source.topic.encode()),
                ("ember.source_partition", str(source.partition).encode()),
                ("ember.source_offset", str(source.offset).encode()),
                ("ember.source_timestamp_ms", str(source.timestamp_ms).encode()),
                ("ember.payload_kept", b"1" if dead.payload_kept else b"0"),
            ]
            producer.send(
                self.topics.dead_letter,
                key=source.key,
                value=source.value if dead.payload_kept else None,
                headers=headers,
            )

    def _count(self, output: ShardOutput) -> None:
        now_ms = time.time() * 1000
        m = self.metrics
        t = self.totals
        for emitted in output.batches:
            t.batches += 1
            t.rollouts += emitted.batch.num_sequences
            t.tokens += emitted.batch.num_tokens
            m.batches.inc()
            m.batch_rollouts.inc(emitted.batch.num_sequences)
            m.batch_tokens.inc(emitted.batch.num_tokens)
            m.batch_latency.observe(max(0.0, now_ms - emitted.last_reward_ms) / 1e3)
        for outcome in output.outcomes:
            reason = Reason(outcome.reason).value  # a closed set: never message content in a label
            m.outcomes.labels(outcome.kind, reason).inc()
            if outcome.kind == "rollout_dropped":
                t.dropped[reason] += 1
                m.dropped_tokens.labels(reason).inc(outcome.tokens)
            elif outcome.kind == "reward_dropped":
                t.rewards_dropped[reason] += 1
            elif outcome.kind == "dead_letter":
                t.dead_letters += 1
        for name, value in output.observations:
            m.observe(name, value)

    def _proof_wanted_ms(self) -> int | None:
        """The earliest wall time, later than the last ask, at which end offsets could release a held message."""
        wanted = [w for clock in self._clocks.values() if (w := clock.proof_wanted_ms()) is not None and w > self._asked_at_ms]
        return min(wanted, default=None)

    def _refresh_ends(self, clients: _Clients) -> None:
        """Ask the broker for the owned input partitions' end offsets (every `ENDS_REFRESH_S`, and as soon as that can
        release a held message): the only way wall time enters the shards' clocks, each up to the moment of asking,
        if the shard has read up to them."""
        wanted = self._proof_wanted_ms()
        due = time.monotonic() - self._ends_at >= ENDS_REFRESH_S or (wanted is not None and time.time() * 1000 >= wanted)
        if not due or not self.engines:
            return
        assignment = clients.consumer.assignment()
        tps = {
            TopicPartition(topic, s): (s, role)
            for s in self.engines for role, topic in self.inputs.items() if TopicPartition(topic, s) in assignment
        }
        region_proofs = self._region_proofs.latest() if self._region_proofs is not None else {}  # before central is asked
        if self._region_proofs is not None:
            self.metrics.show_replication(self._region_proofs.lags())
        asked_at_ms = int(time.time() * 1000)
        try:
            # asked on the state reader's own connection: on the consumer's, the request would queue behind its
            # long-polling fetch (up to fetch.max.wait.ms), and every message waiting for this proof with it
            self._ends = clients.state_reader.end_offsets(list(tps), timeout_ms=ENDS_TIMEOUT_MS)
        except KafkaTimeoutError:
            return
        self._ends_at = time.monotonic()
        self._asked_at_ms = asked_at_ms
        behind: set[int] = set()
        for tp, end in self._ends.items():
            shard, role = tps[tp]
            position = clients.consumer.position(tp)  # past control records too, which no message shows
            if role in self._mirror_of:
                region, topic = self._mirror_of[role]
                proof = region_proofs.get((region, topic, shard))
                read_to_end = position >= end if proof is None else self._clocks[shard].mirror_end(
                    role, position=position, copied_end=end, region_asked_at_ms=proof
                )
            else:
                read_to_end = self._clocks[shard].end_offset(role, position=position, end=end, asked_at_ms=asked_at_ms)
            if not read_to_end:
                behind.add(shard)
        proven = Counter(tps[tp][0] for tp in self._ends)
        self._caught_up = {s for s in self.engines if proven[s] == len(self.inputs) and s not in behind}
        self._unread = self._held = 0
        for tp, end in self._ends.items():
            shard, role = tps[tp]
            committed = self._committed_marks.get(shard, {}).get(role, 0)
            position = max(committed, self.engines[shard].positions.get(role) or 0)
            self._unread += max(0, end - position)
            self._held += max(0, position - committed)
            self.metrics.lag.labels(tp.topic, role, str(tp.partition)).set(max(0, end - committed))
