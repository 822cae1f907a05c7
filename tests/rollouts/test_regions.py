"""Regions as real clusters mirrored by MirrorMaker 2 (infra/regions.sh), and the faults the mirror must survive.

One central broker of this file's own, one pair of regional clusters and one MM2 node serve every test here (module
fixtures, one xdist group): starting them costs most of this file's time. Each test counts, reading read_committed from the central cluster on its own,
the rollouts that arrived from each region against the ones each region committed: 0 lost, 0 doubled.
"""

from __future__ import annotations

import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator

import pyarrow.ipc as pa_ipc
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaTimeoutError
from typer.testing import CliRunner

from ember.cli import app
from ember.dev import services
from ember.rollouts.admin import ensure_topics, list_topics
from ember.rollouts.config import parse_config
from ember.rollouts.engine import input_topics
from ember.rollouts.metrics import EtlMetrics
from ember.rollouts.mirror import MirrorWatch, RegionProofs
from ember.rollouts.reader import RolloutBatchReader
from ember.rollouts.records import Reason
from ember.rollouts.replay import parse_start, replay
from ember.rollouts.stats import collect_stats
from ember.rollouts.topics import Topics
from ember.schemas import decode_reward, decode_rollout, decode_train_batch, encode
from tests.rollouts.etl_support import Deployment, EtlThread, books, etl_settings, read_topic
from tests.rollouts.fresh_broker import fresh_broker
from tests.rollouts.helpers import reward, rollout

REGIONS = ("us", "eu")
PREFIX = "regions-"
pytestmark = pytest.mark.xdist_group("regions")


@pytest.fixture(scope="module")
def kafka(kafka) -> Iterator[str]:
    """This file's central cluster: a broker of its own, freshly formatted, so that restarting it (below) stops nobody
    else's and this file runs beside the rest of the suite, not alone. For the file's duration every `infra/kafka.sh`
    call and every client default (EMBER_KAFKA_*) means it. The suite's `kafka` only makes sure the jars are there."""
    with fresh_broker() as broker, pytest.MonkeyPatch.context() as env:
        for name in ("EMBER_KAFKA_NAME", "EMBER_KAFKA_PORT", "EMBER_KAFKA_CONTROLLER_PORT", "EMBER_KAFKA_HEAP"):
            env.setenv(name, broker.env[name])
        env.setenv("EMBER_KAFKA_BOOTSTRAP", broker.bootstrap)
        yield broker.bootstrap


@pytest.fixture(scope="module")
def regions(kafka) -> Iterator[dict[str, str]]:
    """Region -> bootstrap of its cluster, with MM2 mirroring every region into this file's central broker. Stopped
    after this file's tests (an MM2 already running, from `ember dev up --regions`, is restarted for this central and
    stopped too): two brokers and MM2 left running would slow every later test."""
    try:
        services.start_regions(list(REGIONS))
    except services.ServiceError as exc:
        pytest.fail(f"the regional clusters and MirrorMaker 2 could not be started:\n{exc}")
    yield {region: services.region_bootstrap(region) for region in REGIONS}
    services.run_script("regions.sh", "stop", check=False)


@pytest.fixture
def topic_prefix() -> str:
    return f"{PREFIX}{uuid.uuid4().hex[:10]}"


def make_region_topics(regions: dict[str, str], prefix: str) -> Topics:
    specs = Topics(prefix).specs(2)
    for bootstrap in regions.values():
        ensure_topics(bootstrap, [specs["rollouts"]])
    return Topics(prefix)


def mirrored(kafka: str, topic: str, expected: int, timeout_s: float = 90.0) -> Counter:
    """Ids of the committed records of `topic` in central, read until `expected` arrived (or the time is up) and then
    to the end offsets of that moment, so a doubled record that lands right after the last expected one is seen."""
    consumer = KafkaConsumer(bootstrap_servers=kafka, isolation_level="read_committed", enable_auto_commit=False)
    ids: Counter = Counter()
    try:
        deadline = time.monotonic() + timeout_s
        while not consumer.partitions_for_topic(topic):
            assert time.monotonic() < deadline, f"MM2 never created {topic} in the central cluster"
            time.sleep(0.5)
            consumer.close()
            consumer = KafkaConsumer(bootstrap_servers=kafka, isolation_level="read_committed", enable_auto_commit=False)
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        while sum(ids.values()) < expected and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                ids.update(r.key.decode() for r in batch)
        ends = consumer.end_offsets(tps)
        while any(consumer.position(tp) < ends[tp] for tp in tps) and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                ids.update(r.key.decode() for r in batch if r.offset < ends[TopicPartition(r.topic, r.partition)])
        return ids
    finally:
        consumer.close()


def assert_exactly_once(ids: Counter, sent: list[str], where: str) -> None:
    doubled = {k: n for k, n in ids.items() if n > 1}
    lost = set(sent) - set(ids)
    extra = set(ids) - set(sent)
    assert not lost and not doubled and not extra, (
        f"{where}: {len(lost)} lost (e.g. {sorted(lost)[:3]}), {len(doubled)} doubled (e.g. {list(doubled.items())[:3]}), "
        f"{len(extra)} never committed (e.g. {sorted(extra)[:3]})"
    )


class Producer(threading.Thread):
    """Sends rollout ids to a region's topic until stopped: the stream a fault lands in the middle of."""

    def __init__(self, bootstrap: str, topic: str, region: str):
        super().__init__(daemon=True)
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", linger_ms=5)
        self.topic, self.region = topic, region
        self.sent: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            rid = f"{self.region}-{len(self.sent)}"
            self.producer.send(self.topic, key=rid.encode(), value=b"x" * 256).get(timeout=30)
            self.sent.append(rid)
            time.sleep(0.01)

    def finish(self) -> list[str]:
        self.halt.set()
        self.join(timeout=60)
        self.producer.close()
        return self.sent


def regions_script(*args: str) -> None:
    """infra/regions.sh ACTION...; its log lines (a hanging transaction aborted, say) are shown when a test fails."""
    result = services.run_script("regions.sh", *args)
    print(f"regions.sh {' '.join(args)}:", result.stdout, result.stderr, sep="\n")


def test_dev_up_regions_refuses_bad_names_in_one_line():
    for bad, why in (("us,us", "twice"), ("central", "not 'central'"), ("US", "lowercase"), (",", "at least one")):
        with pytest.raises(ValueError, match=why):
            services.parse_regions(bad)
    assert services.parse_regions("us, eu") == ["us", "eu"]
    result = CliRunner().invoke(app, ["dev", "up", "--regions", "us,EU"])
    assert result.exit_code == 2 and result.output.strip().count("\n") == 0 and "'EU'" in result.output, result.output


def test_topics_create_for_a_region_never_started_is_one_line_exit_2():
    result = CliRunner().invoke(app, ["rollouts", "topics", "create", "--prefix", "regions-none", "--region", "nowhere"])
    assert result.exit_code == 2, result.output
    assert "region 'nowhere' was never started here" in result.output and result.output.strip().count("\n") == 0


def test_mm2_killed_mid_stream_loses_and_doubles_nothing(kafka, regions, topic_prefix):
    topics = make_region_topics(regions, topic_prefix)
    producers = {r: Producer(b, topics.rollouts, r) for r, b in regions.items()}
    watches = {r: MirrorWatch(kafka, r, b) for r, b in regions.items()}  # MM2's offsets read whole once, before the stream
    for watch in watches.values():
        watch.copied()
    proofs = RegionProofs(kafka, regions, [topics.rollouts]).start()  # what the ETL's replication lag metrics show
    metrics = EtlMetrics()
    shown = metrics_when(metrics, proofs, topics.rollouts, lambda lags: len(lags) == 2)
    assert all(len(lags) == 2 for lags in shown.values()), f"no replication lag asked of both regions within 120 s: {shown}"
    for p in producers.values():
        p.start()
    time.sleep(2)
    regions_script("mm2", "kill")
    time.sleep(2)  # the regions keep producing while nothing mirrors
    for region, watch in watches.items():
        behind = sum(row.behind for row in watch.lag([topics.rollouts]))
        assert behind > 0, f"{region}: 2 s of rollouts produced with MM2 dead, yet none reported as not mirrored"
    def dead(lags: dict) -> bool:
        return len(lags) == 2 and all(n > 0 and s >= 1.0 for n, s in lags.values())

    shown = metrics_when(metrics, proofs, topics.rollouts, dead)
    assert all(dead(lags) for lags in shown.values()), f"MM2 dead, yet the ETL's metrics show {shown}"
    regions_script("mm2", "start")
    time.sleep(1)
    sent = {r: p.finish() for r, p in producers.items()}
    for region, ids in sent.items():
        assert len(ids) > 100, f"{region} produced only {len(ids)} rollouts: the kill did not land mid-stream"
        assert_exactly_once(mirrored(kafka, f"{region}.{topics.rollouts}", len(ids)), ids, f"{region} after an MM2 kill -9")
        rows = watches[region].lag([topics.rollouts])
        assert [(r.copied, r.behind) for r in rows] == [(r.end, 0) for r in rows], rows
    def caught_up(lags: dict) -> bool:
        return len(lags) == 2 and all(n == 0 and s < 5 for n, s in lags.values())

    shown = metrics_when(metrics, proofs, topics.rollouts, caught_up)
    proofs.close()
    for watch in watches.values():
        watch.close()
    assert all(caught_up(lags) for lags in shown.values()), f"after MM2 caught up, the ETL's metrics show {shown}"


def metrics_when(metrics: EtlMetrics, proofs: RegionProofs, topic: str, done, timeout_s: float = 120) -> dict:
    """Region -> its replication lag as the ETL's metrics show it (as the ETL sets them, from `proofs`), once `done`
    holds for every region or the time is up (the first ask reads MM2's whole offsets topic: slow on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics.show_replication(proofs.lags())
        shown = {r: replication_lag(metrics, r, topic) for r in REGIONS}
        if all(done(lags) for lags in shown.values()) or time.monotonic() > deadline:
            return shown
        time.sleep(1)


def replication_lag(metrics: EtlMetrics, region: str, topic: str) -> dict[int, tuple[float, float]]:
    """partition -> (records, seconds) of a region's topic, as the ETL's /metrics shows them."""
    found: dict[int, dict[str, float]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name.startswith("ember_etl_replication_lag_") and sample.labels["region"] == region and sample.labels["topic"] == topic:
                found.setdefault(int(sample.labels["partition"]), {})[sample.name.rsplit("_", 1)[1]] = sample.value
    return {p: (values["records"], values["seconds"]) for p, values in found.items()}


def test_policy_versions_reach_every_region(kafka, regions, topic_prefix):
    topics = Topics(topic_prefix)
    ensure_topics(kafka, [topics.specs()["policy_versions"]])
    producer = KafkaProducer(bootstrap_servers=kafka, enable_idempotence=True)
    versions = [f"v{i}" for i in range(5)]
    for v in versions:
        producer.send(topics.policy_versions, key=v.encode(), value=b"{}")
    producer.close()
    for region, bootstrap in regions.items():
        assert_exactly_once(mirrored(bootstrap, f"central.{topics.policy_versions}", len(versions)), versions, region)


def test_region_down_others_flow_and_its_open_transaction_is_never_mirrored(kafka, regions, topic_prefix):
    """A 15 s outage, not 60 s: MM2 reads a region with assign() (no group session to expire) and a refused connection
    fails at once, so a longer outage only repeats the same reconnect; what matters is that eu flows while us is down
    and that us's records, committed or open when it died, come through exactly as committed."""
    topics = make_region_topics(regions, topic_prefix)
    us = KafkaProducer(bootstrap_servers=regions["us"], transactional_id=f"{topic_prefix}-us")
    us.init_transactions()
    us.begin_transaction()
    committed = [f"us-{i}" for i in range(50)]
    for rid in committed:
        us.send(topics.rollouts, key=rid.encode(), value=b"x")
    us.commit_transaction()
    us.begin_transaction()
    for i in range(20):  # open when the broker dies: never committed
        us.send(topics.rollouts, key=f"us-open-{i}".encode(), value=b"x")
    us.flush()
    eu = Producer(regions["eu"], topics.rollouts, "eu")
    regions_script("broker", "us", "stop")
    try:
        eu.start()
        down_at = time.monotonic()
        during = mirrored(kafka, f"eu.{topics.rollouts}", 200, timeout_s=30)
        assert sum(during.values()) >= 200, f"eu mirrored only {sum(during.values())} rollouts while us was down"
        time.sleep(max(0.0, 15 - (time.monotonic() - down_at)))
    finally:
        regions_script("broker", "us", "start")
    us.close(timeout=1)
    again = KafkaProducer(bootstrap_servers=regions["us"], transactional_id=f"{topic_prefix}-us")
    again.init_transactions()  # fences the dead transaction: it is aborted, its records stay unread by read_committed
    again.begin_transaction()
    after = [f"us-{i}" for i in range(50, 80)]
    for rid in after:
        again.send(topics.rollouts, key=rid.encode(), value=b"x")
    again.commit_transaction()
    again.close()
    eu_sent = eu.finish()
    assert_exactly_once(mirrored(kafka, f"us.{topics.rollouts}", len(committed + after)), committed + after, "us after an outage")
    assert_exactly_once(mirrored(kafka, f"eu.{topics.rollouts}", len(eu_sent)), eu_sent, "eu while us was down")


def send_groups(regions: dict[str, str], topics: Topics, groups: list[str], *, cut_us_off: bool = False) -> list[str]:
    """Each group's 2 rollouts sampled in us, their rewards graded in eu (keyed by group: the same partition in both,
    and MM2 keeps it). With `cut_us_off`, us's broker stops between the two: the rewards flow while us is cut off."""
    us = KafkaProducer(bootstrap_servers=regions["us"], enable_idempotence=True, acks="all")
    sampled = {g: [rollout(g, i) for i in range(2)] for g in groups}
    for g, rollouts in sampled.items():
        for r in rollouts:
            us.send(topics.rollouts, key=g.encode(), value=encode(r))
    us.flush()
    us.close()
    if cut_us_off:
        regions_script("broker", "us", "stop")
    eu = KafkaProducer(bootstrap_servers=regions["eu"], enable_idempotence=True, acks="all")
    for g, rollouts in sampled.items():
        for i, r in enumerate(rollouts):
            eu.send(topics.rewards, key=g.encode(), value=encode(reward(r, float(i))))
    eu.close()
    return [r.rollout_id for rollouts in sampled.values() for r in rollouts]


def batched_when(topics: Topics, count: int, timeout_s: float) -> Counter:
    """Rollout ids in committed train batches (read_committed, independently of the ETL), once `count` are there."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ids = Counter(books(topics).batched)
        except KafkaTimeoutError:  # central just restarted and not serving every partition yet: ask again
            if time.monotonic() > deadline:
                raise
            continue
        if sum(ids.values()) >= count or time.monotonic() > deadline:
            return ids
        time.sleep(1)


def test_etl_joins_regions_and_a_rebalance_while_a_region_is_cut_off_loses_nothing(kafka, regions, topic_prefix, tmp_path):
    """Rollouts sampled in us, graded in eu, read by the ETL from the mirrored topics. While us is cut off, eu's rewards
    keep arriving but us's clock holds them (us may still send a rollout stamped before them), and a second ETL joins
    the group; once us is back, every rollout is in exactly one batch and no in-time reward was judged late."""
    topics, config = regional_etl(regions, topic_prefix)
    mirrored = wait_for_mirrored_topics(kafka, regions, topics, 60)
    first = EtlThread(config, "a")
    first.start()
    second = None
    try:
        sent = send_groups(regions, topics, [f"a{i}" for i in range(8)])
        assert sum(batched_when(topics, len(sent), 60).values()) == len(sent), "the cross-region join batched too few"
        try:
            held = send_groups(regions, topics, [f"b{i}" for i in range(8)], cut_us_off=True)
            second = EtlThread(config, "b")
            second.start()
            time.sleep(10)  # the rebalance, and eu's rewards mirrored, while us is cut off
            during = batched_when(topics, len(sent) + 1, 0)
            assert sum(during.values()) == len(sent), "a reward was decided on while us, which may send earlier rollouts, was cut off"
        finally:
            regions_script("broker", "us", "start")
        sent += held + send_groups(regions, topics, [f"c{i}" for i in range(8)])
        ids = batched_when(topics, len(sent), 90)
        shown = {(r, t): replication_lag(first.service.metrics, r, t) for r in regions for t in (topics.rollouts, topics.rewards)}
    finally:
        for etl in (first, second):
            if etl is not None:
                etl.finish()
    assert_exactly_once(ids, sent, "train batches after a rebalance with us cut off")
    caught_up = {where: sorted(lags) == [0, 1] and all(n == 0 and s < 30 for n, s in lags.values()) for where, lags in shown.items()}
    assert all(caught_up.values()), f"the ETL's replication lag metrics, every region caught up: {shown}"
    late = [o for o in books(topics).rewards_dropped if Reason(o.reason) is Reason.LATE_REWARD]
    assert not late, f"{len(late)} in-time rewards judged late, e.g. {late[0]}"
    stats = collect_stats(config, window_s=0)
    assert stats.batched_by_source == {"us.rollouts": len(sent)}, stats.batched_by_source
    assert {p.topic for p in stats.partitions} >= mirrored, stats.partitions  # lag per region's mirrored partition
    refs = [ref for record in read_topic(topics.train_batches) for ref in decode_train_batch(record.value).rollout_refs]
    assert {ref.topic for ref in refs} == {f"us.{topics.rollouts}"}, "batch references must name the mirrored topic"
    with RolloutBatchReader(topics.train_batches, group_id=f"{topic_prefix}-trainer", bootstrap=kafka, idle_timeout_s=5) as reader:
        resolved = Counter(rid for read in reader for rid in read.batch.rollout_ids)  # each reference fetched, sha256 checked
    assert_exactly_once(resolved, sent, "the trainer's reader resolving references to mirrored offsets")
    replay_from_mirrored_offsets(config, refs, {rid for rid in sent if rid.startswith("c")}, tmp_path)


def replay_from_mirrored_offsets(config, refs: list, wanted: set[str], tmp_path) -> None:
    """A replay started at the batch references' mirrored offsets of the `wanted` rollouts (`us.rollouts:p=o`) batches
    exactly those: the earlier ones are before its start, and their rewards (read from eu.rewards' beginning) orphans."""
    id_at = {}
    for record in read_topic(config.kafka.topics.train_batches):
        batch = decode_train_batch(record.value)
        id_at.update({(ref.partition, ref.offset): rid for ref, rid in zip(batch.rollout_refs, batch.rollout_ids)})
    starts = {}
    for partition in sorted({ref.partition for ref in refs}):
        offsets = [o for p, o in id_at if p == partition]
        starts[partition] = min((o for o in offsets if id_at[(partition, o)] in wanted), default=max(offsets) + 1)
    spec = ",".join(f"us.rollouts:{p}={o}" for p, o in starts.items())
    summary = replay(config, parse_start(spec), to_dir=tmp_path / "replay")
    table = pa_ipc.open_file(str(tmp_path / "replay" / "batches.arrow")).read_all()
    replayed = Counter(rid for ids in table.column("rollout_ids").to_pylist() for rid in ids)
    assert_exactly_once(replayed, sorted(wanted), f"a replay --from {spec}")
    assert summary.rollouts == len(wanted), summary


def test_replay_from_names_regional_sources_and_refuses_unread_ones():
    start = parse_start("us.rollouts:0=12,eu.rewards:1=3,rollouts:0=1")
    assert start.offsets == {("us.rollouts", 0): 12, ("eu.rewards", 1): 3, ("rollouts", 0): 1}
    start.check_sources(input_topics(Topics("p"), regions=["us", "eu"]))
    with pytest.raises(ValueError, match="us.rollouts, which this config does not read"):
        start.check_sources(input_topics(Topics("p")))
    for bad in ("US.rollouts:0=1", "us.policy-versions:0=1", "us.rollouts:x=1"):
        with pytest.raises(ValueError, match="bad offset spec"):
            parse_start(bad)


class GroupStream(threading.Thread):
    """Groups of 2 rollouts sampled in us and graded in eu, one group every `every_s`, until stopped: the stream a
    central restart lands in the middle of. The regions stay up, so they keep taking rollouts and rewards."""

    def __init__(self, regions: dict[str, str], topics: Topics, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.us = KafkaProducer(bootstrap_servers=regions["us"], enable_idempotence=True, acks="all")
        self.eu = KafkaProducer(bootstrap_servers=regions["eu"], enable_idempotence=True, acks="all")
        self.topics, self.every_s = topics, every_s
        self.sent: list[str] = []
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                group = f"g{len(self.sent) // 2}"
                rollouts = [rollout(group, i) for i in range(2)]
                for r in rollouts:
                    self.us.send(self.topics.rollouts, key=group.encode(), value=encode(r)).get(timeout=30)
                for i, r in enumerate(rollouts):
                    self.eu.send(self.topics.rewards, key=group.encode(), value=encode(reward(r, float(i)))).get(timeout=30)
                self.sent += [r.rollout_id for r in rollouts]
                self.halt.wait(self.every_s)
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def finish(self) -> list[str]:
        self.halt.set()
        self.join(timeout=60)
        self.us.close()
        self.eu.close()
        assert self.error is None, f"a region refused a record: {self.error!r}"
        return self.sent


def regional_etl(regions: dict[str, str], topic_prefix: str):
    """Each region's rollouts and rewards topics made, and the config of an ETL reading them through the mirror."""
    topics = Topics(topic_prefix)
    specs = topics.specs(2)
    for bootstrap in regions.values():
        ensure_topics(bootstrap, [specs["rollouts"], specs["rewards"]])
    settings = etl_settings(
        topic_prefix, partitions=2, kafka={"create_topics": True, "regions": regions},
        groups={"size": 2, "quorum": 2, "timeout_s": 20}, rewards={"timeout_s": 10, "orphan_timeout_s": 30},
    )
    return topics, parse_config(settings)


def wait_for_mirrored_topics(kafka: str, regions: dict[str, str], topics: Topics, timeout_s: float) -> set[str]:
    """Until MM2 has made every region's rollouts and rewards topic in central (it finds new topics on its own clock);
    returns their names."""
    mirrored = {f"{r}.{t}" for r in regions for t in (topics.rollouts, topics.rewards)}
    deadline = time.monotonic() + timeout_s
    while not mirrored <= set(list_topics(kafka)):
        assert time.monotonic() < deadline, f"MM2 did not create {sorted(mirrored - set(list_topics(kafka)))} in central"
        time.sleep(0.5)
    return mirrored


# Alone, after the parallel phase. Second copies in central have been seen twice in ~20 runs: a reward once (the ETL
# then called it late; now a duplicate_reward), and in CI a rollout committed twice at adjacent offsets of central.
# So the test counts each record's copies in its region and in central: MM2 must lose none; a copy past the first,
# whichever layer made it (the region's producer or MM2, the latter reported as a warning), must be dropped by the
# ETL as a duplicate and nothing else may be dropped.
@pytest.mark.serial
def test_central_restart_mid_stream_loses_doubles_and_misjudges_nothing(kafka, regions, topic_prefix):
    """The central (training) broker stops and starts while both regions keep sampling and grading. The ETL reconnects
    on its own, MM2 is restarted (see below); each region's records wait in the region, stamped with the region's log
    time, so the deadlines here are the ordinary ones (no outage allowance): a reward in time in its region is in time
    in central."""
    topics, config = regional_etl(regions, topic_prefix)
    wait_for_mirrored_topics(kafka, regions, topics, 120)
    etl = EtlThread(config, "a")
    etl.start()
    stream = GroupStream(regions, topics)
    try:
        stream.start()
        deadline = time.monotonic() + 120
        while not books(topics).batched:  # central is reached through the mirror before the restart lands
            assert time.monotonic() < deadline, "nothing reached a train batch through the mirror within 120 s"
            time.sleep(0.5)
        services.stop("kafka")
        time.sleep(2)
    finally:
        services.start("kafka")
    # MM2 4.3.1 does not resume on its own: its exactly-once tasks into central fail to stop while central is down, and
    # the ones started after it is back never finish initialising (seen for 6 minutes). The operator's step, as the
    # guide says: restart the mirror once central is back. Its exactly-once copy resumes from its last commit.
    regions_script("mm2", "stop")
    regions_script("mm2", "start")
    time.sleep(3)  # the regions keep flowing after central and the mirror are back
    sent = stream.finish()
    try:
        ids = batched_when(topics, len(sent), 120)
    finally:
        etl.finish()
    assert len(sent) >= 40, f"only {len(sent)} rollouts sampled: the restart did not land mid-stream"
    assert_exactly_once(ids, sent, "train batches after a central restart")
    extra: dict[tuple[str, int, int], Reason] = {}  # every committed copy in central past a rollout's first: a duplicate
    mirror_doubled = {}
    for region, source, decode_id, reason in (
        ("us", topics.rollouts, decode_rollout, Reason.DUPLICATE),
        ("eu", topics.rewards, decode_reward, Reason.DUPLICATE_REWARD),
    ):
        topic = f"{region}.{source}"
        produced = copies_by_rollout(read_topic(source, deployment=Deployment(regions[region])), decode_id)
        committed = copies_by_rollout(read_topic(topic), decode_id)
        every = copies_by_rollout(read_topic(topic, isolation_level="read_uncommitted"), decode_id)
        lost = {rid: (offsets, committed.get(rid, [])) for rid, offsets in produced.items() if len(committed.get(rid, [])) < len(offsets)}
        assert set(produced) == set(sent) and not lost, (
            f"MM2's copy into {topic} across the restart lost records: {len(set(sent) - set(produced))} never in the "
            f"region, {len(lost)} with fewer committed copies in central than in the region, e.g. (region offsets, "
            f"central committed offsets) {list(lost.items())[:3]}"
        )
        mirror_doubled |= {
            (topic, rid): (produced[rid], offsets, every[rid]) for rid, offsets in committed.items() if len(offsets) > len(produced[rid])
        }
        extra |= {(topic, *copy): reason for copies in committed.values() for copy in sorted(copies)[1:]}
    if mirror_doubled:  # not ember's layer: MM2's exactly-once copy; the ledger below must still drop each copy once
        warnings.warn(
            f"MM2 committed more copies in central than its region holds across the central restart: (topic, rollout) "
            f"-> (region offsets, central committed offsets, every central offset) {list(mirror_doubled.items())[:3]}",
            stacklevel=1,
        )
    ledger = books(topics)
    drops = {(o.topic, o.partition, o.offset): o.reason for o in ledger.dropped + ledger.rewards_dropped}
    assert drops == {key: reason.value for key, reason in extra.items()}, (
        f"the ledger must drop exactly the second copies in central, each as a duplicate: {len(drops)} dropped, "
        f"{len(extra)} second copies; dropped but no second copy (topic, partition, offset, reason): "
        f"{sorted(set(drops.items()) - {(k, r.value) for k, r in extra.items()})[:3]}; second copies not dropped as "
        f"duplicates: {sorted((k, r.value) for k, r in extra.items() if drops.get(k) != r.value)[:3]}"
    )


def copies_by_rollout(records: list, decode_id) -> dict[str, list[tuple[int, int]]]:
    """Rollout id -> the (partition, offset) of each record (the rollout, or a reward for it) that names it."""
    found: dict[str, list[tuple[int, int]]] = {}
    for record in records:
        found.setdefault(decode_id(record.value).rollout_id, []).append((record.partition, record.offset))
    return found
