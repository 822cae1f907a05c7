"""Live = replay: the ETL's ledger equals `ember rollouts replay` of the same log, decision for decision.

Graders that stamp a reward when they send it and get it appended seconds later (one grader's producer
lingers 2.5 s before it sends a batch), rewards near their 3 s deadline, and the ETL sharing its CPU
with a busy loop and reading at most 3 records per poll. A reward's timestamp is the broker's append
time (LogAppendTime): whether it is in time is a fact of the log, and the ETL decides a deadline only
once nothing stamped before it can be unread, so the live decisions and the replay's are the same
record for record, including the log time each decision was made at.

About 20-40 s: the ETL starts and joins, ~10 s of traffic, the last deadlines, the replay.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from kafka import KafkaProducer
from typer.testing import CliRunner

from ember.rollouts.admin import ensure_topics
from ember.rollouts.cli import rollouts_app
from ember.rollouts.config import parse_config
from ember.rollouts.etl import EtlService
from ember.rollouts.records import Outcome
from ember.rollouts.simulate import synthetic_rollout
from ember.rollouts.topics import TopicSpec, Topics, timestamp_problem
from ember.rollouts.transport import producer_config
from ember.schemas import Reward, encode
from tests.rollouts.etl_support import (
    Deployment,
    EtlProcess,
    etl_settings,
    finish,
    ledger_counts,
    read_topic,
    setup_etl,
    wait_for_line,
    write_config,
)

GROUPS, SIZE = 36, 4
REWARD_TIMEOUT_S = 3.0
LINGER_MS = 2500


def publish(topics, bootstrap: str, seed: int = 5) -> dict[tuple[int, int], float]:
    """Groups of rollouts every 0.25 s; each reward sent 0.5-2.7 s after its rollout, a third of them through
    a producer that holds them 2.5 s before sending, some never. Returns each reward's send time (wall, s) by
    (partition, offset)."""
    rng = random.Random(seed)
    fast = KafkaProducer(**producer_config(None, bootstrap_servers=bootstrap, linger_ms=0))
    lagging = KafkaProducer(**producer_config(None, bootstrap_servers=bootstrap, linger_ms=LINGER_MS))
    plan = []
    for g in range(GROUPS):
        group = f"{topics.prefix}-g{g}"
        for i in range(SIZE):
            rollout = synthetic_rollout(
                np.random.default_rng(g * SIZE + i), group_id=group, prompt_id=group,
                num_tokens=48, prompt_tokens=4, layers=None, rollout_id=f"{group}-{i}", finish_reason="stop",
            )
            at = g * 0.25
            plan.append((at, fast, topics.rollouts, group, encode(rollout)))
            if rng.random() < 0.9:
                reward = Reward(rollout.rollout_id, group, "unit-tests", rng.random(), 0, {})
                producer = lagging if rng.random() < 0.35 else fast
                plan.append((at + rng.uniform(0.5, 2.7), producer, topics.rewards, group, encode(reward)))
    plan.sort(key=lambda p: p[0])
    started, futures = time.monotonic(), []
    try:
        for at, producer, topic, key, value in plan:
            time.sleep(max(0.0, started + at - time.monotonic()))
            future = producer.send(topic, key=key.encode(), value=value)
            if topic == topics.rewards:
                futures.append((time.time(), future))
        fast.flush()
        lagging.flush()
        where = [(sent, future.get(timeout=30)) for sent, future in futures]
        return {(meta.partition, meta.offset): sent for sent, meta in where}
    finally:
        fast.close()
        lagging.close()


def decisions(outcomes: list[Outcome]) -> list[str]:
    """Every ledger record (batches, drops and their reasons, the log time of each decision), in one order."""
    return sorted(o.encode().decode() for o in outcomes)


@pytest.mark.integration
def test_the_live_ledger_equals_a_replay_of_the_same_log(kafka, tmp_path, processes):
    prefix, _config, topics = setup_etl(
        tmp_path, Deployment.plaintext(), partitions=2,
        kafka={"max_poll_records": 3},
        rewards={"timeout_s": REWARD_TIMEOUT_S, "orphan_timeout_s": REWARD_TIMEOUT_S + 2},
        groups={"timeout_s": REWARD_TIMEOUT_S + 2},
    )
    etl = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path)
    processes.append(etl)
    wait_for_line(etl, "owns shards [", 120)
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        sent = publish(topics, Deployment.plaintext().bootstrap)
        deadline = time.monotonic() + 90
        while ledger_counts(topics.outcomes)[0] < GROUPS * SIZE:
            assert etl.proc.poll() is None, etl.output()[-3000:]
            assert time.monotonic() < deadline, f"the ledger accounts for {ledger_counts(topics.outcomes)} after 90 s"
            time.sleep(1.0)
    finally:
        burner.kill()
        burner.wait()
    finish([etl])

    appended = {(r.partition, r.offset): r.timestamp for r in read_topic(topics.rewards)}
    held = [appended[k] / 1000 - sent[k] for k in sent if appended[k] / 1000 - sent[k] > 1.0]
    assert len(held) >= 10, f"only {len(held)} of {len(sent)} rewards were appended over 1 s after they were sent"

    out = tmp_path / "replayed"
    result = CliRunner().invoke(rollouts_app, ["replay", str(tmp_path / "etl.yaml"), "--to", str(out)])
    assert result.exit_code == 0, result.output
    replayed = [Outcome.decode(line.encode()) for line in (out / "outcomes.jsonl").read_text().splitlines()]
    live = [Outcome.decode(r.value) for r in read_topic(topics.outcomes)]

    reasons = {o.reason for o in live}
    assert {"batched", "late_reward"} <= reasons, f"the run never came near a deadline: {sorted(reasons)}"
    batched = sum(len(o.detail["rollout_ids"]) for o in live if o.kind == "batch")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollouts"] == batched, (summary, batched)
    assert decisions(live) == decisions(replayed)


def test_input_topics_are_stamped_by_the_broker_and_a_producer_stamped_one_is_named_with_its_fix():
    specs = Topics("p").specs()
    assert specs["rollouts"].configs()["message.timestamp.type"] == "LogAppendTime"
    assert specs["rewards"].configs()["message.timestamp.type"] == "LogAppendTime"
    assert timestamp_problem("p.rewards", specs["rewards"].configs()) is None
    problem = timestamp_problem("p.rewards", {"message.timestamp.type": "CreateTime"}, "broker:9092")
    assert "\n" not in problem
    assert "p.rewards uses message.timestamp.type=CreateTime" in problem
    assert "kafka-configs.sh --bootstrap-server broker:9092 --alter --entity-type topics --entity-name p.rewards" in problem
    assert "--add-config message.timestamp.type=LogAppendTime" in problem and "ember rollouts topics create" in problem


@pytest.mark.integration
def test_the_etl_refuses_to_start_on_a_producer_stamped_input_topic(kafka, tmp_path):
    prefix = f"test-stamp-{uuid.uuid4().hex[:8]}"
    ensure_topics(kafka, [TopicSpec(Topics(prefix).rewards, 1)])  # made by hand, with the broker's default CreateTime
    write_config(tmp_path / "etl.yaml", etl_settings(prefix, partitions=1, kafka={"create_topics": True}))
    result = CliRunner().invoke(rollouts_app, ["etl", str(tmp_path / "etl.yaml")])
    assert result.exit_code == 2, result.output
    (line,) = [text for text in result.output.splitlines() if "CreateTime" in text]
    assert f"{prefix}.rewards uses message.timestamp.type=CreateTime" in line and "--add-config message.timestamp.type=LogAppendTime" in line


def test_a_producer_stamped_record_is_warned_about_once_per_topic(caplog):
    """The start-up check cannot see configs a principal may not describe: the records' own timestamp type can."""
    service = EtlService(parse_config(etl_settings("p")))
    with caplog.at_level(logging.WARNING, logger="ember.etl"):
        for _ in range(3):
            service._check_stamp("p.rewards", 0)
            service._check_stamp("p.rollouts", 1)
    assert [r.getMessage().split(" ")[0] for r in caplog.records] == ["p.rewards"]
    assert "set message.timestamp.type=LogAppendTime on it" in caplog.records[0].getMessage()
