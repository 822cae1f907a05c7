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

All clusters (central, the regions, MM2) and this process share one machine: the numbers say what the mirror costs
here, not what a WAN would.

    .venv/bin/python bench/bench_regions.py [--rollouts 2000] [--bytes 16384] [--rate 100] [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import threading
import time
import uuid

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from ember.dev import services
from ember.rollouts.admin import ensure_topics
from ember.rollouts.config import kafka_bootstrap
from ember.rollouts.topics import Topics

REGIONS = ["us", "eu"]
PREFIX = "regions-"  # the tests' prefix family: the same MM2 config, so a running MM2 is not restarted


class Reader(threading.Thread):
    """Reads a central topic read_committed from the start; keeps (send time, read time) per rollout."""

    def __init__(self, bootstrap: str, topic: str, expected: int):
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.expected = bootstrap, topic, expected
        self.times: list[tuple[float, float]] = []
        self.ready = threading.Event()

    def run(self) -> None:
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, isolation_level="read_committed", fetch_max_wait_ms=50)
        deadline = time.monotonic() + 300
        while not consumer.partitions_for_topic(self.topic):
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.topic} never appeared in central")
            time.sleep(0.2)
            consumer.close()
            consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, isolation_level="read_committed", fetch_max_wait_ms=50)
        tps = [TopicPartition(self.topic, p) for p in consumer.partitions_for_topic(self.topic)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        self.ready.set()
        while len(self.times) < self.expected and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                now = time.time()
                self.times += [(struct.unpack_from("<d", r.value)[0], now) for r in batch]
        consumer.close()


def send(bootstrap: str, topic: str, count: int, size: int, rate: float | None) -> float:
    """Sends `count` rollouts stamped with their send time; paced at `rate`/s when given. Returns the first send time.
    Random bytes: token ids compress little, and a repeated pad would let zstd make the mirror look free."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", linger_ms=5, max_request_size=8 << 20)
    start = time.time()
    for i in range(count):
        if rate:
            time.sleep(max(0.0, start + i / rate - time.time()))
        producer.send(topic, key=str(i).encode(), value=struct.pack("<d", time.time()) + os.urandom(size - 8))
    producer.flush()
    producer.close()
    return start


def run_path(name: str, produce_to: str, topic: str, read_topic: str, central: str, count: int, size: int, rate: float | None) -> dict:
    reader = Reader(central, read_topic, count)
    reader.start()
    start = send(produce_to, topic, count, size, rate)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--bytes", type=int, default=16384)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    os.environ.setdefault("EMBER_MM2_OUT_TOPICS", PREFIX + r".*\.policy-versions")
    services.start("kafka")
    services.start_regions(REGIONS)
    central, region = kafka_bootstrap(), services.region_bootstrap("us")
    tag = uuid.uuid4().hex[:8]
    steady = int(args.rate * args.seconds)
    print(f"{args.rollouts} rollouts x {args.bytes} B burst, then {steady} at {args.rate:g}/s; all clusters on one machine")
    results, mirrored = {}, []
    for phase, count, rate in (("burst", args.rollouts, None), ("steady", steady, args.rate)):
        mirror, direct = Topics(f"{PREFIX}bench-{tag}-{phase}"), Topics(f"{PREFIX}bench-direct-{tag}-{phase}")
        ensure_topics(region, [mirror.specs(2)["rollouts"]])
        ensure_topics(central, [direct.specs(2)["rollouts"]])
        mirrored.append(mirror.rollouts)
        results[("direct", phase)] = run_path("direct", central, direct.rollouts, direct.rollouts, central, count, args.bytes, rate)
        results[("mirror", phase)] = run_path(
            "mirror", region, mirror.rollouts, f"us.{mirror.rollouts}", central, count, args.bytes, rate
        )
    b, s = results[("mirror", "burst")], results[("direct", "burst")]
    print(f"throughput  mirror {b['rollouts_per_s']:.0f} rollouts/s  direct {s['rollouts_per_s']:.0f}/s  "
          f"mirror/direct {b['rollouts_per_s'] / s['rollouts_per_s']:.2f}")
    m, d = results[("mirror", "steady")], results[("direct", "steady")]
    print(f"latency at {args.rate:g}/s  mirror p50 {m['p50_ms']:.0f} ms p99 {m['p99_ms']:.0f} ms  "
          f"direct p50 {d['p50_ms']:.0f} ms p99 {d['p99_ms']:.0f} ms  replication lag (p50 difference) "
          f"{m['p50_ms'] - d['p50_ms']:.0f} ms")
    payload = (args.rollouts + steady) * args.bytes
    wan = sum(topic_bytes(central, f"us.{topic}") for topic in mirrored)
    fetched = sum(topic_bytes(region, topic) for topic in mirrored)
    print(f"bytes: mirrored into central {wan / payload:.3f} per payload byte, read from the region {fetched / payload:.3f}")


if __name__ == "__main__":
    main()
