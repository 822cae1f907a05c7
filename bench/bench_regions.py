"""Rollouts produced in a region and read in the central cluster through MirrorMaker 2, vs produced to central directly.

Both paths run in one process, interleaved, against the same central broker: the anchor is a rollout produced
straight to central (what a single-cluster deployment does), ember's path is a rollout produced to region `us` and
copied by MM2 (exactly-once, infra/regions.sh) into `us.<prefix>.rollouts`. The reader is a read_committed consumer
on central, so a mirrored rollout counts only once MM2's transaction that copied it committed.

- throughput: --rollouts rollouts of --bytes each sent as fast as the idempotent producer acknowledges; rollouts/s
  from the first send to the last rollout read in central.
- latency under a steady rate: --rate rollouts/s for --seconds; per rollout, read in central - sent (one host clock);
  p50/p99. The mirror's p50 minus the anchor's is the replication lag at that rate.
- bytes crossing the "WAN": the mirrored topic's bytes on central's disk per byte of rollout payload (the records MM2
  wrote across), and the region topic's bytes per payload byte (what MM2 fetched), from kafka-log-dirs.

Through the ETL (the user's path, reported first): groups of rollouts sampled in us and graded in eu, read by the ETL
from the mirrored topics (`kafka.regions`) into train batches, against the same groups sent to central's own topics and
read by the same ETL settings (the anchor). Per rollout, its batch seen committed in train-batches (read_committed)
minus its send time: throughput of a burst, p50/p99 at a steady rate; during the steady phase the ETL's own
`ember_etl_replication_lag_seconds` (MM2's committed positions against each region's end, sampled each second);
and a trainer's reader resolving every batch reference (they name `us.<prefix>.rollouts` offsets in central).

All clusters (central, the regions, MM2) and this process share one machine (2 cores here): the numbers say what the
mirror costs here, not what a WAN would.

    .venv/bin/python bench/bench_regions.py --profile quick|full [--results FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.dev import services  # noqa: E402
from ember.rollouts.admin import ensure_topics, list_topics  # noqa: E402
from ember.rollouts.config import kafka_bootstrap, parse_config  # noqa: E402
from ember.rollouts.etl import EtlService, prepare_topics  # noqa: E402
from ember.rollouts.reader import RolloutBatchReader  # noqa: E402
from ember.rollouts.simulate import LARGE_VOCAB, synthetic_reward, synthetic_rollout  # noqa: E402
from ember.rollouts.topics import Topics  # noqa: E402
from ember.schemas import decode_train_batch, encode  # noqa: E402

REGIONS = ["us", "eu"]
PREFIX = "regions-"  # the tests' prefix family: the same MM2 config, so a running MM2 is not restarted


class Reader(threading.Thread):
    """Reads a central topic read_committed from the start; keeps (send time, read time) per rollout."""

    def __init__(self, bootstrap: str, topic: str, expected: int, security: dict | None = None):
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.expected, self.security = bootstrap, topic, expected, security or {}
        self.times: list[tuple[float, float]] = []
        self.ready = threading.Event()

    def run(self) -> None:
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, isolation_level="read_committed", fetch_max_wait_ms=50, **self.security)
        deadline = time.monotonic() + 300
        while not consumer.partitions_for_topic(self.topic):
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.topic} never appeared in central")
            time.sleep(0.2)
            consumer.close()
            consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, isolation_level="read_committed", fetch_max_wait_ms=50, **self.security)
        tps = [TopicPartition(self.topic, p) for p in consumer.partitions_for_topic(self.topic)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        self.ready.set()
        while len(self.times) < self.expected and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                now = time.time()
                self.times += [(struct.unpack_from("<d", r.value)[0], now) for r in batch]
        consumer.close()


def send(bootstrap: str, topic: str, count: int, size: int, rate: float | None, security: dict | None = None) -> float:
    """Sends `count` rollouts stamped with their send time; paced at `rate`/s when given. Returns the first send time.
    Random bytes: token ids compress little, and a repeated pad would let zstd make the mirror look free."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", linger_ms=5, max_request_size=8 << 20,
                             **(security or {}))
    start = time.time()
    for i in range(count):
        if rate:
            time.sleep(max(0.0, start + i / rate - time.time()))
        producer.send(topic, key=str(i).encode(), value=struct.pack("<d", time.time()) + os.urandom(size - 8))
    producer.flush()
    producer.close()
    return start


def run_path(name: str, produce_to: str, topic: str, read_topic: str, central: str, count: int, size: int, rate: float | None,
             produce_as: dict | None = None, read_as: dict | None = None) -> dict:
    """`produce_as` / `read_as`: kafka-python security settings of the producer and the reader (secured clusters)."""
    reader = Reader(central, read_topic, count, read_as)
    reader.start()
    start = send(produce_to, topic, count, size, rate, produce_as)
    reader.join()
    if len(reader.times) != count:
        raise SystemExit(f"{name}: read {len(reader.times)} of {count} rollouts in central")
    latencies = sorted(read - sent for sent, read in reader.times)
    return {
        "rollouts_per_s": count / (max(read for _, read in reader.times) - start),
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
    }


def topic_bytes(bootstrap: str, topic: str) -> int:
    """Bytes of a topic's partitions on the broker's disk (kafka-log-dirs)."""
    classpath = subprocess.run(["bash", "infra/kafka.sh", "classpath"], capture_output=True, text=True, check=True).stdout.strip()
    out = subprocess.run(
        ["java", "-XX:TieredStopAtLevel=1", "-cp", classpath, "org.apache.kafka.tools.LogDirsCommand",
         "--bootstrap-server", bootstrap, "--describe", "--topic-list", topic],
        capture_output=True, text=True, check=True,
    ).stdout
    report = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    return sum(p["size"] for broker in report["brokers"] for d in broker["logDirs"] for p in d["partitions"])


GROUP_SIZE = 2
PARTITIONS = 2


def etl_config(prefix: str, regions: dict[str, str] | None, tokens: int):
    """The same settings on both paths; only the sources differ (with regions, the mirrored ones)."""
    kafka = {"topic_prefix": prefix, "partitions": PARTITIONS, "group_id": f"{prefix}-etl", "create_topics": True,
             "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}
    if regions:
        kafka["regions"] = regions
    return parse_config({
        "kafka": kafka,
        "groups": {"size": GROUP_SIZE, "quorum": GROUP_SIZE, "timeout_s": 120},
        "rewards": {"graders": ["unit-tests"], "timeout_s": 60, "orphan_timeout_s": 120},
        "filters": {"max_policy_lag": None, "max_tokens": tokens, "truncated": "keep", "vocab_size": LARGE_VOCAB},
        "batches": {"token_budget": 4 * GROUP_SIZE * tokens, "min_fill": 0.5, "max_wait_s": 0.3},
        "commit": {"interval_ms": 100},
        "metrics": {"status_interval_s": 0},
    })


class BatchWatch(threading.Thread):
    """Reads train-batches read_committed; keeps when each rollout's batch was first seen."""

    def __init__(self, topic: str, expected: int):
        super().__init__(daemon=True)
        self.topic, self.expected = topic, expected
        self.seen: dict[str, float] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap(), isolation_level="read_committed", fetch_max_wait_ms=50)
        while not consumer.partitions_for_topic(self.topic):
            time.sleep(0.2)
        tps = [TopicPartition(self.topic, p) for p in consumer.partitions_for_topic(self.topic)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        while len(self.seen) < self.expected and not self.halt.is_set():
            for batch in consumer.poll(timeout_ms=200).values():
                now = time.time()
                for record in batch:
                    for rid in decode_train_batch(record.value).rollout_ids:
                        self.seen.setdefault(rid, now)
        consumer.close()


def send_groups(rollouts_to: str, rewards_to: str, topics: Topics, groups: int, tokens: int, rate: float | None,
                sent_at: dict[str, float], tag: str) -> int:
    """`groups` groups (rate: groups/s, None: as fast as acknowledged); rollouts to one cluster, rewards to another.
    Returns the rollouts' bytes sent."""
    payload = 0
    rng = np.random.default_rng(0)
    rollout_producer = KafkaProducer(bootstrap_servers=rollouts_to, enable_idempotence=True, acks="all", linger_ms=5,
                                     max_request_size=8 << 20)
    reward_producer = KafkaProducer(bootstrap_servers=rewards_to, enable_idempotence=True, acks="all", linger_ms=5)
    start = time.time()
    for g in range(groups):
        if rate:
            time.sleep(max(0.0, start + g / rate - time.time()))
        group = f"{tag}-g{g}"
        rollouts = [synthetic_rollout(rng, group_id=group, prompt_id=group, num_tokens=tokens, prompt_tokens=64, layers=None,
                                      rollout_id=f"{group}-{i}", finish_reason="stop") for i in range(GROUP_SIZE)]
        for r in rollouts:
            value = encode(r)
            payload += len(value)
            sent_at[r.rollout_id] = time.time()
            rollout_producer.send(topics.rollouts, key=group.encode(), value=value)
        for r in rollouts:
            reward_producer.send(topics.rewards, key=group.encode(), value=encode(synthetic_reward(rng, r)))
    rollout_producer.flush()
    reward_producer.flush()
    rollout_producer.close()
    reward_producer.close()
    return payload


def etl_path(name: str, regions: dict[str, str] | None, central: str, groups: int, tokens: int, rate: float | None,
             timeout_s: float) -> dict:
    """One ETL over fresh topics: `groups` groups through it, each rollout timed from send to its batch committed."""
    prefix = f"{PREFIX}bench-etl-{name}-{uuid.uuid4().hex[:8]}"
    config = etl_config(prefix, regions, tokens)
    topics = config.kafka.topics
    specs = topics.specs(PARTITIONS)
    if regions:
        for bootstrap in regions.values():
            ensure_topics(bootstrap, [specs["rollouts"], specs["rewards"]])
        mirrored = {f"{r}.{t}" for r in regions for t in (topics.rollouts, topics.rewards)}
        deadline = time.monotonic() + 120
        while not mirrored <= set(list_topics(central)):
            if time.monotonic() > deadline:
                raise SystemExit(f"MM2 did not create {sorted(mirrored)} in central within 120 s")
            time.sleep(0.5)
    prepare_topics(config, create=True)  # before anything is sent: a topic auto-created by a send has one partition
    service, stop = EtlService(config, "bench"), threading.Event()
    etl = threading.Thread(target=service.run, args=(stop,), daemon=True)
    etl.start()
    watch = BatchWatch(topics.train_batches, groups * GROUP_SIZE)
    watch.start()
    sent_at: dict[str, float] = {}
    lag_samples: list[float] = []
    sampling = threading.Event()

    def sample_lag() -> None:  # the ETL's replication lag gauge, as a scraper would see it each second
        while not sampling.wait(1.0):
            values = [m.value for family in service.metrics.registry.collect() for m in family.samples
                      if m.name == "ember_etl_replication_lag_seconds"]
            if values:
                lag_samples.append(max(values))

    sampler = threading.Thread(target=sample_lag, daemon=True)
    sampler.start()
    rollouts_to, rewards_to = (regions["us"], regions["eu"]) if regions else (central, central)
    started = time.time()
    payload = send_groups(rollouts_to, rewards_to, topics, groups, tokens, rate, sent_at, prefix)
    watch.join(timeout=timeout_s)
    sampling.set()
    watch.halt.set()
    stop.set()
    etl.join(timeout=60)
    if len(watch.seen) != len(sent_at):
        raise SystemExit(f"{name}: {len(watch.seen)} of {len(sent_at)} rollouts reached a train batch within {timeout_s:g}s")
    latencies = sorted(watch.seen[rid] - sent_at[rid] for rid in sent_at)
    resolve_started = time.monotonic()
    with RolloutBatchReader(topics.train_batches, group_id=f"{prefix}-trainer", bootstrap=central, idle_timeout_s=3) as reader:
        resolved = sum(len(read.batch.rollout_ids) for read in reader)  # each reference fetched and its sha256 checked
    resolve_s = time.monotonic() - resolve_started - 3  # less the idle wait that ends the read
    if resolved != len(sent_at):
        raise SystemExit(f"{name}: the reader resolved {resolved} of {len(sent_at)} batched rollouts")
    return {
        "rollouts_per_s": len(sent_at) / (max(watch.seen.values()) - started),
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "replication_lag_s": statistics.median(lag_samples) if lag_samples else None,
        "resolved_per_s": resolved / max(resolve_s, 1e-3),
        "rollout_topic": f"us.{topics.rollouts}" if regions else topics.rollouts,
        "payload_bytes": payload,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(parser)
    parser.add_argument("--rollouts", type=int, default=None, help="raw path: rollouts in the burst")
    parser.add_argument("--bytes", type=int, default=16384, help="raw path: bytes per rollout")
    parser.add_argument("--rate", type=float, default=None, help="raw path: steady rollouts/s")
    parser.add_argument("--seconds", type=float, default=None, help="steady phases' length (raw and ETL)")
    parser.add_argument("--groups", type=int, default=None, help="ETL path: groups of 2 in the burst")
    parser.add_argument("--group-rate", type=float, default=None, help="ETL path: steady groups/s")
    parser.add_argument("--tokens", type=int, default=None, help="ETL path: tokens per rollout")
    args = parser.parse_args()
    rollouts = args.rollouts or profile_default(args.profile, 300, 2000)
    rate = args.rate or profile_default(args.profile, 50.0, 100.0)
    seconds = args.seconds or profile_default(args.profile, 8.0, 30.0)
    groups = args.groups or profile_default(args.profile, 100, 1000)
    group_rate = args.group_rate or profile_default(args.profile, 10.0, 25.0)
    tokens = args.tokens or profile_default(args.profile, 1024, 4096)
    os.environ.setdefault("EMBER_MM2_OUT_TOPICS", PREFIX + r".*\.policy-versions")
    services.start("kafka")
    services.start_regions(REGIONS)
    central = kafka_bootstrap()
    regions = {r: services.region_bootstrap(r) for r in REGIONS}
    print(f"all clusters (central, {', '.join(REGIONS)}, MM2) and this process share one machine ({os.cpu_count()} cores), "
          f"load {os.getloadavg()[0]:.1f}")

    # The user's path first: produce in a region -> MM2 -> ETL -> a committed train batch.
    steady_groups = int(group_rate * seconds)
    etl = {}
    for phase, count, pace in (("burst", groups, None), ("steady", steady_groups, group_rate)):
        etl[("direct", phase)] = etl_path("direct", None, central, count, tokens, pace, 300)
        etl[("region", phase)] = etl_path("region", regions, central, count, tokens, pace, 300)
    eb, db = etl[("region", "burst")], etl[("direct", "burst")]
    es, ds = etl[("region", "steady")], etl[("direct", "steady")]
    print(f"ETL path, {groups} groups of {GROUP_SIZE} x {tokens} tokens as fast as acknowledged: region->mirror->ETL "
          f"{eb['rollouts_per_s']:.1f} rollouts/s, direct {db['rollouts_per_s']:.1f}/s "
          f"({eb['rollouts_per_s'] / db['rollouts_per_s']:.2f}x)")
    print(f"ETL path at {group_rate:g} groups/s for {seconds:g} s, send to batch committed: region p50 {es['p50_ms']:.0f} ms "
          f"p99 {es['p99_ms']:.0f} ms, direct p50 {ds['p50_ms']:.0f} ms p99 {ds['p99_ms']:.0f} ms; the ETL's replication "
          f"lag gauge (median of per-second maxima) {es['replication_lag_s']} s")
    etl_wan = topic_bytes(central, eb["rollout_topic"]) / eb["payload_bytes"]
    print(f"ETL path: mirrored rollout bytes in central per rollout byte {etl_wan:.3f}; a trainer's reader resolved "
          f"references to mirrored offsets at {eb['resolved_per_s']:.0f} rollouts/s (direct {db['resolved_per_s']:.0f}/s)")

    # The breakdown: the mirror alone (raw records, no ETL).
    region = regions["us"]
    tag = uuid.uuid4().hex[:8]
    steady = int(rate * seconds)
    results, mirrored = {}, []
    for phase, count, pace in (("burst", rollouts, None), ("steady", steady, rate)):
        mirror, direct = Topics(f"{PREFIX}bench-{tag}-{phase}"), Topics(f"{PREFIX}bench-direct-{tag}-{phase}")
        ensure_topics(region, [mirror.specs(2)["rollouts"]])
        ensure_topics(central, [direct.specs(2)["rollouts"]])
        mirrored.append(mirror.rollouts)
        results[("direct", phase)] = run_path("direct", central, direct.rollouts, direct.rollouts, central, count, args.bytes, pace)
        results[("mirror", phase)] = run_path(
            "mirror", region, mirror.rollouts, f"us.{mirror.rollouts}", central, count, args.bytes, pace
        )
    b, d0 = results[("mirror", "burst")], results[("direct", "burst")]
    print(f"mirror alone, {rollouts} x {args.bytes} B burst: {b['rollouts_per_s']:.0f} rollouts/s, direct "
          f"{d0['rollouts_per_s']:.0f}/s ({b['rollouts_per_s'] / d0['rollouts_per_s']:.2f}x)")
    m, d = results[("mirror", "steady")], results[("direct", "steady")]
    print(f"mirror alone at {rate:g}/s: p50 {m['p50_ms']:.0f} ms p99 {m['p99_ms']:.0f} ms, direct p50 {d['p50_ms']:.0f} ms "
          f"p99 {d['p99_ms']:.0f} ms; replication lag (p50 difference) {m['p50_ms'] - d['p50_ms']:.0f} ms")
    payload = (rollouts + steady) * args.bytes
    wan = sum(topic_bytes(central, f"us.{topic}") for topic in mirrored)
    fetched = sum(topic_bytes(region, topic) for topic in mirrored)
    print(f"mirror alone, bytes: mirrored into central {wan / payload:.3f} per payload byte, read from the region "
          f"{fetched / payload:.3f}")
    write_results(args.results, "regions", args.profile, [
        Figure("etl_rollouts_per_s", "rollouts/s", eb["rollouts_per_s"], db["rollouts_per_s"], "direct to central"),
        Figure("etl_latency_p50", "ms", es["p50_ms"], ds["p50_ms"], "direct to central", higher_is_better=False),
        Figure("etl_latency_p99", "ms", es["p99_ms"], ds["p99_ms"], "direct to central", higher_is_better=False),
        Figure("etl_replication_lag", "s", es["replication_lag_s"] or 0.0, higher_is_better=False),
        Figure("mirror_bytes_per_rollout_byte", "bytes/byte", etl_wan, higher_is_better=False),
        Figure("reader_resolved_per_s", "rollouts/s", eb["resolved_per_s"], db["resolved_per_s"], "direct to central"),
        Figure("mirror_rollouts_per_s", "rollouts/s", b["rollouts_per_s"], d0["rollouts_per_s"], "direct to central"),
    ], groups=groups, group_rate=group_rate, seconds=seconds, tokens=tokens, rollouts=rollouts, rate=rate, bytes=args.bytes)


if __name__ == "__main__":
    main()
