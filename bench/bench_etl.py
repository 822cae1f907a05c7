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
- configurations: `--configs 1x1,2x1,2x2` (the default) picks the ETL processes x ranks to run.
- security: `--security plaintext` (default) runs on the PLAINTEXT broker; `sasl_ssl` on the secured one
  (`ember dev up --secure`: TLS with the local CA, SCRAM-SHA-512, ACLs), every role as its own principal
  with ember's settings (`role_securities`): inference writes the rollouts, a grader the rewards, the ETL
  processes run as ember-etl, the ranks as ember-trainer (batch headers and rollouts), the plain consumer
  as ember-etl; the admin creates the topics and applies `role_bindings` (each rank's group bound as the
  trainer's). `both` runs every configuration on both brokers, same input, repeats interleaved, and
  prints SASL_SSL / PLAINTEXT.

Timing never decides a test; medians over --repeats fresh topic sets, configurations interleaved.

    .venv/bin/python bench/bench_etl.py [--groups 12] [--repeats 3] [--latency-groups 15] [--compression none|zstd|both]
                                        [--configs 1x1,2x1,2x2] [--security plaintext|sasl_ssl|both]
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
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml
from kafka import KafkaConsumer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ember.dev import services  # noqa: E402
from ember.midtrain.rl.batch import rl_batch_share  # noqa: E402  (torch: imported once, before the ranks fork)
from ember.rollouts.acls import role_bindings  # noqa: E402
from ember.rollouts.admin import apply_acls, ensure_topics  # noqa: E402
from ember.rollouts.config import kafka_bootstrap, parse_config  # noqa: E402
from ember.rollouts.etl import prepare_topics  # noqa: E402
from ember.rollouts.security import KafkaSecurity, role_securities  # noqa: E402
from ember.rollouts.simulate import LARGE_VOCAB, synthetic_reward, synthetic_rollout  # noqa: E402
from ember.rollouts.topics import Topics  # noqa: E402
from ember.rollouts.transport import RewardWriter, RolloutWriter, consumer_config, topic_partitions  # noqa: E402

GROUP_SIZE = 8
TOKENS = 8192
LAYERS = 61
PARTITIONS = 2


@dataclass(frozen=True, eq=False)
class Broker:
    """Where a run goes and as whom each role connects (on PLAINTEXT every role is anonymous)."""

    name: str
    bootstrap: str
    roles: dict[str, KafkaSecurity] = field(default_factory=dict)

    def security(self, role: str) -> KafkaSecurity:
        return self.roles.get(role) or KafkaSecurity(security_protocol="PLAINTEXT")

    def kafka_section(self, role: str) -> dict:
        """The `kafka:` keys of an ETL config that connect as `role`."""
        return {"bootstrap": self.bootstrap, "security": self.security(role).model_dump(mode="json", exclude_none=True)}


def plaintext_broker() -> Broker:
    return Broker("PLAINTEXT", kafka_bootstrap())


def secured_broker() -> Broker:
    """The secured broker (started if it is not running), each role with its own principal."""
    services.start("kafka-secure")
    broker = services.secure_broker()
    return Broker("SASL_SSL", broker.bootstrap, role_securities(broker))


BROKERS = {"plaintext": [plaintext_broker], "sasl_ssl": [secured_broker], "both": [plaintext_broker, secured_broker]}


@dataclass(frozen=True)
class Run:
    broker: Broker
    etls: int
    ranks: int
    compression: str  # rollouts topic and writer: "zstd" or "none"

    @property
    def config(self) -> str:
        return f"{self.etls} ETL x {self.ranks} rank{'s' if self.ranks > 1 else ''}, {self.compression}"


def rank_group(prefix: str, rank: int) -> str:
    return f"{prefix}-rank{rank}"


def etl_settings(prefix: str, broker: Broker) -> dict:
    return {
        "kafka": {"topic_prefix": prefix, "partitions": PARTITIONS, "group_id": f"{prefix}-etl", **broker.kafka_section("etl"),
                  "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        "groups": {"size": GROUP_SIZE, "timeout_s": 600},
        "rewards": {"graders": ["unit-tests"], "timeout_s": 600},
        "filters": {"max_policy_lag": None, "max_tokens": TOKENS, "truncated": "keep", "vocab_size": LARGE_VOCAB},
        "batches": {"token_budget": GROUP_SIZE * TOKENS, "min_fill": 0.9, "max_wait_s": 1.0},
        "metrics": {"status_interval_s": 0},
    }


def prepare(broker: Broker, prefix: str, compression: str, ranks: int, workdir: Path) -> tuple[Topics, Path]:
    """Topics (the rollouts topic compressed as asked) created as the admin, on the secured broker the role
    ACLs applied (each rank's group as the trainer's), and the ETL config file."""
    settings = etl_settings(prefix, broker)
    config = parse_config(settings)
    admin = broker.security("admin")
    specs = config.kafka.topics.specs(PARTITIONS)
    rollouts = replace(specs["rollouts"], compression="zstd" if compression == "zstd" else "producer")
    ensure_topics(broker.bootstrap, [rollouts], admin)
    topics = prepare_topics(config.with_overrides(kafka=broker.kafka_section("admin")), create=True)
    if broker.roles:
        bindings = dict.fromkeys(b for r in range(ranks) for b in role_bindings(prefix, trainer_group=rank_group(prefix, r)))
        apply_acls(broker.bootstrap, list(bindings), admin)
    path = workdir / f"{prefix}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return topics, path


def writers(broker: Broker, prefix: str, compression: str) -> tuple[RolloutWriter, RewardWriter]:
    return (
        RolloutWriter(prefix, security=broker.security("inference"), bootstrap_servers=broker.bootstrap,
                      compression_type=None if compression == "none" else "zstd"),
        RewardWriter(prefix, security=broker.security("grader"), bootstrap_servers=broker.bootstrap),
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


def rank_main(broker: Broker, rank: int, ranks: int, prefix: str, expected: int, ready, results) -> None:
    """One trainer rank: every batch header, its own share as tensors; reports when each rollout was held."""
    from ember.rollouts.reader import RolloutBatchReader, RolloutFetcher
    from ember.schemas import decode_train_batch

    topics = Topics(prefix)
    held: dict[str, float] = {}
    batch_ids: set[str] = set()
    rollout_ids: set[str] = set()
    batch_bytes = tensor_bytes = 0
    security = broker.security("trainer")
    fetcher = RolloutFetcher(bootstrap=broker.bootstrap, security=security)
    with RolloutBatchReader(
        topics.train_batches, group_id=rank_group(prefix, rank), idle_timeout_s=None, bootstrap=broker.bootstrap, security=security,
    ) as reader:
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

    def __init__(self, broker: Broker, prefix: str, ranks: int, expected: int):
        ctx = mp.get_context("fork")
        self.results = ctx.Queue()
        self.ready = [ctx.Event() for _ in range(ranks)]
        self.procs = [
            ctx.Process(target=rank_main, args=(broker, r, ranks, prefix, expected, self.ready[r], self.results), daemon=True)
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


def plain_consumer_mb_s(broker: Broker, topics: Topics) -> tuple[float, int]:
    security = broker.security("etl")
    plain = KafkaConsumer(**consumer_config(security, bootstrap_servers=broker.bootstrap, group_id=None))
    tps = topic_partitions(plain, topics.rollouts, security) + topic_partitions(plain, topics.rewards, security)
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
    topics, config_path = prepare(run.broker, prefix, run.compression, run.ranks, workdir)
    rng = np.random.default_rng(seed)
    rollout_writer, reward_writer = writers(run.broker, prefix, run.compression)
    with rollout_writer, reward_writer:
        for g in range(groups):
            rollouts, rewards = make_group(rng, prefix, g)
            for r in rollouts:
                rollout_writer.write(r)
            for r in rewards:
                reward_writer.write(r)
    input_bytes = rollout_writer.bytes + reward_writer.bytes
    n = groups * GROUP_SIZE
    plain_mb_s, plain_bytes = plain_consumer_mb_s(run.broker, topics)
    if plain_bytes != input_bytes:
        raise RuntimeError(f"the plain consumer read {plain_bytes} bytes of {input_bytes} published")

    trainer = Trainer(run.broker, prefix, run.ranks, n)
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


def latency_once(broker: Broker, groups: int, interval_s: float, seed: int, compression: str, workdir: Path) -> list[float]:
    prefix = f"bench-etl-lat-{uuid.uuid4().hex[:8]}"
    _topics, config_path = prepare(broker, prefix, compression, 1, workdir)
    n = groups * GROUP_SIZE
    trainer = Trainer(broker, prefix, 1, n)
    etls = start_etls(config_path, 1)
    rng = np.random.default_rng(seed)
    last_reward: dict[str, float] = {}
    try:
        time.sleep(8.0)  # the ETL process started, joined its group and loaded its shards
        rollout_writer, reward_writer = writers(broker, prefix, compression)
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


SHAPES = {"1x1": (1, 1), "2x1": (2, 1), "2x2": (2, 2)}


def shapes(text: str) -> list[tuple[int, int]]:
    """`1x1,2x2` -> [(1, 1), (2, 2)]: ETL processes x trainer ranks."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown configuration {', '.join(map(repr, unknown))}; choose from {', '.join(SHAPES)}")
    return [SHAPES[name] for name in dict.fromkeys(names)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=12, help="groups of 8 per throughput run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-groups", type=int, default=15)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between groups in the latency run")
    parser.add_argument("--compression", choices=["none", "zstd", "both"], default="none",
                        help="the rollouts topic and writer: uncompressed, zstd, or uncompressed plus the 1x1 case with zstd")
    parser.add_argument("--configs", type=shapes, default=shapes(",".join(SHAPES)),
                        help="ETL processes x trainer ranks, comma-separated from 1x1, 2x1, 2x2 (default all three; "
                             "the scaling lines print for the pairs run)")
    parser.add_argument("--security", choices=list(BROKERS), default="plaintext",
                        help="the PLAINTEXT broker, the secured one (SASL_SSL, one principal per role), or both in one run")
    args = parser.parse_args(argv)
    if args.groups < 2:
        parser.error("--groups must be at least 2: a group is one batch, and the steady rate runs from one batch to a later one")
    return args


def runs_on(broker: Broker, compression: str, configs: list[tuple[int, int]]) -> list[Run]:
    """Each ETL processes x ranks configuration (and with `both`, 1 x 1 on a zstd rollouts topic)."""
    setting = "zstd" if compression == "zstd" else "none"
    runs = [Run(broker, etls, ranks, setting) for etls, ranks in configs]
    if compression == "both":
        runs.append(Run(broker, 1, 1, "zstd"))
    return runs


def ratios(base: list[dict[str, float]], other: list[dict[str, float]], key: str) -> list[float]:
    """other / base per repeat (both ran on the same seed, in the same repeat)."""
    return [b[key] / a[key] for a, b in zip(base, other)]


def describe(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}x (runs: {', '.join(f'{v:.2f}' for v in values)})"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    main_setting = "zstd" if args.compression == "zstd" else "none"
    brokers = [make() for make in BROKERS[args.security]]
    plans = {broker: runs_on(broker, args.compression, args.configs) for broker in brokers}
    results: dict[Run, list[dict[str, float]]] = {run: [] for runs in plans.values() for run in runs}
    latencies: dict[Broker, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.repeats):  # interleaved, so drift on a shared machine hits every configuration alike
            for run in results:
                results[run].append(throughput_once(run, args.groups, seed, Path(tmp)))
        for broker in brokers:
            latencies[broker] = latency_once(broker, args.latency_groups, args.interval, 100, main_setting, Path(tmp))

    n = args.groups * GROUP_SIZE
    print(f"throughput: {n} rollouts x {TOKENS} tokens ({PARTITIONS} partitions), median of {args.repeats}; cores: {os.cpu_count()}, load {os.getloadavg()[0]:.1f}")
    print("| broker | configuration | e2e rollouts/s | e2e MB/s | steady rollouts/s | steady MB/s | plain consumer MB/s | steady / plain | e2e / plain | broker bytes per rollout byte |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    med: dict[Run, dict[str, float]] = {}
    for run, rs in results.items():
        m = med[run] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        steady = statistics.median(r["steady_mb_s"] / r["plain_mb_s"] for r in rs)
        e2e = statistics.median(r["e2e_mb_s"] / r["plain_mb_s"] for r in rs)
        print(f"| {run.broker.name} | {run.config} | {m['e2e_rollouts_s']:.1f} | {m['e2e_mb_s']:.0f} | {m['steady_rollouts_s']:.1f} | {m['steady_mb_s']:.0f} | "
              f"{m['plain_mb_s']:.0f} | {steady:.2f} | {e2e:.2f} | {m['moved_per_byte']:.3f} |")
    percentiles = {broker: np.percentile(found, [50, 99]) for broker, found in latencies.items()}
    for broker, runs in plans.items():
        shaped = {(run.etls, run.ranks, run.compression): run for run in runs}
        base, two_etl, two_ranks = (shaped.get((etls, ranks, main_setting)) for etls, ranks in SHAPES.values())
        if base and two_etl:
            print(f"{broker.name}: 1 -> 2 ETL processes (1 rank), steady rollouts/s: "
                  f"{describe(ratios(results[base], results[two_etl], 'steady_rollouts_s'))}")
        if two_etl and two_ranks:
            print(f"{broker.name}: 1 -> 2 reader ranks (2 ETL), steady rollouts/s: "
                  f"{describe(ratios(results[two_etl], results[two_ranks], 'steady_rollouts_s'))}; "
                  f"largest rank's share of the tensor bytes with 2 ranks: {med[two_ranks]['largest_rank_share']:.2f}")
        print(f"{broker.name}: train-batch record: {med[runs[0]]['batch_bytes_per_rollout']:.0f} bytes per rollout (by reference); "
              f"rollout bytes per token on the wire: {med[runs[0]]['bytes_per_token']:.1f}")
        if args.compression == "both" and base:
            z = runs[-1]
            print(f"{broker.name}: zstd / none on the rollouts topic (1 ETL x 1 rank), steady rollouts/s: "
                  f"{describe(ratios(results[base], results[z], 'steady_rollouts_s'))}; "
                  f"plain consumer MB/s {med[z]['plain_mb_s'] / med[base]['plain_mb_s']:.2f}x")
        p50, p99 = percentiles[broker]
        print(f"{broker.name}: latency last reward -> tensors held by the rank over {len(latencies[broker])} groups "
              f"(max_wait_s 1, 1 ETL x 1 rank): p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {max(latencies[broker]) * 1000:.0f} ms")
    if len(brokers) == 2:
        plain, secure = brokers
        for base, other in zip(plans[plain], plans[secure]):
            print(f"SASL_SSL / PLAINTEXT, {base.config}: steady rollouts/s {describe(ratios(results[base], results[other], 'steady_rollouts_s'))}; "
                  f"e2e {describe(ratios(results[base], results[other], 'e2e_rollouts_s'))}; "
                  f"plain consumer MB/s {describe(ratios(results[base], results[other], 'plain_mb_s'))}")
        (p50, p99), (s50, s99) = percentiles[plain], percentiles[secure]
        print(f"SASL_SSL / PLAINTEXT, latency (1 ETL x 1 rank): p50 {s50 / p50:.2f}x, p99 {s99 / p99:.2f}x")


if __name__ == "__main__":
    main()
