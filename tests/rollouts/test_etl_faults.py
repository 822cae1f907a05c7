"""Exactly-once under faults, against the real broker: `kill -9` of ETL processes (also exactly
mid-transaction), a second process taking over a killed one's partitions, and a broker restart.

Each test publishes a faulty workload while real `ember rollouts etl` processes run, injures them,
and then checks the books: every rewarded rollout of every complete group is in exactly one committed
batch, no batch id twice, every other rollout message dropped once with a reason, every malformed
message dead-lettered once.
"""

from __future__ import annotations

import time

import pytest

from tests.rollouts.etl_support import (
    Deployment,
    EtlProcess,
    check_books,
    finish,
    kill_9_scenario,
    publish_in_background,
    setup_etl,
    takeover_scenario,
    wait_for_books,
    workload,
)
from tests.rollouts.fresh_broker import fresh_broker

# The broker restarted here is the test's own, freshly formatted (its restart takes 5-30 s on the 2-core machine), so
# the test runs beside the others instead of alone. A send blocked by the outage is stamped when it finally goes out:
# the deadlines must outlast the whole outage, with room to spare. A run whose outage outlasts them cannot judge the
# ETL and says so.
OUTAGE_TIMEOUT_S = 90.0
OUTAGE_MARGIN_S = 10.0
pytestmark = pytest.mark.integration


def test_kill_9_at_random_points_and_mid_transaction_loses_and_doubles_nothing(kafka, tmp_path, processes):
    kill_9_scenario(Deployment.plaintext(), tmp_path, processes)


def test_second_process_takes_over_a_killed_ones_partitions(kafka, tmp_path, processes):
    takeover_scenario(Deployment.plaintext(), tmp_path, processes)


def test_broker_restart_mid_stream_is_survived_without_help(kafka, tmp_path, processes):
    # While the broker is down the fleet cannot deliver either: rewards then really are late by the
    # outage, so the reward and group deadlines here outlast it (a shorter one would rightly drop them).
    # `kafka` only makes sure infra/kafka.sh has its jars; everything here runs on the test's own broker.
    with fresh_broker() as broker:
        deployment = Deployment(broker.bootstrap)
        _prefix, _config, topics = setup_etl(
            tmp_path, deployment, partitions=2,
            rewards={"timeout_s": OUTAGE_TIMEOUT_S, "orphan_timeout_s": OUTAGE_TIMEOUT_S + 5},
            groups={"timeout_s": OUTAGE_TIMEOUT_S + 5},
        )
        work = workload(_prefix, groups=30, group_interval_s=0.25)
        proc = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path)
        processes.append(proc)
        try:
            thread, _ = publish_in_background(work, topics, deployment=deployment)
            time.sleep(3.0)
            outage_started = time.monotonic()
            broker.stop()
            time.sleep(2.0)
            broker.start()
            outage_s = time.monotonic() - outage_started
            assert outage_s < OUTAGE_TIMEOUT_S - OUTAGE_MARGIN_S, (
                f"the broker was down {outage_s:.0f} s: rewards held back that long would rightly be late for the "
                f"{OUTAGE_TIMEOUT_S:.0f} s deadlines, so this run cannot judge the ETL"
            )
            thread.join(timeout=180)
            wait_for_books(topics, work, timeout_s=300, alive=lambda: proc.proc.poll() is None, deployment=deployment)
        finally:
            broker.start()
        finish([proc])
        check_books(topics, work, OUTAGE_TIMEOUT_S, deployment)
    output = proc.output()
    assert "KafkaConnectionError" in output, "the ETL saw no broker failure: the test injured nothing"
    # kafka-python logs its own socket errors with tracebacks; none may come from ember's code
    assert "ember/rollouts/" not in output, output[-3000:]
