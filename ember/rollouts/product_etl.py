"""`source: product` in the ETL service: each shard's `ProductJoin` behind the face of a `ShardEngine`, so the
service keeps its consumer group, log-time clock, rebalances and transactions as they are.

Served completions come on `<prefix>.rollouts` keyed by completion id, user events on `<prefix>.events`
keyed by the same id, so both of a completion's streams share a shard. What is
pending lives in the shard's SQLite spill store under `product.state_dir`; every Kafka transaction carries
`product_txn` in its offsets' metadata, and a shard that is loaded squares its store with it (see
`ember.rollouts.product.store`): the store's last outbox is sent again when the process died between the
two commits. The state topic still gets a (tiny) snapshot per commit: the service's pointer machinery reads it.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from prometheus_client import Gauge

from ember.rollouts.engine import REWARDS, ROLLOUTS, DeadLetter, EmittedBatch, InputMessage, ShardOutput
from ember.rollouts.config import EtlConfig
from ember.rollouts.etl import EtlService, TopologyError, _Clients
from ember.rollouts.log_clock import END_OF_TIME_MS
from ember.rollouts.metrics import EtlMetrics
from ember.rollouts.product.config import JoinLimits
from ember.rollouts.product.join import EVENTS, SERVED, Message, ProductJoin
from ember.rollouts.product.optout import OptOutError, OptOutFile, OptOutList, OptOutLog, OptOutSources
from ember.rollouts.product.simulate import Planned
from ember.rollouts.product.store import PendingStore
from ember.rollouts.records import Reason, ShardSnapshot
from ember.rollouts.security import KafkaSecurity
from ember.rollouts.topics import Topics
from ember.rollouts.transport import consumer_config, producer_config

log = logging.getLogger("ember.etl")


class ProductShard:
    """The parts of `ShardEngine` the service uses, over a `ProductJoin`."""

    @property
    def groups(self) -> dict:
        """No groups: the service's open-group gauges read 0."""
        return {}

    @property
    def ready(self) -> list:
        """Scored completions wait in the store, not here: the service's idle check asks `pending_count`."""
        return []

    def __init__(self, join: ProductJoin, inputs: dict[str, str], opt_out: OptOutSources | None):
        self.join = join
        self._roles = {topic: (SERVED if role == ROLLOUTS else EVENTS) for role, topic in inputs.items()}
        self._opt_out = opt_out
        self.txn = join.store.get("txn", 0)

    @property
    def positions(self) -> dict[str, int]:
        store = self.join.store
        return {role: pos for role, name in ((ROLLOUTS, SERVED), (REWARDS, EVENTS)) if (pos := store.get(f"pos.{name}")) is not None}

    @property
    def now_ms(self) -> int:
        return self.join.now_ms

    def _check_opt_out(self) -> None:
        if self._opt_out is not None:
            current = self._opt_out.current()
            if current != self.join.opt_out:
                self.join.set_opt_out(current)

    def ingest(self, message: InputMessage, *, latest_policy: int | None = None) -> None:
        self._check_opt_out()
        role = self._roles[message.topic]
        self.join.ingest(role, Message(message.offset, message.timestamp_ms, message.key, message.value or b""), latest_policy=latest_policy)

    def advance(self, now_ms: int, latest_policy: int | None = None) -> None:
        self._check_opt_out()
        self.join.advance(now_ms, latest_policy)

    def pending_count(self) -> int:
        return self.join.pending_count()

    def has_output(self) -> bool:
        return self.join.has_output()

    def has_batches(self) -> bool:
        return self.join.has_batches()

    def waiting_on(self) -> tuple[int, str] | None:
        at = self.join.store.next_horizon_ms()
        return None if at is None else (at, "a served completion's horizon")

    def finish(self, latest_policy: int | None) -> None:
        """The end of a replay's range: time runs on past every horizon and batch flush."""
        self.advance(END_OF_TIME_MS, latest_policy)

    def checkpoint(self, etl_instance: str = "") -> tuple[ShardOutput, ShardSnapshot, dict[str, int]]:
        out = self.join.checkpoint()
        self.txn = out.txn
        batches = [EmittedBatch(b, tuple(b.rollout_ids), b.created_at_us // 1000) for b in out.batches]
        marks = self.positions
        snapshot = ShardSnapshot(self.join.shard, marks, {}, self.join.store.get("next_step", 0), (), etl_instance)
        dead = [
            DeadLetter(InputMessage(self.join.topics[r.role], self.join.shard, r.offset, r.timestamp_ms, r.key, r.value),
                       Reason(r.reason), r.detail, r.value is not None)
            for r in out.rejected
        ]
        return ShardOutput(batches=batches, outcomes=out.outcomes, dead_letters=dead), snapshot, marks


class OptOutTopic:
    """Follows the compacted `<prefix>.opt-out` topic (see `ember.rollouts.product.optout`): read to its end
    before any shard decides, so a restart never trains on an id the topic already opted out, then polled once
    per service step. A record whose key is no id is logged, counted in `invalid` and skipped."""

    def __init__(self, bootstrap: str, topic: str, security: KafkaSecurity | None = None, timeout_s: float = 30.0):
        self.consumer = KafkaConsumer(**consumer_config(security, bootstrap_servers=bootstrap, group_id=None))
        self.tps = [TopicPartition(topic, p) for p in sorted(self.consumer.partitions_for_topic(topic) or ())]
        if not self.tps:
            self.consumer.close()
            raise TopologyError(f"product.opt_out_topic is set but {topic} does not exist: create it with `ember rollouts topics create`")
        self.consumer.assign(self.tps)
        self.consumer.seek_to_beginning(*self.tps)
        self.ids = OptOutLog()
        self.invalid = 0
        ends = self.consumer.end_offsets(self.tps)
        deadline = time.monotonic() + timeout_s
        while any(self.consumer.position(tp) < ends[tp] for tp in self.tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {topic} to its end within {timeout_s}s")
            self.poll(timeout_ms=200)

    def poll(self, timeout_ms: int = 0) -> None:
        for messages in self.consumer.poll(timeout_ms=timeout_ms).values():
            for m in messages:
                try:
                    self.ids.apply(m.key, m.value is not None, f"{m.topic}@{m.offset}")
                except OptOutError as exc:
                    self.invalid += 1
                    log.warning("ignoring opt-out record: %s", exc)

    def current(self) -> OptOutList:
        return self.ids.current()

    def close(self) -> None:
        self.consumer.close()


@contextmanager
def replay_shards(config: EtlConfig) -> Iterator[Callable[[int, dict[str, str]], ProductShard]]:
    """Shards for `rollouts replay`: the live join over fresh spill stores in a temporary directory (the
    replay's own, never the live ETL's), fed the same log-ordered messages, so each decides what the live ETL
    decided; today's opt-out file and topic apply (a replay must not bring back an opted-out user)."""
    settings, kafka = config.product, config.kafka
    topic = OptOutTopic(kafka.bootstrap, kafka.topics.opt_out, kafka.security) if settings.opt_out_topic else None
    sources = [OptOutFile(settings.opt_out_file)] if settings.opt_out_file else []
    opt_out = OptOutSources(sources + ([topic] if topic else [])) if sources or topic else None
    stores: list[PendingStore] = []

    def make(shard: int, inputs: dict[str, str]) -> ProductShard:
        stores.append(PendingStore(Path(state) / f"replay-{shard}.sqlite", durable=False))
        join = ProductJoin(settings, JoinLimits.of(config), stores[-1], shard=shard, topics=(inputs[ROLLOUTS], inputs[REWARDS]))
        if opt_out is not None:
            join.opt_out = opt_out.current()
        return ProductShard(join, inputs, opt_out)

    with tempfile.TemporaryDirectory(prefix="ember-replay-") as state:
        try:
            yield make
        finally:
            for store in stores:
                store.close()
            if topic is not None:
                topic.close()


class ProductEtlService(EtlService):
    """The ETL service with `ProductShard`s; everything else is `EtlService`'s."""

    def __init__(self, config: EtlConfig, instance: str = "0", metrics: EtlMetrics | None = None):
        super().__init__(config, instance, metrics)
        self.completions = Gauge(
            "ember_etl_product_completions", "Served completions of this process's shards by policy version and state "
            "(served, rewarded, trained, dropped), as committed in the spill stores", ["version", "state"],
            registry=self.metrics.registry,
        )
        self._opt_out_topic: OptOutTopic | None = None

    def _make_engine(self, clients: _Clients, shard: int, pair: list[TopicPartition], *, meta: str, **restore) -> ProductShard:
        settings = self.config.product
        kafka_txn = int(json.loads(meta).get("product_txn", 0)) if meta else 0
        store = PendingStore(settings.state_dir / f"{self.topics.prefix}-{shard}.sqlite")
        join = ProductJoin(settings, JoinLimits.of(self.config), store, shard=shard, topics=(pair[0].topic, pair[1].topic))
        sources: list = [OptOutFile(settings.opt_out_file)] if settings.opt_out_file else []
        if settings.opt_out_topic:
            if self._opt_out_topic is None:
                kafka = self.config.kafka
                self._opt_out_topic = OptOutTopic(kafka.bootstrap, self.topics.opt_out, kafka.security)
            sources.append(self._opt_out_topic)
        opt_out = OptOutSources(sources) if sources else None
        if opt_out is not None:
            join.opt_out = opt_out.current()
        resent = join.recover(kafka_txn)
        if resent is not None:
            log.info("ETL %s shard %d: Kafka lacks spill-store txn %d; sending its outputs again", self.member_id, shard, resent.txn)
        engine = ProductShard(join, self.inputs, opt_out)
        for role, tp in zip((ROLLOUTS, REWARDS), pair):
            position = engine.positions.get(role)
            if position is not None:
                clients.consumer.seek(tp, position)  # the store is the truth; Kafka's offsets may be a txn behind
        return engine

    def _pointer(self, shard: int, state_offset: int) -> str:
        return json.dumps({"state_offset": state_offset, "etl": self.member_id, "product_txn": self.engines[shard].txn})

    def _commit(self, force: bool = False) -> None:
        super()._commit(force)
        totals: dict[tuple[str, str], int] = {}
        for engine in self.engines.values():
            for version, counts in engine.join.store.counts().items():
                for state, n in counts.items():
                    totals[str(version), state] = totals.get((str(version), state), 0) + n
        for (version, state), n in totals.items():
            self.completions.labels(version, state).set(n)

    def _apply_rebalance(self, clients: _Clients) -> set[int]:
        for kind, shards in clients.listener.events:
            for shard in shards if kind == "revoked" else ():
                engine = self.engines.get(shard)
                if engine is not None:
                    engine.join.store.close()  # uncommitted work goes with the uncommitted Kafka offsets
        return super()._apply_rebalance(clients)

    def _step(self) -> None:
        if self._opt_out_topic is not None:
            self._opt_out_topic.poll()
        super()._step()

    def _disconnect(self) -> None:
        for engine in self.engines.values():
            engine.join.store.close()  # what was not committed rolls back, as a crash would
        if self._opt_out_topic is not None:
            self._opt_out_topic.close()
            self._opt_out_topic = None
        super()._disconnect()


def publish_traffic(
    plan: list[Planned], topics: Topics, *, security: KafkaSecurity | None = None, bootstrap: str | None = None, paced: bool = True
) -> int:
    """Send planned product traffic: served completions to the rollouts topic, events to the events topic, each
    keyed by completion id. `paced`: at the plan's (already compressed) log times, since the broker stamps a record
    when it is appended; else as fast as possible. Returns the records sent; a refused send is raised after flush."""
    producer = KafkaProducer(**producer_config(security, **({"bootstrap_servers": bootstrap} if bootstrap else {})))
    names = {"served": topics.rollouts, "events": topics.events}
    futures = []
    started = time.monotonic()
    first_ms = plan[0].timestamp_ms if plan else 0
    try:
        for record in plan:
            if paced:
                delay = started + (record.timestamp_ms - first_ms) / 1000 - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            futures.append(producer.send(names[record.role], key=record.key, value=record.value))
        producer.flush()
        for future in futures:
            future.get(timeout=30)
    finally:
        producer.close(timeout=5)
    return len(futures)
