"""Integration tests for the local services managed by infra/*.sh (Kafka, Slurm, Flink job server)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from .infra_support import REPO, SlurmCluster, ember_home, require_ok, run_infra, status_fields

pytestmark = pytest.mark.integration

TERMINAL_JOB_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE", "PREEMPTED",
}


# ----------------------------------------------------------------- Kafka --

def _kafka_pid() -> int:
    return int((ember_home() / "run" / "kafka.pid").read_text().strip())


def _admin(bootstrap: str):
    from kafka import KafkaAdminClient

    return KafkaAdminClient(
        bootstrap_servers=bootstrap, client_id="ember-infra-test",
        request_timeout_ms=10_000, bootstrap_timeout_ms=10_000,
    )


def _create_topic(bootstrap: str, name: str) -> None:
    from kafka.admin import NewTopic

    admin = _admin(bootstrap)
    try:
        admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()


def _delete_topic(bootstrap: str, name: str) -> None:
    admin = _admin(bootstrap)
    try:
        admin.delete_topics([name])
    except Exception:  # best-effort cleanup on the shared broker
        pass
    finally:
        admin.close()


@pytest.fixture()
def topic(kafka_bootstrap: str):
    """A fresh, explicitly created topic (auto-creation is disabled), deleted afterwards."""
    name = f"ember-infra-test-{uuid.uuid4().hex[:8]}"
    _create_topic(kafka_bootstrap, name)
    yield name
    _delete_topic(kafka_bootstrap, name)


def _list_topics(bootstrap: str) -> set[str]:
    admin = _admin(bootstrap)
    try:
        return set(admin.list_topics())
    finally:
        admin.close()


def _port_open(hostport: str) -> bool:
    host, port = hostport.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def test_kafka_start_is_idempotent(kafka_bootstrap: str) -> None:
    pid = _kafka_pid()
    t0 = time.monotonic()
    proc = require_ok(run_infra("kafka.sh", "start", timeout=120), "second infra/kafka.sh start")
    elapsed = time.monotonic() - t0
    assert "already running" in proc.stderr
    assert elapsed < 20, f"idempotent start took {elapsed:.1f}s"
    assert _kafka_pid() == pid

    name, state, endpoint, logfile = status_fields("kafka.sh")
    assert (name, state, endpoint) == ("kafka", "running", kafka_bootstrap)
    assert endpoint == f"127.0.0.1:{os.environ.get('EMBER_KAFKA_PORT', '19092')}"
    assert Path(logfile).is_file()


def test_kafka_produce_consume_roundtrip(kafka_bootstrap: str, topic: str) -> None:
    from kafka import KafkaConsumer, KafkaProducer

    payloads = [f"msg-{i}".encode() for i in range(5)]
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    try:
        for p in payloads:
            producer.send(topic, p)
        producer.flush(timeout=30)
    finally:
        producer.close()
    consumer = KafkaConsumer(
        topic, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
        enable_auto_commit=False, consumer_timeout_ms=20_000,
    )
    got: list[bytes] = []
    try:
        for message in consumer:
            got.append(message.value)
            if len(got) == len(payloads):
                break
    finally:
        consumer.close()
    assert got == payloads


def test_kafka_auto_topic_creation_is_disabled(kafka_bootstrap: str) -> None:
    conf = (ember_home() / "kafka" / "server.properties").read_text()
    assert "auto.create.topics.enable=false" in conf.splitlines()


@pytest.mark.serial  # stops and restarts the broker every other test shares
def test_kafka_stop_then_start(kafka_bootstrap: str, topic: str) -> None:
    require_ok(run_infra("kafka.sh", "stop", timeout=120), "infra/kafka.sh stop")
    assert status_fields("kafka.sh")[1] == "stopped"
    assert not _port_open(kafka_bootstrap)

    require_ok(run_infra("kafka.sh", "start", timeout=300), "infra/kafka.sh start after stop")
    assert status_fields("kafka.sh")[1] == "running"
    assert topic in _list_topics(kafka_bootstrap), "topic did not survive the restart"


# ----------------------------------------------------------------- Slurm --

def _job_fields(job_id: str, env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env, timeout=30,
    )
    if out.returncode != 0:
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def _submit_and_wait(script: Path, workdir: Path, env: dict[str, str], extra_env: str,
                     timeout: float = 90) -> tuple[str, dict[str, str]]:
    sub = subprocess.run(
        ["sbatch", "--parsable", f"--export=ALL,{extra_env}", "-D", str(workdir),
         "-o", str(workdir / "out-%j.txt"), "-J", "ember-infra-test", str(script)],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert sub.returncode == 0, f"sbatch failed: {sub.stdout}\n{sub.stderr}"
    job_id = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        fields = _job_fields(job_id, env)
        if fields.get("JobState") in TERMINAL_JOB_STATES:
            return job_id, fields
        time.sleep(0.5)
    pytest.fail(f"job {job_id} did not finish within {timeout}s; last state: {fields}", pytrace=False)


def test_slurm_status_line(slurm_cluster: SlurmCluster) -> None:
    name, state, endpoint, logfile = status_fields("slurm.sh")
    assert (name, state) == ("slurm", "running")
    assert endpoint == slurm_cluster.controller and endpoint.endswith(":6817")
    assert Path(logfile).is_file()


def test_slurm_batch_job_runs(slurm_env: dict[str, str], tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nset -e\nhostname\necho \"EMBER_TEST_TOKEN=$EMBER_TEST_TOKEN\"\n")
    script.chmod(0o755)

    job_id, fields = _submit_and_wait(script, tmp_path, slurm_env, f"EMBER_TEST_TOKEN={token}")
    assert fields["JobState"] == "COMPLETED", fields
    assert fields["ExitCode"] == "0:0", fields

    lines = (tmp_path / f"out-{job_id}.txt").read_text().splitlines()
    expected_host = subprocess.run(["hostname"], capture_output=True, text=True, check=True).stdout.strip()
    assert lines == [expected_host, f"EMBER_TEST_TOKEN={token}"]


def test_slurm_failed_job_reports_exit_code(slurm_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "fail.sh"
    script.write_text("#!/bin/bash\necho about-to-fail\nexit 3\n")
    script.chmod(0o755)

    job_id, fields = _submit_and_wait(script, tmp_path, slurm_env, "EMBER_UNUSED=1")
    assert fields["JobState"] == "FAILED", fields
    assert fields["ExitCode"] == "3:0", fields
    assert (tmp_path / f"out-{job_id}.txt").read_text() == "about-to-fail\n"


# ----------------------------------------------------------------- Flink --

def test_flink_job_server_runs_beam_pipeline(tmp_path: Path) -> None:
    """Runs a tiny Beam pipeline on FlinkRunner with the jar from infra/flink.sh; a jar that cannot
    be staged (exit code 3, 'unavailable') fails the test with the script's reason."""
    require_ok(run_infra("flink.sh", "fetch", timeout=900), "infra/flink.sh fetch")
    jar = require_ok(run_infra("flink.sh", "path"), "infra/flink.sh path").stdout.strip()
    assert status_fields("flink.sh")[:3] == ["flink-job-server", "available", jar]

    flink_version = os.environ.get("EMBER_FLINK_VERSION", "1.19")
    out = tmp_path / "counts"
    program = textwrap.dedent(f"""
        import apache_beam as beam
        from apache_beam.options.pipeline_options import PipelineOptions
        opts = PipelineOptions([
            "--runner=FlinkRunner", "--flink_version={flink_version}", "--flink_job_server_jar={jar}",
            "--environment_type=LOOPBACK", "--parallelism=1",
        ])
        with beam.Pipeline(options=opts) as p:
            (p | beam.Create("a b a c a b".split())
               | "pair" >> beam.Map(lambda w: (w, 1))
               | beam.CombinePerKey(sum)
               | "fmt" >> beam.MapTuple(lambda w, n: f"{{w}}={{n}}")
               | beam.io.WriteToText({str(out)!r}, shard_name_template=""))
    """)
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, f"pipeline failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert sorted(out.read_text().split()) == ["a=3", "b=2", "c=1"]
