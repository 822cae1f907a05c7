"""`ember demo`: the main job on embedded defaults, end to end on a small real input.

Today it brings the local services up, publishes simulated rollouts and their rewards through the
real Kafka broker with the wire codec, reads them back `read_committed`, checks every record, shows
that a malformed message is reported rather than crashing the reader, and runs a Slurm job.
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from rich.console import Console
from rich.table import Table

from ember.dev import services
from ember.rollouts.simulate import synthetic_reward, synthetic_rollout
from ember.rollouts.topics import default_topics, ensure_topics
from ember.rollouts.transport import (
    BadMessage,
    RecordWriter,
    consumer_config,
    kafka_bootstrap,
    producer_config,
    read_messages,
)
from ember.schemas import Reward, Rollout

DEMO_PREFIX = "ember-demo"


def _fingerprint(record: Rollout | Reward) -> str:
    digest = hashlib.blake2b(digest_size=16)
    if isinstance(record, Rollout):
        for array in (record.tokens, record.loss_mask, record.sampler_logprobs, record.routed_experts):
            if array is not None:
                digest.update(np.ascontiguousarray(array).tobytes())
        digest.update(f"{record.policy_version}/{record.turns}".encode())
    else:
        digest.update(f"{record.score!r}/{sorted(record.components.items())}".encode())
    return f"{type(record).__name__}:{getattr(record, 'rollout_id')}:{digest.hexdigest()}"


def _end_offsets(topics: list[str]) -> dict[TopicPartition, int]:
    consumer = KafkaConsumer(**consumer_config(group_id=None))
    try:
        partitions = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or [])]
        return consumer.end_offsets(partitions)
    finally:
        consumer.close()


def _slurm_smoke(console: Console) -> str:
    with tempfile.TemporaryDirectory(prefix="ember-demo-slurm-") as tmp:
        out = Path(tmp) / "job.out"
        subprocess.run(
            ["sbatch", "--wait", "--job-name=ember-demo", f"--output={out}", "--wrap", "echo ember-demo on $(hostname)"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return out.read_text().strip()


def run_demo(console: Console, *, rollouts: int, group_size: int, tokens: int, layers: int) -> int:
    for service in services.SERVICES:
        with console.status(f"bringing up {service}..."):
            try:
                services.start(service)
            except services.ServiceError as exc:
                if service == "flink":
                    console.print(f"[yellow]flink job-server jar unavailable:[/yellow] {str(exc).splitlines()[-1]}")
                    continue
                console.print(f"[red]{exc}[/red]")
                return 1

    topics = default_topics(DEMO_PREFIX)
    ensure_topics(kafka_bootstrap(), list(topics.values()))
    names = [topics["rollouts"].name, topics["rewards"].name]
    start_offsets = _end_offsets(names)

    rng = np.random.default_rng(int(time.time()))
    sent: set[str] = set()
    started = time.perf_counter()
    with console.status(f"publishing {rollouts} rollouts and rewards..."):
        with RecordWriter(names[0]) as rollout_writer, RecordWriter(names[1]) as reward_writer:
            for i in range(rollouts):
                group = f"demo-{time.time_ns()}-{i // group_size}"
                rollout = synthetic_rollout(
                    rng, group_id=group, prompt_id=f"prompt-{i // group_size}", num_tokens=tokens, layers=layers or None
                )
                reward = synthetic_reward(rng, rollout)
                rollout_writer.write(rollout)
                reward_writer.write(reward)
                sent.add(_fingerprint(rollout))
                sent.add(_fingerprint(reward))
        poison = KafkaProducer(**producer_config())
        poison.send(names[0], key=b"demo-poison", value=b"EMBR\x01\x01 this is not a rollout")
        poison.flush()
        poison.close()
    publish_s = time.perf_counter() - started

    end_offsets = _end_offsets(names)
    expected = sum(end_offsets[tp] - start_offsets.get(tp, 0) for tp in end_offsets)
    consumer = KafkaConsumer(**consumer_config(group_id=None))
    consumer.assign(list(end_offsets))
    for tp in end_offsets:
        consumer.seek(tp, start_offsets.get(tp, 0))
    received: set[str] = set()
    bad: list[BadMessage] = []
    started = time.perf_counter()
    with console.status("consuming read_committed and checking every record..."):
        for item in read_messages(consumer, limit=expected, idle_timeout_s=15):
            if isinstance(item, BadMessage):
                bad.append(item)
            else:
                received.add(_fingerprint(item.record))
    consume_s = time.perf_counter() - started
    consumer.close()

    slurm_output = _slurm_smoke(console)

    wire_bytes = rollout_writer.bytes
    table = Table("stage", "result", title="ember demo")
    table.add_row("kafka", kafka_bootstrap())
    table.add_row("rollouts published", f"{rollout_writer.records} ({wire_bytes / 1e6:.1f} MB, {publish_s:.1f}s)")
    table.add_row("wire bytes / token", f"{wire_bytes / (rollouts * tokens):.1f} (routed experts: {layers} layers x top-8)")
    table.add_row("rewards published", str(reward_writer.records))
    table.add_row("records read back equal", f"{len(received & sent)} / {len(sent)} in {consume_s:.1f}s")
    table.add_row("malformed messages reported", "; ".join(str(b) for b in bad) or "none")
    table.add_row("slurm job", slurm_output)
    console.print(table)
    ok = received == sent and len(bad) == 1
    console.print("[green]demo OK[/green]" if ok else "[red]demo FAILED: records lost, changed or doubled[/red]")
    return 0 if ok else 1
