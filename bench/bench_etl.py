"""Rollout ETL end to end through the real broker, vs a plain kafka-python consumer on the same topics.

Realistic records: 8192-token rollouts (prompt 512), groups of 8, routed experts 61 layers x top-8
uint8 (~4 MB per rollout on the wire), one reward per rollout. One ETL process (one partition), in
this process, with its transactions, snapshots and ledger, as `ember rollouts etl` runs it.

- throughput: the whole input is published first; then the ETL runs until a `read_committed`
  `RolloutBatchReader` (the trainer's side) has read every rollout in a batch. Reported: rollouts/s,
  tokens/s and input MB/s, next to a plain `KafkaConsumer` reading the same two topics from the
  beginning without decoding (the ceiling: Kafka's own fetch path in kafka-python). The ratio is the
  ETL's overhead.
- latency: groups are published paced (all 8 rollouts, then their 8 rewards) while the ETL runs;
  latency = time the trainer's reader got the batch - time the group's last reward was acknowledged.
- security: `--security both` runs everything on the PLAINTEXT broker and on the secured one
  (SASL_SSL, SCRAM-SHA-512, ACLs; `ember dev up` with EMBER_KAFKA_SECURITY=sasl_ssl), repeats
  interleaved, each role as its own principal (inference writes rollouts, grader rewards, the ETL as
  ember-etl, the trainer reads; the plain consumer reads as ember-etl), and prints SASL_SSL / PLAINTEXT.

Timing never decides a test; medians over --repeats fresh topic sets.

    .venv/bin/python bench/bench_etl.py [--groups 12] [--repeats 3] [--latency-groups 20] [--security plaintext|sasl_ssl|both]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
from kafka import KafkaConsumer, TopicPartition

from ember.dev import services
from ember.rollouts.acls import role_bindings
from ember.rollouts.admin import apply_acls
from ember.rollouts.config import EtlConfig, kafka_bootstrap, parse_config
from ember.rollouts.etl import EtlService, prepare_topics
from ember.rollouts.reader import RolloutBatchReader
from ember.rollouts.security import KafkaSecurity, role_securities
from ember.rollouts.simulate import SIMULATED_VOCAB, synthetic_reward, synthetic_rollout
from ember.rollouts.transport import RewardWriter, RolloutWriter, consumer_config

GROUP_SIZE = 8
TOKENS = 8192
LAYERS = 61


@dataclass(frozen=True)
class Broker:
    """Where the run goes and as whom each role connects (on PLAINTEXT, everyone is anonymous)."""

    name: str
    bootstrap: str
    roles: dict[str, KafkaSecurity] = field(default_factory=dict)

    def security(self, role: str) -> KafkaSecurity:
        return self.roles.get(role) or KafkaSecurity(security_protocol="PLAINTEXT")

    def kafka_section(self, role: str) -> dict:
        return {"bootstrap": self.bootstrap, "security": self.security(role).model_dump(mode="json", exclude_none=True)}


def plaintext_broker() -> Broker:
    return Broker("PLAINTEXT", kafka_bootstrap())


def secured_broker() -> Broker:
    services.start("kafka-secure")
    broker = services.secure_broker()
    roles = role_securities(broker)
    return Broker("SASL_SSL", broker.bootstrap, roles)


def prepare(broker: Broker, prefix: str, config: EtlConfig):
    """Topics created (and, when secured, the role ACLs applied) as the admin, as an operator would."""
    topics = prepare_topics(config.with_overrides(kafka=broker.kafka_section("admin")), create=True)
    if broker.roles:
        apply_acls(broker.bootstrap, role_bindings(prefix), broker.security("admin"))
    return topics


def writers(broker: Broker, prefix: str) -> tuple[RolloutWriter, RewardWriter]:
    return (
        RolloutWriter(prefix, security=broker.security("inference"), bootstrap_servers=broker.bootstrap),
        RewardWriter(prefix, security=broker.security("grader"), bootstrap_servers=broker.bootstrap),
    )


def etl_config(prefix: str, broker: Broker) -> EtlConfig:
    return parse_config(
        {
            "kafka": {"topic_prefix": prefix, "partitions": 1, "group_id": f"{prefix}-etl", **broker.kafka_section("etl")},
            "groups": {"size": GROUP_SIZE, "timeout_s": 600},
            "rewards": {"graders": ["unit-tests"], "timeout_s": 600},
            "filters": {"max_policy_lag": None, "max_tokens": TOKENS, "truncated": "keep", "vocab_size": SIMULATED_VOCAB},
            "batches": {"token_budget": GROUP_SIZE * TOKENS, "min_fill": 0.9, "max_wait_s": 1.0},
        }
    )


def make_group(rng: np.random.Generator, prefix: str, g: int):
    rollouts = [
        synthetic_rollout(
            rng, group_id=f"{prefix}-g{g}", prompt_id=f"p{g}", num_tokens=TOKENS, layers=LAYERS,
            rollout_id=f"{prefix}-g{g}-{i}", finish_reason="stop",
        )
        for i in range(GROUP_SIZE)
    ]
    return rollouts, [synthetic_reward(rng, r) for r in rollouts]


class TrainerSide(threading.Thread):
    """Reads batches read_committed as a trainer does, noting when each rollout became readable."""

    def __init__(self, broker: Broker, prefix: str, topic: str, expected: int):
        super().__init__(daemon=True)
        self.broker, self.prefix, self.topic, self.expected = broker, prefix, topic, expected
        self.seen: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        with RolloutBatchReader(
            self.topic, group_id=f"{self.prefix}-trainer", idle_timeout_s=600,
            bootstrap=self.broker.bootstrap, security=self.broker.security("trainer"),
        ) as reader:
            for read in reader:
                now = time.monotonic()
                for rid in read.batch.rollout_ids:
                    self.seen.setdefault(rid, now)
                reader.commit()
                if len(self.seen) >= self.expected:
                    break
        self.done.set()


def throughput_once(broker: Broker, groups: int, seed: int) -> dict[str, float]:
    prefix = f"bench-etl-{uuid.uuid4().hex[:8]}"
    config = etl_config(prefix, broker)
    topics = prepare(broker, prefix, config)
    rng = np.random.default_rng(seed)
    rollout_writer, reward_writer = writers(broker, prefix)
    with rollout_writer, reward_writer:
        for g in range(groups):
            rollouts, rewards = make_group(rng, prefix, g)
            for r in rollouts:
                rollout_writer.write(r)
            for r in rewards:
                reward_writer.write(r)
    input_bytes = rollout_writer.bytes + reward_writer.bytes
    n = groups * GROUP_SIZE

    plain = KafkaConsumer(**consumer_config(broker.security("etl"), bootstrap_servers=broker.bootstrap, group_id=None))
    tps = [TopicPartition(topics.rollouts, 0), TopicPartition(topics.rewards, 0)]
    plain.assign(tps)
    plain.seek_to_beginning(*tps)
    ends = plain.end_offsets(tps)
    started = time.perf_counter()
    got = 0
    while any(plain.position(tp) < ends[tp] for tp in tps):
        for batch in plain.poll(timeout_ms=500).values():
            got += sum(len(m.value) for m in batch)
    plain_s = time.perf_counter() - started
    plain.close()

    trainer = TrainerSide(broker, prefix, topics.train_batches, n)
    trainer.start()
    stop = threading.Event()
    service = EtlService(config, "bench")
    etl = threading.Thread(target=service.run, args=(stop,), daemon=True)
    started = time.monotonic()
    etl.start()
    if not trainer.done.wait(timeout=1800):
        raise RuntimeError(f"the trainer saw {len(trainer.seen)} of {n} rollouts")
    etl_s = max(trainer.seen.values()) - started
    stop.set()
    etl.join(timeout=60)
    return {
        "etl_rollouts_s": n / etl_s,
        "etl_tokens_s": n * TOKENS / etl_s,
        "etl_mb_s": input_bytes / etl_s / 1e6,
        "plain_rollouts_s": n / plain_s,
        "plain_mb_s": got / plain_s / 1e6,
        "bytes_per_token": rollout_writer.bytes_per_token,
    }


def latency_once(broker: Broker, groups: int, interval_s: float, seed: int) -> list[float]:
    prefix = f"bench-etl-lat-{uuid.uuid4().hex[:8]}"
    config = etl_config(prefix, broker)
    topics = prepare(broker, prefix, config)
    trainer = TrainerSide(broker, prefix, topics.train_batches, groups * GROUP_SIZE)
    trainer.start()
    stop = threading.Event()
    etl = threading.Thread(target=EtlService(config, "bench-lat").run, args=(stop,), daemon=True)
    etl.start()
    time.sleep(3.0)  # joined the group and loaded its shard
    rng = np.random.default_rng(seed)
    last_reward: dict[str, float] = {}
    rollout_writer, reward_writer = writers(broker, prefix)
    with rollout_writer, reward_writer:
        for g in range(groups):
            rollouts, rewards = make_group(rng, prefix, g)
            for r in rollouts:
                rollout_writer.write(r)
            rollout_writer.flush()
            for r in rewards:
                reward_writer.write(r)
            reward_writer.flush()
            last_reward[rollouts[0].group_id] = time.monotonic()
            time.sleep(interval_s)
    if not trainer.done.wait(timeout=600):
        raise RuntimeError(f"the trainer saw {len(trainer.seen)} of {groups * GROUP_SIZE} rollouts")
    stop.set()
    etl.join(timeout=60)
    return [trainer.seen[f"{group}-0"] - sent for group, sent in last_reward.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=12, help="groups of 8 per throughput run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-groups", type=int, default=20)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between groups in the latency run")
    parser.add_argument("--security", choices=["plaintext", "sasl_ssl", "both"], default="plaintext",
                        help="the PLAINTEXT broker, the secured one (SASL_SSL, role principals), or both in one run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    makers = {"plaintext": [plaintext_broker], "sasl_ssl": [secured_broker], "both": [plaintext_broker, secured_broker]}
    brokers = [make() for make in makers[args.security]]
    runs: dict[str, list[dict[str, float]]] = {b.name: [] for b in brokers}
    for seed in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
        for broker in brokers:
            runs[broker.name].append(throughput_once(broker, args.groups, seed))
    p99: dict[str, float] = {}
    med: dict[str, dict[str, float]] = {}
    print(f"throughput: {args.groups * GROUP_SIZE} rollouts x {TOKENS} tokens, median of {args.repeats}")
    print("| broker | path | rollouts/s | tokens/s | MB/s |\n|---|---|---|---|---|")
    for broker in brokers:
        rs = runs[broker.name]
        m = med[broker.name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| {broker.name} | ember ETL (validate, join, advantages, pack, transaction) -> trainer reader | {m['etl_rollouts_s']:.1f} | {m['etl_tokens_s']:,.0f} | {m['etl_mb_s']:.0f} |")
        print(f"| {broker.name} | plain kafka-python consumer, no decode | {m['plain_rollouts_s']:.1f} | - | {m['plain_mb_s']:.0f} |")
    for broker in brokers:
        rs = runs[broker.name]
        ratios = [r["etl_mb_s"] / r["plain_mb_s"] for r in rs]
        print(f"{broker.name}: ETL / plain consumer (MB/s): median {statistics.median(ratios):.2f} (runs: {', '.join(f'{r:.2f}' for r in ratios)}); "
              f"rollout bytes per token on the wire: {med[broker.name]['bytes_per_token']:.1f}")
    for broker in brokers:
        latencies = latency_once(broker, args.latency_groups, args.interval, seed=100)
        p50, p99[broker.name] = np.percentile(latencies, [50, 99])
        print(f"{broker.name}: latency last reward -> batch readable by the trainer over {len(latencies)} groups: "
              f"p50 {p50 * 1000:.0f} ms, p99 {p99[broker.name] * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")
    if len(brokers) == 2:
        plain, secure = med["PLAINTEXT"], med["SASL_SSL"]
        print(f"SASL_SSL / PLAINTEXT: ETL rollouts/s {secure['etl_rollouts_s'] / plain['etl_rollouts_s']:.2f}x, "
              f"plain consumer MB/s {secure['plain_mb_s'] / plain['plain_mb_s']:.2f}x, "
              f"latency p99 {p99['SASL_SSL'] / p99['PLAINTEXT']:.2f}x")


if __name__ == "__main__":
    main()
