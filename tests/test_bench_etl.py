"""bench/bench_etl.py: its --security flag, and a tiny real run on the secured broker through the claim-check path."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "bench_etl.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_etl", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_security_is_plaintext_by_default_and_takes_sasl_ssl_or_both(bench):
    assert bench.parse_args([]).security == "plaintext"
    assert bench.parse_args(["--security", "sasl_ssl"]).security == "sasl_ssl"
    assert bench.parse_args(["--security", "both"]).security == "both"
    assert bench.BROKERS["plaintext"] == [bench.plaintext_broker]
    assert bench.BROKERS["sasl_ssl"] == [bench.secured_broker]
    assert bench.BROKERS["both"] == [bench.plaintext_broker, bench.secured_broker]


def test_configs_pick_etl_processes_x_ranks(bench):
    assert bench.parse_args([]).configs == [(1, 1), (2, 1), (2, 2)]
    assert bench.parse_args(["--configs", "1x1"]).configs == [(1, 1)]
    assert bench.parse_args(["--configs", "2x2, 1x1,2x2"]).configs == [(2, 2), (1, 1)]
    runs = bench.runs_on(bench.Broker("SASL_SSL", "127.0.0.1:1"), "both", [(1, 1)], ["kafka-python"])
    assert [(r.etls, r.ranks, r.compression) for r in runs] == [(1, 1, "none"), (1, 1, "zstd")]
    both = bench.runs_on(bench.Broker("SASL_SSL", "127.0.0.1:1"), "none", [(1, 1), (2, 2)], ["kafka-python", "confluent"])
    assert [(r.etls, r.ranks, r.fetcher) for r in both] == [
        (1, 1, "kafka-python"), (2, 2, "kafka-python"), (1, 1, "confluent"), (2, 2, "confluent")]


@pytest.mark.parametrize("argv", [["--security", "tls"], ["--groups", "1"], ["--configs", "3x1"]])
def test_bad_arguments_are_refused(bench, argv, capsys):
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(argv)
    assert exited.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_plaintext_roles_are_anonymous_and_the_etl_config_connects_as_each_role(bench):
    broker = bench.Broker("PLAINTEXT", "127.0.0.1:1")
    assert broker.security("etl").security_protocol == "PLAINTEXT"
    kafka = bench.etl_settings("p", broker)["kafka"]
    assert kafka["bootstrap"] == "127.0.0.1:1" and kafka["security"]["security_protocol"] == "PLAINTEXT"


@pytest.mark.integration
def test_a_tiny_run_on_the_secured_broker_goes_through_the_claim_check_path(secure_kafka):
    """1 ETL x 1 rank and 2 ETL x 2 ranks on SASL_SSL, each role as its own principal: the ranks hold every
    rollout, batches are references (about 2 bytes through the broker per rollout byte), no password is printed."""
    done = subprocess.run(
        [sys.executable, str(BENCH), "--security", "sasl_ssl", "--configs", "1x1,2x2", "--groups", "2", "--repeats", "1",
         "--latency-groups", "1"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = re.findall(r"^\| SASL_SSL \| (\d) ETL x (\d) ranks?, none, kafka-python fetcher \|.*\| ([\d.]+) \|$", done.stdout, re.M)
    assert [(etls, ranks) for etls, ranks, _ in rows] == [("1", "1"), ("2", "2")], done.stdout
    assert all(2.0 <= float(moved) < 2.1 for _, _, moved in rows), done.stdout
    assert "bytes per rollout (by reference)" in done.stdout
    assert re.search(r"^SASL_SSL: latency .* over 1 groups", done.stdout, re.M), done.stdout
    passwords = {secure_kafka.password_file(role).read_text().strip() for role in ("admin", "inference", "grader", "etl", "trainer")}
    assert not any(p in done.stdout or p in done.stderr for p in passwords)
