"""No warm-broker assumptions: the demo's rollout stage, run first thing on a broker formatted moments
before, passes on its first try.

On such a broker `__consumer_offsets` and `__transaction_state` do not exist yet: the group
coordinator answers NotCoordinator for seconds, no partition is assigned, poll() returns nothing
although the topics are full. The first `make demo` used to stop its ETL right then, with 0 rollouts
and unbalanced books.

About 60 s (over the ~20 s budget because it must format and start its own throwaway broker, about
25 s on two shared cores, and stop it; the stage itself takes about 20 s). The suite's broker is not touched.
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from ember.demo import etl_stage
from ember.demo.run import VERDICTS
from tests.rollouts.fresh_broker import fresh_broker

pytestmark = pytest.mark.integration


def test_demo_rollout_stage_passes_first_time_on_a_freshly_formatted_broker(kafka, monkeypatch):
    # `kafka` only makes sure infra/kafka.sh has its jars; the stage runs against the throwaway broker
    with fresh_broker() as broker:
        monkeypatch.setenv("EMBER_KAFKA_BOOTSTRAP", broker.bootstrap)
        out = io.StringIO()
        rows = etl_stage.run(Console(file=out), "demo-fresh", rollouts=48, group_size=8, tokens=512)
    results = dict(rows)
    assert VERDICTS["books balance"](results["books balance"]), rows
    read = int(results["trainer read"].split()[0])
    assert read > 0, rows  # books that balance because nothing was read would prove nothing
    assert results["ETL"].startswith(f"{read} rollouts in "), rows
