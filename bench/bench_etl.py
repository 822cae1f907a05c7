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

Timing never decides a test; medians over --repeats fresh topic sets.

    .venv/bin/python bench/bench_etl.py [--groups 12] [--repeats 3] [--latency-groups 20]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
import uuid

import numpy as np
from kafka import KafkaConsumer, TopicPartition

from ember.rollouts.config import EtlConfig, parse_config
from ember.rollouts.etl import EtlService, prepare_topics
from ember.rollouts.reader import RolloutBatchReader
from ember.rollouts.simulate import synthetic_reward, synthetic_rollout
from ember.rollouts.transport import RewardWriter, RolloutWriter, consumer_config

GROUP_SIZE = 8
TOKENS = 8192
LAYERS = 61


def etl_config(prefix: str) -> EtlConfig:
    return parse_config(
        {
            "kafka": {"topic_prefix": prefix, "partitions": 1, "group_id": f"{prefix}-etl"},
            "groups": {"size": GROUP_SIZE, "timeout_s": 600},
            "rewards": {"graders": ["unit-tests"], "timeout_s": 600},
            "filters": {"max_policy_lag": None, "max_tokens": TOKENS, "truncated": "keep"},
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

    def __init__(self, topic: str, expected: int):
        super().__init__(daemon=True)
        self.topic, self.expected = topic, expected
        self.seen: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        with RolloutBatchReader(self.topic, group_id=f"{self.topic}-trainer", idle_timeout_s=600) as reader:
            for read in reader:
                now = time.monotonic()
                for rid in read.batch.rollout_ids:
                    self.seen.setdefault(rid, now)
                reader.commit()
                if len(self.seen) >= self.expected:
                    break
        self.done.set()


def throughput_once(groups: int, seed: int) -> dict[str, float]:
    prefix = f"bench-etl-{uuid.uuid4().hex[:8]}"
    config = etl_config(prefix)
    topics = prepare_topics(config)
    rng = np.random.default_rng(seed)
    with RolloutWriter(prefix) as rollout_writer, RewardWriter(prefix) as reward_writer:
        for g in range(groups):
            rollouts, rewards = make_group(rng, prefix, g)
            for r in rollouts:
                rollout_writer.write(r)
            for r in rewards:
                reward_writer.write(r)
    input_bytes = rollout_writer.bytes + reward_writer.bytes
    n = groups * GROUP_SIZE

    plain = KafkaConsumer(**consumer_config(group_id=None))
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

    trainer = TrainerSide(topics.train_batches, n)
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


def latency_once(groups: int, interval_s: float, seed: int) -> list[float]:
    prefix = f"bench-etl-lat-{uuid.uuid4().hex[:8]}"
    config = etl_config(prefix)
    topics = prepare_topics(config)
    trainer = TrainerSide(topics.train_batches, groups * GROUP_SIZE)
    trainer.start()
    stop = threading.Event()
    etl = threading.Thread(target=EtlService(config, "bench-lat").run, args=(stop,), daemon=True)
    etl.start()
    time.sleep(3.0)  # joined the group and loaded its shard
    rng = np.random.default_rng(seed)
    last_reward: dict[str, float] = {}
    with RolloutWriter(prefix) as rollout_writer, RewardWriter(prefix) as reward_writer:
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
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    runs = [throughput_once(args.groups, seed) for seed in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ratios = [r["etl_mb_s"] / r["plain_mb_s"] for r in runs]
    print(f"throughput: {args.groups * GROUP_SIZE} rollouts x {TOKENS} tokens, median of {args.repeats}")
    print("| path | rollouts/s | tokens/s | MB/s |\n|---|---|---|---|")
    print(f"| ember ETL (validate, join, advantages, pack, transaction) -> trainer reader | {med['etl_rollouts_s']:.1f} | {med['etl_tokens_s']:,.0f} | {med['etl_mb_s']:.0f} |")
    print(f"| plain kafka-python consumer, no decode | {med['plain_rollouts_s']:.1f} | - | {med['plain_mb_s']:.0f} |")
    print(f"ETL / plain consumer (MB/s): median {statistics.median(ratios):.2f} (runs: {', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"rollout bytes per token on the wire: {med['bytes_per_token']:.1f}")

    latencies = latency_once(args.latency_groups, args.interval, seed=100)
    p50, p99 = np.percentile(latencies, [50, 99])
    print(f"latency last reward -> batch readable by the trainer over {len(latencies)} groups: "
          f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
