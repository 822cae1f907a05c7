"""Rollout ETL end to end through the real broker, vs a plain kafka-python consumer on the same topics.

Realistic records: 8192-token rollouts (prompt 512), groups of 8, routed experts 61 layers x top-8
uint8 (~4 MB per rollout on the wire), one reward per rollout, 2 partitions. The ETL runs as
`ember rollouts etl` processes (1 or 2 in one consumer group); the trainer side is 1 or 2 "rank"
processes, each reading the by-reference batches and turning only its own share into tensors with
`rl_batch_share` (the rollouts fetched from the rollouts topic by `RolloutFetcher`), as `midtrain rl`
ranks do. The batch headers every rank reads stand in for rank 0's broadcast.

- throughput: the whole input is published first; then the ETL processes start and run until the
  ranks hold every rollout as tensors. Reported: "e2e" from starting the ETL processes (interpreter
  start, group join and shard load included) and "steady" from the moment 10% of the rollouts were
  held to the last, as rollouts/s and input MB/s, next to a plain `KafkaConsumer` reading the same
  topics from the beginning without decoding (kafka-python's own fetch path: the ceiling).
- bytes moved through the broker per byte of rollout published: what the ETL reads (every input
  message once), the train batches it writes, and what the trainer side reads (batch records once,
  as rank 0 does, plus each rank's rollouts).
- latency: groups published paced (8 rollouts, then their 8 rewards) while 1 ETL and 1 rank run;
  latency = time the rank held the group's rollouts as tensors - time the last reward was acknowledged.
- compression: `--compression zstd` makes the rollouts topic and writer zstd (ember's default),
  `none` sends them uncompressed; `both` runs everything uncompressed plus the 1-ETL 1-rank case with zstd.

Timing never decides a test; medians over --repeats fresh topic sets, configurations interleaved.

    .venv/bin/python bench/bench_etl.py [--groups 12] [--repeats 3] [--latency-groups 15] [--compression none|zstd|both]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import yaml
from kafka import KafkaConsumer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ember.midtrain.rl.batch import rl_batch_share  # noqa: E402  (torch: imported once, before the ranks fork)
from ember.rollouts.admin import ensure_topics  # noqa: E402
from ember.rollouts.config import kafka_bootstrap, parse_config  # noqa: E402
from ember.rollouts.etl import prepare_topics  # noqa: E402
from ember.rollouts.simulate import SIMULATED_VOCAB, synthetic_reward, synthetic_rollout  # noqa: E402
from ember.rollouts.topics import Topics  # noqa: E402
from ember.rollouts.transport import RewardWriter, RolloutWriter, consumer_config, topic_partitions  # noqa: E402

GROUP_SIZE = 8
TOKENS = 8192
LAYERS = 61
PARTITIONS = 2


@dataclass(frozen=True)
class Run:
    etls: int
    ranks: int
    compression: str  # rollouts topic and writer: "zstd" or "none"

    @property
    def name(self) -> str:
        return f"{self.etls} ETL x {self.ranks} rank{'s' if self.ranks > 1 else ''}, {self.compression}"


def etl_settings(prefix: str) -> dict:
    return {
        "kafka": {"topic_prefix": prefix, "partitions": PARTITIONS, "group_id": f"{prefix}-etl", "bootstrap": kafka_bootstrap(),
                  "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        "groups": {"size": GROUP_SIZE, "timeout_s": 600},
        "rewards": {"graders": ["unit-tests"], "timeout_s": 600},
        "filters": {"max_policy_lag": None, "max_tokens": TOKENS, "truncated": "keep", "vocab_size": SIMULATED_VOCAB},
        "batches": {"token_budget": GROUP_SIZE * TOKENS, "min_fill": 0.9, "max_wait_s": 1.0},
        "metrics": {"status_interval_s": 0},
    }


def prepare(prefix: str, compression: str, workdir: Path) -> tuple[Topics, Path]:
    """Topics (the rollouts topic compressed as asked) and the ETL config file."""
    settings = etl_settings(prefix)
    config = parse_config(settings)
    specs = config.kafka.topics.specs(PARTITIONS)
    rollouts = replace(specs["rollouts"], compression="zstd" if compression == "zstd" else "producer")
    ensure_topics(config.kafka.bootstrap, [rollouts])
    topics = prepare_topics(config, create=True)
    path = workdir / f"{prefix}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return topics, path


def writers(prefix: str, compression: str) -> tuple[RolloutWriter, RewardWriter]:
    return RolloutWriter(prefix, compression_type=None if compression == "none" else "zstd"), RewardWriter(prefix)


def make_group(rng: np.random.Generator, prefix: str, g: int):
    rollouts = [
        synthetic_rollout(
            rng, group_id=f"{prefix}-g{g}", prompt_id=f"p{g}", num_tokens=TOKENS, layers=LAYERS,
            rollout_id=f"{prefix}-g{g}-{i}", finish_reason="stop",
        )
        for i in range(GROUP_SIZE)
    ]
    return rollouts, [synthetic_reward(rng, r) for r in rollouts]


def rank_main(rank: int, ranks: int, prefix: str, expected: int, ready, results) -> None:
    """One trainer rank: every batch header, its own share as tensors; reports when each rollout was held."""
    from ember.rollouts.reader import RolloutBatchReader, RolloutFetcher
    from ember.schemas import decode_train_batch

    topics = Topics(prefix)
    held: dict[str, float] = {}
    batch_ids: set[str] = set()
    rollout_ids: set[str] = set()
    batch_bytes = tensor_bytes = 0
    fetcher = RolloutFetcher()
    with RolloutBatchReader(topics.train_batches, group_id=f"{prefix}-rank{rank}", idle_timeout_s=None) as reader:
        ready.set()
        while len(rollout_ids) < expected:
            raw = reader.next_message()
            header = decode_train_batch(raw.value)
            batch_ids.add(header.batch_id)
            rollout_ids.update(header.rollout_ids)
            batch_bytes += len(raw.value)
            share = rl_batch_share(raw.value, rank, ranks, fetch=fetcher.rollouts)
            now = time.time()
            tensor_bytes += share.decoded_bytes
            held.update((rid, now) for rid in share.rollout_ids)
    fetcher.close()
    results.put({"rank": rank, "held": held, "batch_bytes": batch_bytes, "fetched": fetcher.bytes, "tensor_bytes": tensor_bytes})


class Trainer:
    """The rank processes (forked from this one, which holds no Kafka client then), ready before the ETL starts."""

    def __init__(self, prefix: str, ranks: int, expected: int):
        ctx = mp.get_context("fork")
        self.results = ctx.Queue()
        self.ready = [ctx.Event() for _ in range(ranks)]
        self.procs = [
            ctx.Process(target=rank_main, args=(r, ranks, prefix, expected, self.ready[r], self.results), daemon=True)
            for r in range(ranks)
        ]
        for proc in self.procs:
            proc.start()
        for event in self.ready:
            if not event.wait(timeout=300):
                raise RuntimeError("a trainer rank did not start within 300 s")

    def wait(self, timeout_s: float) -> list[dict]:
        found = [self.results.get(timeout=timeout_s) for _ in self.procs]
        for proc in self.procs:
            proc.join(timeout=30)
        return found


def start_etls(config_path: Path, count: int) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return [
        subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "rollouts", "etl", str(config_path), "--instance", str(i), "--log-level", "WARNING"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        for i in range(count)
    ]


def stop_etls(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def plain_consumer_mb_s(topics: Topics) -> tuple[float, int]:
    plain = KafkaConsumer(**consumer_config(bootstrap_servers=kafka_bootstrap(), group_id=None))
    tps = topic_partitions(plain, topics.rollouts) + topic_partitions(plain, topics.rewards)
    plain.assign(tps)
    plain.seek_to_beginning(*tps)
    ends = plain.end_offsets(tps)
    started = time.perf_counter()
    got = 0
    while any(plain.position(tp) < ends[tp] for tp in tps):
        for batch in plain.poll(timeout_ms=500).values():
            got += sum(len(m.value) for m in batch)
    seconds = time.perf_counter() - started
    plain.close()
    return got / seconds / 1e6, got


def throughput_once(run: Run, groups: int, seed: int, workdir: Path) -> dict[str, float]:
    prefix = f"bench-etl-{uuid.uuid4().hex[:8]}"
    topics, config_path = prepare(prefix, run.compression, workdir)
    rng = np.random.default_rng(seed)
    rollout_writer, reward_writer = writers(prefix, run.compression)
    with rollout_writer, reward_writer:
        for g in range(groups):
            rollouts, rewards = make_group(rng, prefix, g)
            for r in rollouts:
                rollout_writer.write(r)
            for r in rewards:
                reward_writer.write(r)
    input_bytes = rollout_writer.bytes + reward_writer.bytes
    n = groups * GROUP_SIZE
    plain_mb_s, plain_bytes = plain_consumer_mb_s(topics)
    if plain_bytes != input_bytes:
        raise RuntimeError(f"the plain consumer read {plain_bytes} bytes of {input_bytes} published")

    trainer = Trainer(prefix, run.ranks, n)
    started = time.time()
    etls = start_etls(config_path, run.etls)
    try:
        found = trainer.wait(timeout_s=1800)
    finally:
        stop_etls(etls)
    held = {rid: t for r in found for rid, t in r["held"].items()}
    if len(held) != n:
        raise RuntimeError(f"the ranks held {len(held)} of {n} rollouts")
    times = sorted(held.values())
    tenth = n // 10
    e2e_s = times[-1] - started
    steady_s = times[-1] - times[tenth]
    steady_rate = (n - tenth - 1) / steady_s
    batch_bytes = found[0]["batch_bytes"]  # every rank read every header; a trainer reads them once, on rank 0
    moved = input_bytes + batch_bytes + batch_bytes + sum(r["fetched"] for r in found)
    shares = sorted(r["tensor_bytes"] for r in found)
    return {
        "e2e_rollouts_s": n / e2e_s,
        "e2e_mb_s": input_bytes / e2e_s / 1e6,
        "steady_rollouts_s": steady_rate,
        "steady_mb_s": input_bytes * steady_rate / n / 1e6,
        "plain_mb_s": plain_mb_s,
        "plain_rollouts_s": plain_mb_s * 1e6 * n / input_bytes,
        "moved_per_byte": moved / rollout_writer.bytes,
        "batch_bytes_per_rollout": batch_bytes / n,
        "largest_rank_share": shares[-1] / sum(shares),
        "bytes_per_token": rollout_writer.bytes_per_token,
    }


def latency_once(groups: int, interval_s: float, seed: int, compression: str, workdir: Path) -> list[float]:
    prefix = f"bench-etl-lat-{uuid.uuid4().hex[:8]}"
    _topics, config_path = prepare(prefix, compression, workdir)
    n = groups * GROUP_SIZE
    trainer = Trainer(prefix, 1, n)
    etls = start_etls(config_path, 1)
    rng = np.random.default_rng(seed)
    last_reward: dict[str, float] = {}
    try:
        time.sleep(8.0)  # the ETL process started, joined its group and loaded its shards
        rollout_writer, reward_writer = writers(prefix, compression)
        with rollout_writer, reward_writer:
            for g in range(groups):
                rollouts, rewards = make_group(rng, prefix, g)
                for r in rollouts:
                    rollout_writer.write(r)
                rollout_writer.flush()
                for r in rewards:
                    reward_writer.write(r)
                reward_writer.flush()
                last_reward[rollouts[0].group_id] = time.time()
                time.sleep(interval_s)
        (found,) = trainer.wait(timeout_s=600)
    finally:
        stop_etls(etls)
    return [max(found["held"][f"{group}-{i}"] for i in range(GROUP_SIZE)) - sent for group, sent in last_reward.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=12, help="groups of 8 per throughput run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-groups", type=int, default=15)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between groups in the latency run")
    parser.add_argument("--compression", choices=["none", "zstd", "both"], default="none",
                        help="the rollouts topic and writer: uncompressed, zstd, or uncompressed plus the 1x1 case with zstd")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    main_setting = "zstd" if args.compression == "zstd" else "none"
    runs = [Run(1, 1, main_setting), Run(2, 1, main_setting), Run(2, 2, main_setting)]
    if args.compression == "both":
        runs.append(Run(1, 1, "zstd"))
    results: dict[Run, list[dict[str, float]]] = {r: [] for r in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.repeats):  # interleaved, so drift on a shared machine hits every configuration alike
            for run in runs:
                results[run].append(throughput_once(run, args.groups, seed, Path(tmp)))
        latencies = latency_once(args.latency_groups, args.interval, 100, main_setting, Path(tmp))

    n = args.groups * GROUP_SIZE
    print(f"throughput: {n} rollouts x {TOKENS} tokens ({PARTITIONS} partitions), median of {args.repeats}; cores: {os.cpu_count()}, load {os.getloadavg()[0]:.1f}")
    print("| configuration | e2e rollouts/s | e2e MB/s | steady rollouts/s | steady MB/s | plain consumer MB/s | steady / plain | e2e / plain | broker bytes per rollout byte |")
    print("|---|---|---|---|---|---|---|---|---|")
    med: dict[Run, dict[str, float]] = {}
    for run, rs in results.items():
        m = med[run] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        steady = statistics.median(r["steady_mb_s"] / r["plain_mb_s"] for r in rs)
        e2e = statistics.median(r["e2e_mb_s"] / r["plain_mb_s"] for r in rs)
        print(f"| {run.name} | {m['e2e_rollouts_s']:.1f} | {m['e2e_mb_s']:.0f} | {m['steady_rollouts_s']:.1f} | {m['steady_mb_s']:.0f} | "
              f"{m['plain_mb_s']:.0f} | {steady:.2f} | {e2e:.2f} | {m['moved_per_byte']:.3f} |")
    base, two_etl, two_ranks = runs[0], runs[1], runs[2]
    scale = [b["steady_rollouts_s"] / a["steady_rollouts_s"] for a, b in zip(results[base], results[two_etl])]
    ranks = [b["steady_rollouts_s"] / a["steady_rollouts_s"] for a, b in zip(results[two_etl], results[two_ranks])]
    print(f"1 -> 2 ETL processes (1 rank), steady rollouts/s: median {statistics.median(scale):.2f}x (runs: {', '.join(f'{s:.2f}' for s in scale)})")
    print(f"1 -> 2 reader ranks (2 ETL), steady rollouts/s: median {statistics.median(ranks):.2f}x (runs: {', '.join(f'{s:.2f}' for s in ranks)}); "
          f"largest rank's share of the tensor bytes with 2 ranks: {med[two_ranks]['largest_rank_share']:.2f}")
    print(f"train-batch record: {med[base]['batch_bytes_per_rollout']:.0f} bytes per rollout (by reference); "
          f"rollout bytes per token on the wire: {med[base]['bytes_per_token']:.1f}")
    if args.compression == "both":
        z = runs[3]
        ratio = [b["steady_rollouts_s"] / a["steady_rollouts_s"] for a, b in zip(results[base], results[z])]
        print(f"zstd / none on the rollouts topic (1 ETL x 1 rank), steady rollouts/s: median {statistics.median(ratio):.2f}x; "
              f"plain consumer MB/s {med[z]['plain_mb_s'] / med[base]['plain_mb_s']:.2f}x")
    p50, p99 = np.percentile(latencies, [50, 99])
    print(f"latency last reward -> tensors held by the rank over {len(latencies)} groups (max_wait_s 1, 1 ETL x 1 rank): "
          f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
