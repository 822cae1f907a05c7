"""How far MirrorMaker 2 is behind each region, from Kafka alone (infra/regions.sh runs the mirror).

MM2's exactly-once source tasks commit, in the same transaction as the records they copy, the next source offset to
copy per region partition, into `mm2-offsets.<region>.internal` on the central cluster. Read committed, that is
exactly what central holds; the region's committed records past it are what a trainer cannot see yet. Offsets alone
would overcount (transaction markers take offsets too), so the records in between are counted, up to `COUNT_LIMIT`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

from kafka import KafkaConsumer, TopicPartition

from ember.rollouts.security import KafkaSecurity

log = logging.getLogger("ember.etl")

COUNT_LIMIT = 10_000  # beyond this many offsets behind, the offset distance is reported (an upper bound)
ASK_TIMEOUT_MS = 10_000  # a cluster that is down fails an ask after this, and the next round asks again


@dataclass(frozen=True)
class MirrorLag:
    region: str
    topic: str  # the region's topic; central holds it as <region>.<topic>
    partition: int
    copied: int  # the next region offset MM2 will copy (committed with the copy)
    end: int  # the region partition's last stable offset
    behind: int  # committed region records not copied yet (offsets when more than COUNT_LIMIT)


class MirrorWatch:
    """What MM2 copied from one region against what the region committed, over two long-lived consumers.

    MM2's offsets topic only grows between compactions (a record per flush per partition: 10^5 after a day of tests),
    so it is read once from the beginning and then only past where the last ask stopped; the region's records are
    counted only between MM2's position and the region's end."""

    def __init__(self, central: str, region: str, region_bootstrap: str, security: KafkaSecurity | None = None):
        self.region = region
        self._topic = f"mm2-offsets.{region}.internal"
        self._central = _reader(central, security)
        try:
            self._source = _reader(region_bootstrap, security)
        except BaseException:
            self._central.close()
            raise
        self._offsets_tps: list[TopicPartition] = []
        self._copied: dict[tuple[str, int], int] = {}

    def copied(self, timeout_s: float = 30.0) -> dict[tuple[str, int], int]:
        """(topic, partition) -> next offset to copy, as MM2 committed it for the region on the central cluster."""
        consumer = self._central
        if not self._offsets_tps:  # MM2 creates the topic on its first start; its partition count never changes
            self._offsets_tps = [TopicPartition(self._topic, p) for p in sorted(consumer.partitions_for_topic(self._topic) or ())]
            if not self._offsets_tps:
                return {}
            consumer.assign(self._offsets_tps)
            consumer.seek_to_beginning(*self._offsets_tps)
        ends = consumer.end_offsets(self._offsets_tps, timeout_ms=ASK_TIMEOUT_MS)
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in self._offsets_tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {self._topic} to its end: nothing arrived for {timeout_s:g}s")
            for batch in consumer.poll(timeout_ms=200).values():
                deadline = time.monotonic() + timeout_s  # a long first read is progress, not a stall
                for record in batch:
                    connector, source = json.loads(record.key)
                    if connector == "MirrorSourceConnector" and source.get("cluster") == self.region and record.value:
                        self._copied[(source["topic"], int(source["partition"]))] = int(json.loads(record.value)["offset"]) + 1
        return dict(self._copied)

    def lag(self, topics: list[str]) -> list[MirrorLag]:
        """One row per partition of the region's `topics`: what MM2 copied into central against what the region committed."""
        copied = self.copied()
        consumer = self._source
        rows = []
        for topic in topics:
            tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            for tp, end in sorted(consumer.end_offsets(tps, timeout_ms=ASK_TIMEOUT_MS).items(), key=lambda item: item[0].partition):
                start = copied.get((topic, tp.partition), 0)
                rows.append(MirrorLag(self.region, topic, tp.partition, start, end, _committed_between(consumer, tp, start, end)))
        return rows

    def close(self) -> None:
        self._central.close()
        self._source.close()


def _reader(bootstrap: str, security: KafkaSecurity | None) -> KafkaConsumer:
    """One principal for central and every region: on secured clusters a role has the same user and password in each
    (infra/regions.sh --secure), so the ETL's `kafka.security` reaches all of them."""
    return KafkaConsumer(
        bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False,
        **(security or KafkaSecurity()).client_kwargs(),
    )


def mirror_lag(
    central: str, region: str, region_bootstrap: str, topics: list[str], security: KafkaSecurity | None = None
) -> list[MirrorLag]:
    """One ask, for `ember rollouts stats --region` and the tests (`RegionProofs` keeps its `MirrorWatch`es)."""
    watch = MirrorWatch(central, region, region_bootstrap, security)
    try:
        return watch.lag(topics)
    finally:
        watch.close()


def _committed_between(consumer: KafkaConsumer, tp: TopicPartition, start: int, end: int) -> int:
    if end - start > COUNT_LIMIT or end <= start:
        return max(0, end - start)
    consumer.assign([tp])
    consumer.seek(tp, start)
    count = 0
    deadline = time.monotonic() + 30
    while consumer.position(tp) < end:
        if time.monotonic() > deadline:
            raise TimeoutError(f"could not read {tp.topic}[{tp.partition}] from {start} to {end} within 30s")
        for batch in consumer.poll(timeout_ms=200).values():
            count += sum(1 for r in batch if r.offset < end)
    return count


@dataclass(frozen=True)
class ReplicationLag:
    """What the ETL's metrics show per mirrored partition."""

    region: str
    topic: str  # the region's topic
    partition: int
    records: int  # committed region records not copied yet, at the last ask that reached the region
    seconds: float  # since the region last held nothing uncopied (since the asks began, if it never has)


class RegionProofs:
    """Asks each region's own cluster, in the background, whether MM2 has copied all it holds: the only evidence of
    what a region has not sent yet (central's end offsets say nothing about it; see `LogClock.mirror_end`). A thread,
    since a region that is down makes each ask wait for its connection timeout, and the ETL loop must not."""

    def __init__(
        self, central: str, regions: dict[str, str], topics: list[str], every_s: float = 1.0, security: KafkaSecurity | None = None
    ):
        self._central, self._regions, self._topics, self._every_s = central, dict(regions), list(topics), every_s
        self._security = security
        self._proofs: dict[tuple[str, str, int], int] = {}
        self._behind: dict[tuple[str, str, int], int] = {}
        self._started_ms = int(time.time() * 1000)
        self._warned_at: dict[str, float] = {}  # region -> when its silence was last logged
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="region-proofs", daemon=True)

    def start(self) -> RegionProofs:
        self._thread.start()
        return self

    def latest(self) -> dict[tuple[str, str, int], int]:
        """(region, region topic, partition) -> the latest wall time (ms) at which the region held no committed
        record the mirror had not copied into central."""
        with self._lock:
            return dict(self._proofs)

    def lags(self) -> list[ReplicationLag]:
        """Replication lag per mirrored partition asked about so far. The seconds keep growing while a region cannot be
        asked (or MM2 is down): the one figure that says how stale a region's data in central may be."""
        now_ms = int(time.time() * 1000)
        with self._lock:
            return [
                ReplicationLag(*key, behind, max(0.0, (now_ms - self._proofs.get(key, self._started_ms)) / 1000))
                for key, behind in sorted(self._behind.items())
            ]

    def close(self) -> None:
        self._halt.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        watches: dict[str, MirrorWatch] = {}
        try:
            while not self._halt.is_set():
                for region, bootstrap in self._regions.items():
                    self._ask(watches, region, bootstrap)
                self._halt.wait(self._every_s)
        finally:
            for watch in watches.values():
                watch.close()

    def _ask(self, watches: dict[str, MirrorWatch], region: str, bootstrap: str) -> None:
        asked_at_ms = int(time.time() * 1000)  # before MM2's positions and the region's ends are read
        try:
            if region not in watches:
                watches[region] = MirrorWatch(self._central, region, bootstrap, self._security)
            rows = watches[region].lag(self._topics)
        except Exception as exc:  # a region down or cut off proves nothing this time; the next round asks anew
            self._say_silent(region, bootstrap, exc)
            watch = watches.pop(region, None)
            if watch is not None:
                watch.close()
            return
        with self._lock:
            for row in rows:
                self._behind[(region, row.topic, row.partition)] = row.behind
                if row.behind == 0:
                    self._proofs[(region, row.topic, row.partition)] = asked_at_ms

    def _say_silent(self, region: str, bootstrap: str, exc: Exception, every_s: float = 30.0) -> None:
        """A region that cannot be asked holds the shards' decisions: say so, at most every `every_s`, not per ask."""
        now = time.monotonic()
        if now - self._warned_at.get(region, float("-inf")) >= every_s:
            self._warned_at[region] = now
            log.warning("region %s (%s) cannot be asked what MM2 has not copied, or central (%s) what MM2 committed (%r): "
                        "its mirrored topics hold the ETL's decisions until both answer", region, bootstrap, self._central, exc)
