"""Grading latency through the real broker: a rollout written -> its rewards committed, at a steady input rate.

`ember rollouts grade` runs as child processes (`--instances`, one consumer group) with two rule graders over
HumanEval (the canonical solutions as completions, tokenized with cl100k_base). Once the graders answer a
warm-up rollout, rollouts are written through the real producer at `--rate` per second for `--seconds`; each
write time is taken when the broker acknowledged it. A read_committed consumer of the rewards topic, started
before the first write, notes when each reward becomes visible: a rollout's latency is the time from its write
to its last grader's reward being readable, which is what the ETL's reward join sees. Reported: p50, p90, p99
and max over every rollout of the run (no window chosen after the fact), and the rate actually written.

Timing never decides a test.

    .venv/bin/python bench/bench_grader_latency.py [--rate 20] [--seconds 20] [--instances 1] [--partitions 4]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml
from kafka import KafkaConsumer, TopicPartition

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import Figure, add_flags, profile_default, write_results  # noqa: E402
from ember.rollouts.admin import ensure_topics  # noqa: E402
from ember.rollouts.config import kafka_bootstrap  # noqa: E402
from ember.rollouts.grading.tasks import load_tasks  # noqa: E402
from ember.rollouts.topics import Topics  # noqa: E402
from ember.rollouts.transport import RolloutWriter, consumer_config  # noqa: E402
from ember.schemas import decode_reward  # noqa: E402
from tests.rollouts.grading.support import GRADERS, code_rollout, fenced, fetch_humaneval  # noqa: E402

FIELDS = {"id": "id", "prompt": "prompt", "tests": "tests", "entry_point": "entry_point", "reference": "solution"}


class RewardWatcher(threading.Thread):
    """Notes when each (rollout, grader) reward becomes readable read_committed."""

    def __init__(self, topic: str):
        super().__init__(daemon=True)
        self.consumer = KafkaConsumer(**consumer_config(group_id=None))
        tps = [TopicPartition(topic, p) for p in sorted(self.consumer.partitions_for_topic(topic))]
        self.consumer.assign(tps)
        self.consumer.seek_to_end(*tps)
        for tp in tps:
            self.consumer.position(tp)  # resolve the end now, before anything is written
        self.seen: dict[tuple[str, str], float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for batch in self.consumer.poll(timeout_ms=50).values():
                now = time.time()
                for record in batch:
                    reward = decode_reward(record.value)
                    self.seen.setdefault((reward.rollout_id, reward.grader), now)
        self.consumer.close()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=20.0, help="rollouts written per second")
    parser.add_argument("--seconds", type=float, default=None, help="default: quick 6, full 20")
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--partitions", type=int, default=4)
    add_flags(parser)
    args = parser.parse_args()
    args.seconds = args.seconds or profile_default(args.profile, 6.0, 20.0)

    tmp = Path(tempfile.mkdtemp(prefix="bench-grader-"))
    tasks = list(load_tasks(fetch_humaneval(tmp), FIELDS).values())
    prefix = f"bench-grade-{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix)
    ensure_topics(kafka_bootstrap(), list(topics.specs(args.partitions).values()))
    config = tmp / "grade.yaml"
    config.write_text(yaml.safe_dump({
        "kafka": {"topic_prefix": prefix, "group_id": f"{prefix}-grader", "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        "tasks": {"path": str(tmp / "humaneval.jsonl")},
        "tokenizer": {"name": "cl100k_base"},
        "graders": GRADERS,
        "metrics": {"status_interval_s": 0},
    }))
    logs = [(tmp / f"grader-{i}.log").open("w") for i in range(args.instances)]
    procs = [
        subprocess.Popen([sys.executable, "-m", "ember.cli", "rollouts", "grade", str(config), "--instance", str(i)],
                         cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        for i, log in enumerate(logs)
    ]
    watcher = RewardWatcher(topics.rewards)
    watcher.start()
    written: dict[str, float] = {}
    try:
        with RolloutWriter(prefix) as writer:
            warm = code_rollout(tasks[0], fenced(tasks[0].reference), "warmup", 0)
            writer.write(warm).get(timeout=30)
            deadline = time.monotonic() + 120
            while not all((warm.rollout_id, g["name"]) in watcher.seen for g in GRADERS):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "graders did not answer the warm-up"
                time.sleep(0.1)
            total = int(args.rate * args.seconds)
            rollouts = [code_rollout(tasks[i % len(tasks)], fenced(tasks[i % len(tasks)].reference), f"b{i}", 0) for i in range(total)]
            start = time.monotonic()
            for i, rollout in enumerate(rollouts):
                time.sleep(max(0.0, start + i / args.rate - time.monotonic()))
                writer.write(rollout).get(timeout=30)
                written[rollout.rollout_id] = time.time()
            elapsed = time.monotonic() - start
        deadline = time.monotonic() + 120
        keys = [(rid, g["name"]) for rid in written for g in GRADERS]
        while not all(k in watcher.seen for k in keys):
            assert time.monotonic() < deadline, f"{sum(k in watcher.seen for k in keys)} of {len(keys)} rewards seen"
            time.sleep(0.2)
    finally:
        watcher.stop.set()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
        for log in logs:
            log.close()
    latencies = [max(watcher.seen[(rid, g["name"])] for g in GRADERS) - at for rid, at in written.items()]
    ms = [1000 * x for x in latencies]
    print(f"{len(written)} rollouts at {len(written) / elapsed:.1f}/s (asked {args.rate}/s), {args.instances} grader process(es), "
          f"{args.partitions} partitions, {len(GRADERS)} rule graders")
    print("| rollout written -> rewards committed | p50 | p90 | p99 | max | mean |")
    print("|---|---|---|---|---|---|")
    print(f"| ms | {quantile(ms, 0.5):.0f} | {quantile(ms, 0.9):.0f} | {quantile(ms, 0.99):.0f} | {max(ms):.0f} | {statistics.fmean(ms):.0f} |")
    write_results(args.results, "bench_grader_latency", args.profile, [
        Figure("rollout written -> rewards committed, p50", "ms", quantile(ms, 0.5), higher_is_better=False, repeats=len(ms)),
        Figure("rollout written -> rewards committed, p99", "ms", quantile(ms, 0.99), higher_is_better=False, repeats=len(ms)),
    ], rate=args.rate, seconds=args.seconds, instances=args.instances, partitions=args.partitions)


if __name__ == "__main__":
    main()
