"""`ember demo`: the main job on embedded defaults, end to end on a small real input.

Stages, in the order the system runs them: bring the local services up; check the Kafka wire codec
through the real broker (and that a malformed message is reported, not fatal); build a small mixed
code + web corpus with Beam (filters, redaction, exact + near dedup); tokenize and best-fit pack it
into verified Arrow shards; run a few Megatron-core MoE mid-training steps on those shards; stream
simulated RL rollouts and late rewards through the rollout ETL into training batches that a trainer
reads; run RL steps with router replay on rollouts a reference sampler produced, printing the
trainer/sampler mismatch; and run a job on the local Slurm. Each stage contributes rows to one summary table; the demo
fails when a stage raises or a stage's own check (records equal, books balance, shards verify) fails.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

import numpy as np
from kafka import KafkaConsumer, KafkaProducer
from rich.console import Console
from rich.table import Table

from ember.dev import services
from ember.rollouts.simulate import synthetic_reward, synthetic_rollout
from ember.rollouts.topics import default_topics, ensure_topics
from ember.rollouts.transport import (
    BadMessage,
    RewardWriter,
    RolloutWriter,
    consumer_config,
    end_offsets,
    kafka_bootstrap,
    producer_config,
    read_messages,
)
from ember.schemas import Reward, Rollout

DEMO_PREFIX = "ember-demo"
Rows = list[tuple[str, str]]

VERDICTS: dict[str, Callable[[str], bool]] = {
    "records read back equal": lambda v: v.split(" ")[0] == v.split(" ")[2],
    "malformed message reported": lambda v: v.count("@") == 1,
    "corpus accounted (in = kept + rejected)": lambda v: v == "yes",
    "verify": lambda v: v == "OK",
    "books balance": lambda v: v.startswith("yes"),
}


def _fingerprint(record: Rollout | Reward) -> str:
    digest = hashlib.blake2b(digest_size=16)
    if isinstance(record, Rollout):
        for array in (record.tokens, record.loss_mask, record.sampler_logprobs, record.routed_experts):
            if array is not None:
                digest.update(np.ascontiguousarray(array).tobytes())
        digest.update(f"{record.policy_version}/{record.turns}".encode())
    else:
        digest.update(f"{record.score!r}/{sorted(record.components.items())}".encode())
    return f"{type(record).__name__}:{record.rollout_id}:{digest.hexdigest()}"


def wire_stage(console: Console, *, rollouts: int, group_size: int, tokens: int, layers: int) -> Rows:
    """Rollouts and rewards through the broker with the codec; every record must come back equal."""
    topics = default_topics(DEMO_PREFIX)
    ensure_topics(kafka_bootstrap(), list(topics.values()))
    names = [topics["rollouts"].name, topics["rewards"].name]
    start_offsets = end_offsets(names)
    rng = np.random.default_rng(int(time.time()))
    sent: set[str] = set()
    started = time.perf_counter()
    with console.status(f"wire: publishing {rollouts} rollouts and rewards..."):
        with RolloutWriter(DEMO_PREFIX) as rollout_writer, RewardWriter(DEMO_PREFIX) as reward_writer:
            for i in range(rollouts):
                rollout = synthetic_rollout(
                    rng,
                    group_id=f"demo-{time.time_ns()}-{i // group_size}",
                    prompt_id=f"prompt-{i // group_size}",
                    num_tokens=tokens,
                    layers=layers or None,
                )
                reward = synthetic_reward(rng, rollout)
                rollout_writer.write(rollout)
                reward_writer.write(reward)
                sent |= {_fingerprint(rollout), _fingerprint(reward)}
        poison = KafkaProducer(**producer_config())
        poison.send(names[0], key=b"demo-poison", value=b"EMBR\x01\x01 this is not a rollout")
        poison.flush()
        poison.close()
    publish_s = time.perf_counter() - started

    stop_offsets = end_offsets(names)
    expected = sum(stop_offsets[tp] - start_offsets.get(tp, 0) for tp in stop_offsets)
    consumer = KafkaConsumer(**consumer_config(group_id=None))
    consumer.assign(list(stop_offsets))
    for tp in stop_offsets:
        consumer.seek(tp, start_offsets.get(tp, 0))
    received: list[str] = []
    bad: list[BadMessage] = []
    with console.status("wire: consuming read_committed and checking every record..."):
        for item in read_messages(consumer, limit=expected, idle_timeout_s=15):
            if isinstance(item, BadMessage):
                bad.append(item)
            else:
                received.append(_fingerprint(item.record))
    consumer.close()
    equal = len(sent & set(received)) if len(received) == len(set(received)) else 0
    return [
        ("kafka", f"{kafka_bootstrap()}: {expected} messages this run"),
        ("rollouts published", f"{rollout_writer.records} ({rollout_writer.bytes / 1e6:.1f} MB, {publish_s:.1f}s)"),
        ("wire bytes / token", f"{rollout_writer.bytes_per_token:.1f} (routed experts {layers} layers x top-8)"),
        ("rewards published", str(reward_writer.records)),
        ("records read back equal", f"{equal} / {len(sent)}"),
        ("malformed message reported", "; ".join(str(b)[:100] for b in bad) or "NOT REPORTED"),
    ]


def slurm_stage(workdir: Path) -> Rows:
    out = workdir / "slurm-job.out"
    subprocess.run(
        ["sbatch", "--wait", "--job-name=ember-demo", f"--output={out}", "--wrap", "echo ember-demo on $(hostname)"],
        check=True,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return [("slurm job", out.read_text().strip())]


def _healthy(rows: Rows) -> bool:
    return all(check(value) for key, value in rows for name, check in VERDICTS.items() if key == name)


def run_demo(console: Console, *, rollouts: int, group_size: int, tokens: int, layers: int) -> int:
    for service in services.SERVICES:
        with console.status(f"bringing up {service}..."):
            try:
                services.start(service)
            except services.ServiceError as exc:
                if service == "flink":
                    console.print(f"[yellow]flink job server unavailable:[/yellow] {str(exc).splitlines()[-1]}")
                    continue
                console.print(f"[red]{exc}[/red]")
                return 1
    home = Path(os.environ.get("EMBER_HOME", services.REPO_ROOT / ".ember"))
    workdir = home / "demo" / time.strftime("%Y%m%d-%H%M%S")
    workdir.mkdir(parents=True, exist_ok=True)
    console.print(f"demo work directory: {workdir}")

    from ember.midtrain import demo_stage as midtrain_demo
    from ember.midtrain import rl_demo_stage as rl_demo
    from ember.pipelines import demo_stage as corpus_demo
    from ember.rollouts import demo_stage as rollouts_demo

    sections: list[tuple[str, Rows]] = []
    context: dict[str, Path] = {}

    def corpus() -> Rows:
        rows, shards_dir = corpus_demo.run(console, workdir)
        context["shards"] = shards_dir
        return rows

    stages: list[tuple[str, Callable[[], Rows]]] = [
        ("wire codec through Kafka", lambda: wire_stage(console, rollouts=rollouts, group_size=group_size, tokens=tokens, layers=layers)),
        ("corpus build: filter, redact, dedup, tokenize, pack (Beam)", corpus),
        ("mid-training (Megatron-core MoE, CPU)", lambda: midtrain_demo.run(console, context["shards"], workdir / "midtrain")),
        ("rollout ETL (Kafka)", lambda: rollouts_demo.run(console, f"{DEMO_PREFIX}-etl-{int(time.time())}", 48, group_size, 512)),
        ("RL steps: sampler -> ETL -> trainer with router replay (Megatron-core MoE, CPU)", lambda: rl_demo.run(console, workdir / "rl")),
        ("slurm", lambda: slurm_stage(workdir)),
    ]
    ok = True
    for title, stage in stages:
        console.rule(title)
        started = time.perf_counter()
        try:
            rows = stage()
        except Exception as exc:  # noqa: BLE001 - a failed stage is reported in the summary, then the demo fails
            rows = [("FAILED", f"{type(exc).__name__}: {str(exc)[:500]}")]
            ok = False
        ok = ok and _healthy(rows)
        sections.append((f"{title} ({time.perf_counter() - started:.0f}s)", rows))
        if not ok:
            break

    table = Table("stage", "result", title="ember demo", show_lines=False)
    for title, rows in sections:
        table.add_row(f"[bold]{title}[/bold]", "")
        for key, value in rows:
            table.add_row(f"  {key}", value)
    console.print(table)
    console.print("[green]demo OK[/green]" if ok else "[red]demo FAILED (see the stage above)[/red]")
    return 0 if ok else 1
