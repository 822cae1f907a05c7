"""The product path (`source: product`) against the group path on the same broker, and what a pending
completion costs.

- throughput: N completions published first (product: served completions, each shown and accepted, keyed by
  completion id; group path, the anchor: the same N rollouts as groups of 8, one reward each), then one
  `ember rollouts etl` process runs with `--until-idle`; reported: completions/s from the process start
  (interpreter start, group join, shard load included, as a user would see) until the ledger accounts for all N.
  Every completion is acted on, so both paths batch all N: the same work. The product horizon is 50 ms of log
  time, so the measure is the path's cost, not its wait.
- memory per pending completion: P completions ingested in-process through the real engines, never due
  (product: an hour's horizon, spilled to SQLite; group path: groups of 8 that never fill), RSS growth / P,
  and the spill file's bytes / P.
- horizon to batch (live): 100 more completions published 20/s while the product ETL runs; each one's batch
  record time minus its horizon (its `shown` event's broker time + horizon_s), from LogAppendTime stamps.

Timing never decides a test. Medians over --repeats fresh topic sets, the two paths interleaved.

    .venv/bin/python bench/bench_product.py [--completions 2000] [--pending 20000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import yaml
from kafka import KafkaProducer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.rollouts.config import kafka_bootstrap, parse_config  # noqa: E402
from ember.rollouts.engine import InputMessage, ShardEngine  # noqa: E402
from ember.rollouts.etl import prepare_topics  # noqa: E402
from ember.rollouts.product.config import JoinLimits, ProductSettings  # noqa: E402
from ember.rollouts.product.events import EventKind, ProductEvent, ServedCompletion  # noqa: E402
from ember.rollouts.product.join import SERVED, Message, ProductJoin  # noqa: E402
from ember.rollouts.product.reward import RewardFunction  # noqa: E402
from ember.rollouts.product.store import PendingStore  # noqa: E402
from ember.rollouts.records import Outcome  # noqa: E402
from ember.rollouts.transport import producer_config  # noqa: E402
from ember.schemas import Reward, Rollout, encode  # noqa: E402
from tests.rollouts.etl_support import read_topic  # noqa: E402

TOKENS, VOCAB, GROUP = 256, 32_000, 8
HORIZON_S = 0.05
PACED = 100  # completions published 20/s while the product ETL runs, for the horizon-to-batch delay


def rollout(rng: np.random.Generator, cid: str, group: str) -> Rollout:
    mask = np.zeros(TOKENS, np.uint8)
    mask[TOKENS // 2:] = 1
    return Rollout(
        rollout_id=cid, group_id=group, prompt_id=group, policy_version=0, sampler="bench", region="r", created_at_us=0,
        tokens=rng.integers(0, VOCAB, TOKENS, dtype=np.uint32), loss_mask=mask,
        sampler_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
    )


def settings(prefix: str, source: str, state_dir: Path) -> dict:
    return {
        "source": source,
        "product": {"state_dir": str(state_dir), "reward": {"horizon_s": HORIZON_S, "unshown_horizon_s": HORIZON_S},
                    "baseline": {"min_history": 1}},
        "kafka": {"topic_prefix": prefix, "partitions": 2, "group_id": f"{prefix}-etl", "create_topics": True,
                  "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        "groups": {"size": GROUP, "timeout_s": 30},
        "rewards": {"graders": ["g"], "timeout_s": 30},
        "filters": {"vocab_size": VOCAB, "max_tokens": 4096, "max_policy_lag": None},
        "advantages": {"drop_zero_variance": False},
        "batches": {"token_budget": 16 * TOKENS, "min_fill": 0.9, "max_wait_s": 0.2},
        "metrics": {"status_interval_s": 0},
    }


def publish(source: str, topics, n: int, seed: int, *, name: str = "c", per_s: float | None = None) -> None:
    """n completions (ids name0, name1, ...), all at once or `per_s` a second."""
    rng = np.random.default_rng(seed)
    producer = KafkaProducer(**producer_config(None, bootstrap_servers=kafka_bootstrap(), linger_ms=0 if per_s else 20))
    started = time.monotonic()
    for i in range(n):
        if per_s:
            time.sleep(max(0.0, started + i / per_s - time.monotonic()))
        cid, group = f"{name}{i}", f"{name}g{i // GROUP}"
        if source == "product":
            served = ServedCompletion(rollout(rng, cid, cid), session_id="s", context_key=f"ctx{i % 4}", user_id=f"u{i % 50}")
            producer.send(topics.rollouts, key=cid.encode(), value=served.encode())
            for kind in (EventKind.SHOWN, EventKind.ACCEPTED):
                producer.send(topics.events, key=cid.encode(), value=ProductEvent(cid, kind).encode())
        else:
            producer.send(topics.rollouts, key=group.encode(), value=encode(rollout(rng, cid, group)))
            reward = Reward(cid, group, "g", float(rng.random()), 0)
            producer.send(topics.rewards, key=group.encode(), value=encode(reward))
    producer.flush()
    producer.close()


def accounted(topics) -> tuple[int, list[Outcome], list]:
    records = read_topic(topics.outcomes)
    outcomes = [Outcome.decode(r.value) for r in records]
    done = sum(len(o.detail["rollout_ids"]) for o in outcomes if o.kind == "batch")
    done += sum(1 for o in outcomes if o.kind == "rollout_dropped")
    return done, outcomes, records


def throughput_once(source: str, n: int, seed: int, workdir: Path) -> dict[str, float]:
    prefix = f"bench-product-{uuid.uuid4().hex[:8]}"
    data = settings(prefix, source, workdir / prefix)
    config = parse_config(data)
    topics = prepare_topics(config, create=True)
    publish(source, topics, n, seed)
    path = workdir / f"{prefix}.yaml"
    path.write_text(yaml.safe_dump(data))
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "rollouts", "etl", str(path), "--log-level", "WARNING"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        while (done := accounted(topics)[0]) < n:
            if proc.poll() is not None or time.perf_counter() - started > 600:
                raise RuntimeError(f"{source}: ETL exited ({proc.poll()}) or timed out with {done}/{n} accounted")
            time.sleep(0.5)
        seconds = time.perf_counter() - started
        result = {"completions_s": n / seconds}
        if source == "product":  # then a paced trickle while the ETL is up: its horizons pass live
            publish(source, topics, PACED, seed, name="h", per_s=PACED / 5)
            while accounted(topics)[0] < n + PACED and time.perf_counter() - started < 600:
                time.sleep(0.5)
            result.update(horizon_to_batch(topics, "h"))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return result


def horizon_to_batch(topics, name: str) -> dict[str, float]:
    shown = {}
    for record in read_topic(topics.events):
        event = ProductEvent.decode(record.value)
        if event.kind is EventKind.SHOWN:
            shown[event.completion_id] = record.timestamp
    delays = []
    for record in read_topic(topics.outcomes):
        outcome = Outcome.decode(record.value)
        if outcome.kind == "batch":
            delays += [(record.timestamp - shown[c]) / 1000 - HORIZON_S for c in outcome.detail["rollout_ids"] if c.startswith(name)]
    return {"horizon_to_batch_p50_s": float(np.median(delays)), "horizon_to_batch_p90_s": float(np.percentile(delays, 90))}


def memory_per_pending(count: int, workdir: Path) -> dict[str, float]:
    """RSS growth per pending completion: the product join (spilled) and the group engine (in RAM)."""
    rng = np.random.default_rng(0)
    process = psutil.Process()
    config = parse_config(settings("mem", "product", workdir / "mem"))
    join = ProductJoin(ProductSettings(reward=RewardFunction(horizon_s=3600, unshown_horizon_s=3600)), JoinLimits.of(config),
                       PendingStore(workdir / "mem.sqlite", durable=False))
    before = process.memory_info().rss
    for i in range(count):
        value = ServedCompletion(rollout(rng, f"p{i}", f"p{i}"), session_id="s", context_key="c", user_id="u").encode()
        join.ingest(SERVED, Message(i, i, f"p{i}".encode(), value))
        if i % 5000 == 4999:
            join.checkpoint()
    join.checkpoint()
    product_rss = (process.memory_info().rss - before) / count
    spilled = join.pending_count()
    disk = sum(f.stat().st_size for f in workdir.glob("mem.sqlite*")) / max(spilled, 1)
    waiting = config.with_overrides(groups={"timeout_s": 36_000}, rewards={"timeout_s": 36_000})  # full groups wait for rewards
    engine = ShardEngine(waiting, 0, config.kafka.topics)
    before = process.memory_info().rss
    for i in range(count):
        group = f"g{i // GROUP}"
        engine.ingest(InputMessage(config.kafka.topics.rollouts, 0, i, i, group.encode(), encode(rollout(rng, f"r{i}", group))))
    group_rss = (process.memory_info().rss - before) / count
    return {"product_rss_b": product_rss, "product_disk_b": disk, "spilled": spilled, "group_rss_b": group_rss}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=None, help="default: quick 200, full 2000")
    parser.add_argument("--pending", type=int, default=None, help="default: quick 2000, full 20000")
    parser.add_argument("--repeats", type=int, default=3)
    add_flags(parser)
    args = parser.parse_args(argv)
    args.completions = args.completions or profile_default(args.profile, 200, 2000)
    args.pending = args.pending or profile_default(args.profile, 2000, 20_000)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        runs: dict[str, list[dict[str, float]]] = {"groups": [], "product": []}
        for r in range(args.repeats):
            for source in ("groups", "product"):
                runs[source].append(throughput_once(source, args.completions, r, workdir))
        memory = memory_per_pending(args.pending, workdir)
    med = {s: statistics.median(x["completions_s"] for x in v) for s, v in runs.items()}
    ratio = statistics.median(p["completions_s"] / g["completions_s"] for p, g in zip(runs["product"], runs["groups"]))
    print(f"{args.completions} completions x {args.repeats} repeats, {TOKENS} tokens each, 1 ETL process, 2 partitions")
    print(f"  group path (anchor): {med['groups']:.0f} completions/s   product path: {med['product']:.0f} completions/s   "
          f"product/group: {ratio:.2f} (median of paired runs)")
    h50 = statistics.median(x["horizon_to_batch_p50_s"] for x in runs["product"])
    h90 = statistics.median(x["horizon_to_batch_p90_s"] for x in runs["product"])
    print(f"  horizon to batch record ({PACED} completions at {PACED // 5}/s, live): p50 {h50:.2f} s, p90 {h90:.2f} s")
    print(f"{args.pending} pending completions in-process ({memory['spilled']} spilled):")
    print(f"  product path: {memory['product_rss_b']:.0f} B resident (the 8 MiB page cache filling, spread over them) and "
          f"{memory['product_disk_b']:.0f} B on disk (spill file + WAL) per pending completion")
    print(f"  group path (anchor): {memory['group_rss_b']:.0f} B resident per pending rollout   "
          f"group/product resident: {memory['group_rss_b'] / max(memory['product_rss_b'], 1):.0f}x")
    write_results(args.results, "bench_product", args.profile, [
        Figure("completions/s from ETL process start", "completions/s", med["product"], med["groups"], "group path",
               repeats=args.repeats),
        Figure("resident bytes per pending completion", "B", memory["product_rss_b"], memory["group_rss_b"],
               "group path (in RAM)", higher_is_better=False),
    ], completions=args.completions, pending=args.pending, paired_ratio=ratio, horizon_to_batch_p50_s=h50,
        horizon_to_batch_p90_s=h90)


if __name__ == "__main__":
    main()
