"""Exactly-once under faults, against the real broker: `kill -9` of ETL processes (also exactly
mid-transaction), a second process taking over a killed one's partitions, and a broker restart.

Each test publishes a faulty workload while real `ember rollouts etl` processes run, injures them,
and then checks the books: every rewarded rollout of every complete group is in exactly one committed
batch, no batch id twice, every other rollout message dropped once with a reason, every malformed
message dead-lettered once.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
import uuid

import pytest

from ember.dev import services
from ember.rollouts.etl import prepare_topics
from tests.rollouts.etl_support import (
    EtlProcess,
    check_books,
    etl_settings,
    publish_in_background,
    wait_for_books,
    workload,
    write_config,
)

REWARD_TIMEOUT_S = 6.0
OUTAGE_TIMEOUT_S = 40.0
pytestmark = pytest.mark.integration


def _setup(tmp_path, partitions: int = 4, **sections):
    prefix = f"test-fault-{uuid.uuid4().hex[:8]}"
    config = write_config(tmp_path / "etl.yaml", etl_settings(prefix, partitions=partitions, **sections))
    return prefix, config, prepare_topics(config)


def _finish(procs: list[EtlProcess]) -> None:
    for proc in procs:
        code = proc.stop()
        assert code == 0, f"ETL exited with {code}:\n{proc.output()[-3000:]}"


@pytest.fixture
def processes():
    """Every ETL process a test starts; whatever is still running at the end is killed."""
    started: list[EtlProcess] = []
    yield started
    for proc in started:
        if proc.proc.poll() is None:
            proc.kill()


def test_kill_9_at_random_points_and_mid_transaction_loses_and_doubles_nothing(kafka, tmp_path, processes):
    _prefix, _config, topics = _setup(tmp_path)
    work = workload(_prefix, groups=48, group_interval_s=0.25)
    thread, _ = publish_in_background(work, topics)
    rng = random.Random(7)
    # Crash points inside the transaction (before its offsets, before its commit) and right after it,
    # early enough that the stream is still flowing; then plain kill -9 at random moments.
    for fault in ["etl.before_commit:2", "etl.before_send_offsets:1", "etl.after_commit:2", None, None]:
        proc = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path, fault=fault)
        processes.append(proc)
        if fault:
            try:
                proc.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{fault} never fired within 120 s:\n{proc.output()[-3000:]}")
            assert proc.proc.returncode == -signal.SIGKILL, f"{fault}: exit {proc.proc.returncode}\n{proc.output()[-3000:]}"
            proc.kill()
        else:
            time.sleep(rng.uniform(1.5, 3.5))
            assert proc.proc.poll() is None, proc.output()[-3000:]
            proc.kill()
    survivor = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path)
    processes.append(survivor)
    thread.join(timeout=120)
    wait_for_books(topics, work, timeout_s=120, alive=lambda: survivor.proc.poll() is None)
    _finish([survivor])
    found = check_books(topics, work, REWARD_TIMEOUT_S)
    assert found.batch_ids


def test_second_process_takes_over_a_killed_ones_partitions(kafka, tmp_path, processes):
    _prefix, _config, topics = _setup(tmp_path)
    work = workload(_prefix, groups=30, group_interval_s=0.25)
    first = EtlProcess(tmp_path / "etl.yaml", "a", tmp_path)
    second = EtlProcess(tmp_path / "etl.yaml", "b", tmp_path)
    processes.extend([first, second])
    thread, _ = publish_in_background(work, topics)
    time.sleep(4.0)
    assert first.proc.poll() is None and second.proc.poll() is None
    first.kill()
    thread.join(timeout=120)
    wait_for_books(topics, work, timeout_s=120, alive=lambda: second.proc.poll() is None)
    _finish([second])
    check_books(topics, work, REWARD_TIMEOUT_S)
    assert "owns shards [0, 1, 2, 3]" in second.output(), "the survivor never took over every partition"


def test_broker_restart_mid_stream_is_survived_without_help(kafka, tmp_path, processes):
    # While the broker is down the fleet cannot deliver either: rewards then really are late by the
    # outage, so the reward and group deadlines here outlast it (a shorter one would rightly drop them).
    _prefix, _config, topics = _setup(
        tmp_path, partitions=2,
        rewards={"timeout_s": OUTAGE_TIMEOUT_S, "orphan_timeout_s": OUTAGE_TIMEOUT_S + 5},
        groups={"timeout_s": OUTAGE_TIMEOUT_S + 5},
    )
    work = workload(_prefix, groups=30, group_interval_s=0.25)
    proc = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path)
    processes.append(proc)
    try:
        thread, _ = publish_in_background(work, topics)
        time.sleep(3.0)
        services.stop("kafka")
        time.sleep(2.0)
        services.start("kafka")
        thread.join(timeout=180)
        wait_for_books(topics, work, timeout_s=150, alive=lambda: proc.proc.poll() is None)
    finally:
        services.start("kafka")
    _finish([proc])
    check_books(topics, work, OUTAGE_TIMEOUT_S)
    output = proc.output()
    assert "KafkaConnectionError" in output, "the ETL saw no broker failure: the test injured nothing"
    # kafka-python logs its own socket errors with tracebacks; none may come from ember's code
    assert "ember/rollouts/" not in output, output[-3000:]
