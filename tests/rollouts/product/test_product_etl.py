"""`source: product` against the real broker: ETL processes killed with SIGKILL (between the spill store's
commit and Kafka's, and at a random moment) while completions wait for an hour-long horizon, compressed 240x,
and shards moving between two live processes that share the state dir; every served completion still ends
exactly once, in a committed batch or the ledger."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections import Counter

import pytest
from kafka import KafkaProducer

from ember.rollouts.product.events import ServedCompletion
from ember.rollouts.product.simulate import ProductTraffic, plan_traffic
from ember.rollouts.product_etl import publish_traffic
from ember.rollouts.records import Outcome
from ember.rollouts.replay import ReplayStart, replay
from ember.rollouts.transport import producer_config
from tests.rollouts.etl_support import Deployment, EtlProcess, etl_settings, finish, read_topic, wait_for_line, write_config

pytestmark = pytest.mark.integration

SCALE = 240  # an hour of product time in 15 s of log time: longer than two process starts and a kill


def _ends(topics) -> tuple[dict[str, list[str]], list[str]]:
    """Each completion id's ends in the ledger (trained, or its drop reason), and the committed batch keys."""
    return _ends_of(Outcome.decode(record.value) for record in read_topic(topics.outcomes)), [r.key.decode() for r in read_topic(topics.train_batches)]


def _ends_of(outcomes) -> dict[str, list[str]]:
    ends: dict[str, list[str]] = {}
    for outcome in outcomes:
        if outcome.kind == "batch":
            for cid in outcome.detail["rollout_ids"]:
                ends.setdefault(cid, []).append("trained")
        elif outcome.kind == "rollout_dropped":
            ends.setdefault(outcome.rollout_id, []).append(outcome.reason)
    return ends


def test_kill_9_mid_window_with_spilled_state_loses_and_doubles_nothing(kafka, tmp_path, processes):
    prefix = f"test-product-{uuid.uuid4().hex[:8]}"
    deployment = Deployment.plaintext()
    settings = etl_settings(
        prefix, partitions=2, kafka=deployment.kafka_section("etl"),
        filters={"vocab_size": 1000, "max_tokens": 64, "max_policy_lag": None},
        batches={"token_budget": 256, "min_fill": 0.5, "max_wait_s": 0.3},
    )
    settings["source"] = "product"
    settings["product"] = {
        "state_dir": str(tmp_path / "state"),
        "reward": {"horizon_s": 3660 / SCALE, "unshown_horizon_s": 600 / SCALE},
        "opt_out_topic": True,
    }
    config = write_config(tmp_path / "etl.yaml", settings)
    topics = deployment.prepare(prefix, config)
    producer = KafkaProducer(**producer_config(None, bootstrap_servers=kafka))
    producer.send(topics.opt_out, key=b"user:u3", value=b"1").get(timeout=30)  # what the ETL reads before deciding
    producer.close(timeout=5)
    plan = plan_traffic(ProductTraffic(completions=80, users=8, tokens=32, vocab_size=1000, acted=0.7, rate_per_s=2, time_scale=SCALE, seed=5))
    served = {p.key.decode() for p in plan if p.role == "served"}
    opted_out = {p.key.decode() for p in plan if p.role == "served" and ServedCompletion.decode(p.value).user_id == "u3"}
    publisher = threading.Thread(target=publish_traffic, args=(plan, topics), daemon=True)
    crashed = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path, fault="etl.before_commit:3")  # store committed, Kafka not
    processes.append(crashed)
    wait_for_line(crashed, "owns shards", 120)
    publisher.start()
    assert crashed.proc.wait(timeout=120) == -signal.SIGKILL, crashed.output()[-3000:]
    crashed.kill()
    helper = EtlProcess(tmp_path / "etl.yaml", "1", tmp_path)  # takes every shard over, then shares them (and the state dir)
    processes.append(helper)
    wait_for_line(helper, "owns shards", 120)
    second = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path)  # joining, it takes a shard from the helper: a rebalance
    processes.append(second)
    wait_for_line(second, "owns shards", 120)
    time.sleep(1.0)
    second.kill()
    publisher.join(timeout=60)
    survivor = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path)
    processes.append(survivor)
    wait_for_line(survivor, "owns shards", 120)  # really running, not stopped while it starts
    deadline = time.monotonic() + 120
    while True:
        ends, batch_keys = _ends(topics)
        if set(ends) >= served or time.monotonic() > deadline:
            break
        assert survivor.proc.poll() is None, survivor.output()[-3000:]
        time.sleep(1.0)
    finish([survivor, helper])
    ends, batch_keys = _ends(topics)

    assert set(ends) == served, f"{len(served - set(ends))} served completions never ended"
    assert {cid: e for cid, e in ends.items() if len(e) != 1} == {}
    assert not [k for k, n in Counter(batch_keys).items() if n > 1], "a batch committed twice"
    assert opted_out and {cid for cid, e in ends.items() if e == ["opt_out"]} == opted_out
    reasons = Counter(e[0] for e in ends.values())
    assert reasons["trained"] and reasons["no_signal"], reasons
    later = second.output() + helper.output() + survivor.output()
    assert helper.output().count("owns shards") >= 2, "the helper's shards never moved"
    assert "sending its outputs again" in later, "the crash between the two commits left nothing to send again"
    rebuilt = [line for line in later.splitlines() if "pending to rebuild" in line]
    assert any(" 0 pending" not in line for line in rebuilt), "no restart found completions waiting in the spill store"

    # `rollouts replay` of the same log, with no crash, decides every completion as the live run did
    summary = replay(config, ReplayStart(earliest=True), to_dir=tmp_path / "replay")
    lines = (tmp_path / "replay" / "outcomes.jsonl").read_text().splitlines()
    assert _ends_of(Outcome.decode(line.encode()) for line in lines) == ends
    assert summary.rollouts == reasons["trained"]


def test_simulate_product_publishes_served_completions_and_their_events(kafka):
    """`rollouts simulate --product`: GROUPS x GROUP_SIZE served completions on the rollouts topic, their events on
    the events topic, every record keyed by its completion id and readable by the product records' decoders."""
    from typer.testing import CliRunner

    from ember.rollouts.cli import rollouts_app
    from ember.rollouts.product.events import ProductEvent, ServedCompletion
    from ember.rollouts.topics import Topics

    topics = Topics(f"test-simprod-{uuid.uuid4().hex[:8]}")
    result = CliRunner().invoke(rollouts_app, [
        "simulate", "--prefix", topics.prefix, "--create-topics", "--partitions", "2", "--product", "--groups", "5",
        "--group-size", "4", "--vocab-size", "1000", "--time-scale", "inf",
    ])
    assert result.exit_code == 0, result.output
    served = [ServedCompletion.decode(r.value) for r in read_topic(topics.rollouts)]
    assert len(served) == 20 and all(s.rollout.tokens.max() < 1000 for s in served)
    ids = {s.completion_id for s in served}
    events = [(r.key.decode(), ProductEvent.decode(r.value)) for r in read_topic(topics.events)]
    assert events and all(key == e.completion_id and key in ids for key, e in events)
    assert f"published 20 served completions and {len(events)} events" in " ".join(result.output.split())
