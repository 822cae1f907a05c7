"""Rollout ETL end to end through the real broker, vs a plain kafka-python consumer on the same topics.

Realistic records: 8192-token rollouts (prompt 512), groups of 8, routed experts 61 layers x top-8 of 256
uint8 (~4 MB per rollout on the wire), drawn as a router's are: distinct ids from a skewed per-layer
popularity (`simulate.distinct_top_k`), so they do not compress; one reward per rollout, 2 partitions. The
ETL runs as `ember rollouts etl` processes (1 or 2 in one consumer group); the trainer side is 1 or 2 "rank"
processes, each reading the by-reference batches and turning only its own share into tensors with
`rl_batch_share` (the rollouts fetched from the rollouts topic by `RolloutFetcher`, or with `--fetcher
confluent` by `RdkafkaRolloutFetcher`), as `midtrain rl` ranks do. The batch headers every rank reads
stand in for rank 0's broadcast.

- throughput: each repeat generates its input once (one group at a time) and publishes it to every
  configuration's fresh topics; then, per configuration, the plain consumer and the ETL run on it and its
  topics are deleted. Reported first: "e2e", counted from process start on both sides: from forking the
  ranks and starting the ETL processes (interpreter start, group join and shard load included) to the last
  rollout held as tensors, against `etl_plain_consumer.py` in its own process (read_committed, the ETL's
  fetch sizes and the fetcher's larger fetch and socket buffer) from its start to the last message. Then
  the breakdown: "steady" from the moment 10% of the rollouts were held to the last, against the plain
  consumer's own read window.
- bytes moved through the broker per byte of rollout published: what the ETL reads (every input
  message once), the train batches it writes, and what the trainer side uses (batch records once, as
  rank 0 does, plus each rank's rollouts; records a rank reads through to reach its share not counted).
- latency: groups published paced (8 rollouts, then their 8 rewards) while 1 ETL and 1 rank run;
  latency = time the rank held the group's rollouts as tensors - time the last reward was acknowledged.
- compression: `--compression none` (default, as ember writes rollouts) leaves the rollouts topic and
  writer uncompressed, `zstd` compresses both; `both` runs everything uncompressed plus 1 ETL x 1 rank with zstd.
- configurations: `--configs 1x1,2x1,2x2` picks the ETL processes x ranks to run (default all three;
  with `--profile`, 1x1 and 2x2).
- `--profile quick` (3 groups, ~100 MB, 3 paced groups, for `make bench`) or `full` (64 groups, ~2.1 GB), `--results FILE`
  writes the e2e figures (ember and the plain consumer from the same runs) for `make bench`.
- profiling: with $EMBER_BENCH_PY_SPY (a py-spy binary) and $EMBER_BENCH_PROFILE_DIR every ETL process
  and rank is recorded (raw collapsed stacks, idle frames included).
- security: `--security plaintext` (default) runs on the PLAINTEXT broker; `sasl_ssl` on the secured one
  (`ember dev up --secure`: TLS with the local CA, SCRAM-SHA-512, ACLs), every role as its own principal
  with ember's settings (`role_securities`): inference writes the rollouts, a grader the rewards, the ETL
  processes run as ember-etl, the ranks as ember-trainer (batch headers and rollouts), the plain consumer
  as ember-etl; the admin creates the topics and applies `role_bindings` (each rank's group bound as the
  trainer's). `both` runs every configuration on both brokers, same input, repeats interleaved, and
  prints SASL_SSL / PLAINTEXT.

Timing never decides a test; medians over --repeats fresh topic sets, configurations interleaved.

    .venv/bin/python bench/bench_etl.py [--profile quick|full] [--results FILE] [--groups N] [--repeats 3]
        [--latency-groups N] [--compression none|zstd|both] [--configs 1x1,2x1,2x2] [--fetcher kafka-python|confluent|both]
        [--security plaintext|sasl_ssl|both]
"""

from __future__ import annotations

import argparse
import json
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ember.dev import services  # noqa: E402
from ember.midtrain.rl.batch import rl_batch_share  # noqa: E402  (torch: imported once, before the ranks fork)
from ember.rollouts.acls import role_bindings  # noqa: E402
from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.rollouts.admin import apply_acls, delete_topics, ensure_topics  # noqa: E402
from ember.rollouts.config import kafka_bootstrap, parse_config  # noqa: E402
from ember.rollouts.etl import prepare_topics  # noqa: E402
from ember.rollouts.reader import FETCH_BYTES, SOCKET_BUFFER_BYTES  # noqa: E402
from ember.rollouts.security import KafkaSecurity, role_securities  # noqa: E402
from ember.rollouts.simulate import LARGE_VOCAB, synthetic_reward, synthetic_rollout  # noqa: E402
from ember.rollouts.topics import Topics  # noqa: E402
from ember.rollouts.transport import RewardWriter, RolloutWriter, consumer_config  # noqa: E402

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
    fetcher: str = "kafka-python"  # the ranks' RolloutFetcher: "kafka-python" or "confluent" (librdkafka)

    @property
    def config(self) -> str:
        return f"{self.etls} ETL x {self.ranks} rank{'s' if self.ranks > 1 else ''}, {self.compression}, {self.fetcher} fetcher"


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


def make_group(rng: np.random.Generator, name: str, g: int):
    rollouts = [
        synthetic_rollout(
            rng, group_id=f"{name}-g{g}", prompt_id=f"p{g}", num_tokens=TOKENS, layers=LAYERS,
            rollout_id=f"{name}-g{g}-{i}", finish_reason="stop",
        )
        for i in range(GROUP_SIZE)
    ]
    return rollouts, [synthetic_reward(rng, r) for r in rollouts]


def rank_main(broker: Broker, rank: int, ranks: int, prefix: str, expected: int, ready, results, fetcher_name: str) -> None:
    """One trainer rank: every batch header, its own share as tensors; reports when each rollout was held."""
    from ember.rollouts.reader import RdkafkaRolloutFetcher, RolloutBatchReader, RolloutFetcher
    from ember.schemas import decode_train_batch

    topics = Topics(prefix)
    held: dict[str, float] = {}
    batch_ids: set[str] = set()
    rollout_ids: set[str] = set()
    batch_bytes = tensor_bytes = 0
    security = broker.security("trainer")
    fetcher = {"kafka-python": RolloutFetcher, "confluent": RdkafkaRolloutFetcher}[fetcher_name](bootstrap=broker.bootstrap, security=security)
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
    """The rank processes, forked from this one (which holds no Kafka client then); `wait_ready` before a paced run."""

    def __init__(self, broker: Broker, prefix: str, ranks: int, expected: int, fetcher: str):
        ctx = mp.get_context("fork")
        self.results = ctx.Queue()
        self.ready = [ctx.Event() for _ in range(ranks)]
        self.procs = [
            ctx.Process(target=rank_main, args=(broker, r, ranks, prefix, expected, self.ready[r], self.results, fetcher), daemon=True)
            for r in range(ranks)
        ]
        for proc in self.procs:
            proc.start()
            record(proc.pid, "rank")

    def wait_ready(self) -> None:
        for event in self.ready:
            if not event.wait(timeout=300):
                raise RuntimeError("a trainer rank did not start within 300 s")

    def wait(self, timeout_s: float) -> list[dict]:
        found = [self.results.get(timeout=timeout_s) for _ in self.procs]
        for proc in self.procs:
            proc.join(timeout=30)
        return found


def record(pid: int, name: str) -> None:
    """With $EMBER_BENCH_PY_SPY (a py-spy binary) and $EMBER_BENCH_PROFILE_DIR, sample `pid` until it exits
    (raw collapsed stacks, idle frames included, so waits show as wall time)."""
    py_spy, out = os.environ.get("EMBER_BENCH_PY_SPY"), os.environ.get("EMBER_BENCH_PROFILE_DIR")
    if py_spy and out:
        subprocess.Popen([py_spy, "record", "--idle", "--format", "raw", "-r", "50", "--pid", str(pid), "-o",
                          f"{out}/{name}-{pid}.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_etls(config_path: Path, count: int) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "rollouts", "etl", str(config_path), "--instance", str(i), "--log-level", "WARNING"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        for i in range(count)
    ]
    for proc in procs:
        record(proc.pid, "etl")
    return procs


def stop_etls(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def plain_consumer(broker: Broker, topics: Topics) -> dict[str, float]:
    """The anchor, `etl_plain_consumer.py`, in its own process: read_committed, the ETL's fetch sizes and the
    fetcher's larger fetch and socket buffer (kafka-python's fastest documented settings for large messages)."""
    config = consumer_config(broker.security("etl"), bootstrap_servers=broker.bootstrap, group_id=None,
                             fetch_max_bytes=FETCH_BYTES, receive_buffer_bytes=SOCKET_BUFFER_BYTES)
    spec = {"config": config, "topics": [topics.rollouts, topics.rewards], "partitions": PARTITIONS}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO / "bench" / "etl_plain_consumer.py")], input=json.dumps(spec),
                          capture_output=True, text=True, check=True, timeout=1800)
    return {"seconds": time.perf_counter() - started, **json.loads(done.stdout)}


@dataclass
class TopicSet:
    """One run's fresh topics and config, and the writers that publish its input."""

    run: Run
    prefix: str
    topics: Topics
    config_path: Path
    rollout_writer: RolloutWriter
    reward_writer: RewardWriter

    @classmethod
    def create(cls, run: Run, workdir: Path) -> "TopicSet":
        prefix = f"bench-etl-{uuid.uuid4().hex[:8]}"
        topics, config_path = prepare(run.broker, prefix, run.compression, run.ranks, workdir)
        return cls(run, prefix, topics, config_path, *writers(run.broker, prefix, run.compression))

    @property
    def input_bytes(self) -> int:
        return self.rollout_writer.bytes + self.reward_writer.bytes

    def delete(self) -> None:
        """Every topic of the prefix: a full-size repeat leaves GBs on the broker's disk otherwise."""
        names = [spec.name for spec in self.topics.specs(PARTITIONS).values()]
        delete_topics(self.run.broker.bootstrap, names, self.run.broker.security("admin"))


def publish(sets: list[TopicSet], groups: int, seed: int) -> None:
    """The same groups (generated once, one at a time: nothing held) into every topic set of a repeat."""
    rng = np.random.default_rng(seed)
    for g in range(groups):
        rollouts, rewards = make_group(rng, f"s{seed}", g)
        for topic_set in sets:
            for r in rollouts:
                topic_set.rollout_writer.write(r)
            for r in rewards:
                topic_set.reward_writer.write(r)
    for topic_set in sets:
        topic_set.rollout_writer.close()
        topic_set.reward_writer.close()


def throughput_once(topic_set: TopicSet, groups: int) -> dict[str, float]:
    """The anchor, then the ETL processes and ranks on the same input, each timed from its processes' start."""
    run, prefix = topic_set.run, topic_set.prefix
    input_bytes = topic_set.input_bytes
    n = groups * GROUP_SIZE
    plain = plain_consumer(run.broker, topic_set.topics)
    if plain["bytes"] != input_bytes:
        raise RuntimeError(f"the plain consumer read {plain['bytes']} bytes of {input_bytes} published")

    started = time.time()
    trainer = Trainer(run.broker, prefix, run.ranks, n, run.fetcher)
    etls = start_etls(topic_set.config_path, run.etls)
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
        "input_mb": input_bytes / 1e6,
        "e2e_s": e2e_s,
        "e2e_rollouts_s": n / e2e_s,
        "e2e_mb_s": input_bytes / e2e_s / 1e6,
        "steady_rollouts_s": steady_rate,
        "steady_mb_s": input_bytes * steady_rate / n / 1e6,
        "plain_s": plain["seconds"],
        "plain_mb_s": input_bytes / plain["seconds"] / 1e6,
        "plain_window_mb_s": input_bytes / plain["window_s"] / 1e6,
        "moved_per_byte": moved / topic_set.rollout_writer.bytes,
        "batch_bytes_per_rollout": batch_bytes / n,
        "largest_rank_share": shares[-1] / sum(shares),
        "bytes_per_token": topic_set.rollout_writer.bytes_per_token,
    }


def repeat_once(runs: list[Run], groups: int, seed: int, workdir: Path) -> dict[Run, dict[str, float]]:
    """One repeat: every run's topic set gets the same input, then each run in turn, its topics deleted after."""
    sets = [TopicSet.create(run, workdir) for run in runs]
    try:
        publish(sets, groups, seed)
        return {topic_set.run: throughput_once(topic_set, groups) for topic_set in sets}
    finally:
        for topic_set in sets:
            topic_set.delete()


def latency_once(broker: Broker, groups: int, interval_s: float, seed: int, compression: str, workdir: Path, fetcher: str) -> list[float]:
    prefix = f"bench-etl-lat-{uuid.uuid4().hex[:8]}"
    topics, config_path = prepare(broker, prefix, compression, 1, workdir)
    n = groups * GROUP_SIZE
    trainer = Trainer(broker, prefix, 1, n, fetcher)
    trainer.wait_ready()
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
        delete_topics(broker.bootstrap, [spec.name for spec in topics.specs(PARTITIONS).values()], broker.security("admin"))
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
    parser.add_argument("--groups", type=int, default=None, help="groups of 8 per throughput run (quick 3, ~100 MB; full 64, ~2.1 GB; default 12)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-groups", type=int, default=None, help="paced groups in the latency run (quick 3, full 20, default 15)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between groups in the latency run")
    parser.add_argument("--compression", choices=["none", "zstd", "both"], default="none",
                        help="the rollouts topic and writer: uncompressed, zstd, or uncompressed plus the 1x1 case with zstd")
    parser.add_argument("--configs", type=shapes, default=None,
                        help="ETL processes x trainer ranks, comma-separated from 1x1, 2x1, 2x2 (default all three; with "
                             "--profile 1x1,2x2, the issue's two shapes; the scaling lines print for the pairs run)")
    parser.add_argument("--security", choices=list(BROKERS), default="plaintext",
                        help="the PLAINTEXT broker, the secured one (SASL_SSL, one principal per role), or both in one run")
    parser.add_argument("--fetcher", choices=["kafka-python", "confluent", "both"], default="kafka-python",
                        help="the ranks' rollout fetcher: kafka-python (RolloutFetcher), confluent-kafka (RdkafkaRolloutFetcher), "
                             "or both on the same input (the latency run uses the first)")
    add_flags(parser)
    args = parser.parse_args(argv)
    args.fetchers = ["kafka-python", "confluent"] if args.fetcher == "both" else [args.fetcher]
    args.groups = args.groups or profile_default(args.profile, 3, 64, 12)  # quick: 6 runs of ETL + ranks from process start
    args.latency_groups = args.latency_groups or profile_default(args.profile, 3, 20, 15)
    args.configs = args.configs or profile_default(args.profile, shapes("1x1,2x2"), shapes("1x1,2x2"), shapes(",".join(SHAPES)))
    if args.groups < 2:
        parser.error("--groups must be at least 2: a group is one batch, and the steady rate runs from one batch to a later one")
    return args


def runs_on(broker: Broker, compression: str, configs: list[tuple[int, int]], fetchers: list[str]) -> list[Run]:
    """Each ETL processes x ranks configuration with each fetcher (and with `both`, 1 x 1 on a zstd rollouts topic)."""
    setting = "zstd" if compression == "zstd" else "none"
    runs = [Run(broker, etls, ranks, setting, fetcher) for fetcher in fetchers for etls, ranks in configs]
    if compression == "both":
        runs.append(Run(broker, 1, 1, "zstd", fetchers[0]))
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
    plans = {broker: runs_on(broker, args.compression, args.configs, args.fetchers) for broker in brokers}
    results: dict[Run, list[dict[str, float]]] = {run: [] for runs in plans.values() for run in runs}
    latencies: dict[Broker, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.repeats):  # interleaved, so drift on a shared machine hits every configuration alike
            for runs in plans.values():
                for run, found in repeat_once(runs, args.groups, seed, Path(tmp)).items():
                    results[run].append(found)
                    print(f"repeat {seed}, {run.broker.name} {run.config}: e2e {found['e2e_s']:.1f} s, plain consumer "
                          f"{found['plain_s']:.1f} s ({found['plain_s'] / found['e2e_s']:.2f}x), {found['input_mb']:.0f} MB, "
                          f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        for broker in brokers:
            latencies[broker] = latency_once(broker, args.latency_groups, args.interval, 100, main_setting, Path(tmp), args.fetchers[0])

    n = args.groups * GROUP_SIZE
    input_mb = statistics.median(r["input_mb"] for rs in results.values() for r in rs)
    print(f"throughput: {n} rollouts x {TOKENS} tokens ({input_mb:,.0f} MB, {PARTITIONS} partitions), median of {args.repeats}; "
          f"cores: {os.cpu_count()}, load {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| broker | configuration | e2e s | plain consumer e2e s | **e2e / plain** | e2e MB/s | plain e2e MB/s | steady MB/s | plain window MB/s | steady / plain window | broker bytes per rollout byte |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    med: dict[Run, dict[str, float]] = {}
    figures: list[Figure] = []
    for run, rs in results.items():
        m = med[run] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        e2e = [r["plain_s"] / r["e2e_s"] for r in rs]
        steady = statistics.median(r["steady_mb_s"] / r["plain_window_mb_s"] for r in rs)
        print(f"| {run.broker.name} | {run.config} | {m['e2e_s']:.1f} | {m['plain_s']:.1f} | **{statistics.median(e2e):.2f}** "
              f"({', '.join(f'{x:.2f}' for x in e2e)}) | {m['e2e_mb_s']:.0f} | {m['plain_mb_s']:.0f} | {m['steady_mb_s']:.0f} | "
              f"{m['plain_window_mb_s']:.0f} | {steady:.2f} | {m['moved_per_byte']:.3f} |")
        figures.append(Figure(f"e2e input MB/s from process start, {run.config}, {run.broker.name}", "MB/s", m["e2e_mb_s"],
                              m["plain_mb_s"], "kafka-python KafkaConsumer, read_committed, from process start",
                              repeats=len(rs), target=0.5))
    write_results(args.results, "bench_etl", args.profile, figures, groups=args.groups, input_mb=input_mb,
                  compression=args.compression, runs={f"{run.broker.name} {run.config}": rs for run, rs in results.items()})
    percentiles = {broker: np.percentile(found, [50, 99]) for broker, found in latencies.items()}
    for broker, runs in plans.items():
        shaped = {(run.etls, run.ranks, run.compression): run for run in runs if run.fetcher == args.fetchers[0]}
        for run in runs:
            if run.fetcher != args.fetchers[0]:
                other = shaped[(run.etls, run.ranks, run.compression)]
                print(f"{broker.name}: {run.fetcher} / {other.fetcher} fetcher ({run.etls} ETL x {run.ranks} ranks), "
                      f"e2e {describe(ratios(results[other], results[run], 'e2e_mb_s'))}; "
                      f"steady {describe(ratios(results[other], results[run], 'steady_mb_s'))}")
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
                  f"e2e {describe(ratios(results[base], results[z], 'e2e_mb_s'))}; "
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
