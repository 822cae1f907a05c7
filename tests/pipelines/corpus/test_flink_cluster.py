"""The corpus build on the Flink session cluster of infra/flink-cluster.sh (JobManager, two TaskManagers,
Beam job server, Python worker pool: separate processes on 127.0.0.1), against FnApiRunner byte for byte,
cancelling its Flink job on Ctrl-C, and failing with one clear line (no manifest) when a stage cannot be
recovered. A TaskManager killed with -9 mid-build is tested on the cluster whose workers share no disk with
the driver (tests/pipelines/corpus/test_flink_isolated.py).

The job server is Beam 2.62.0 (the newest Flink runner the Maven mirror serves) while the Python SDK is
2.77.0 (Beam 2.62 needs pyarrow<17; ember needs pyarrow>=23): these tests are what proves that pairing.
Slow by necessity: a cluster build of the 66-document sample (121 Flink vertices, a job submission that
translates and stages the job server's jars) took 68 s in this file's run (114 s with the TaskManager
killed and the job restarted; 208 s for the file), and up to 359 s on two heavily shared cores, where
FnApiRunner takes 16 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from apache_beam.options.pipeline_options import PipelineOptions

from ember.dev import services
from tests.conftest import start
from ember.demo.sample_corpus import SampleCorpus, write_sample_corpus
from ember.pipelines.corpus.config import parse_config
from ember.pipelines.jobs.runners import FLINK_CLUSTER_FLAG, flink_cluster_args, runs_locally, with_defaults

from tests.pipelines.corpus_support import build, file_digests

REPO = Path(__file__).resolve().parents[3]

REST = f"http://127.0.0.1:{os.environ.get('EMBER_FLINK_REST_PORT', '18081')}"

pytestmark = pytest.mark.xdist_group("flink")  # the session cluster is one shared service these tests kill and restart


def rest(path: str) -> dict:
    with urllib.request.urlopen(REST + path, timeout=5) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def cluster() -> list[str]:
    """The running session cluster (started when it is not: `ember dev up flink` does the same)."""
    start("flink", "the Flink session cluster")
    assert rest("/overview")["taskmanagers"] >= 2
    return flink_cluster_args()


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleCorpus:
    return write_sample_corpus(tmp_path_factory.mktemp("corpus-input"))


@pytest.fixture(scope="module")
def reference(sample: SampleCorpus, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("fnapi")
    assert build(parse_config(sample.config(str(out)))) == "DONE"
    return file_digests(out)


def test_the_cluster_flag_expands_to_the_scripts_options(cluster: list[str]) -> None:
    script = services.run_script("flink-cluster.sh", "args").stdout.split()
    *args, job_name = with_defaults([FLINK_CLUSTER_FLAG, "--max_num_workers=3"])
    assert args == script + ["--max_num_workers=3"]
    assert job_name.startswith("--job_name=ember-"), "a name to find the Flink job by, to cancel it"
    assert with_defaults([FLINK_CLUSTER_FLAG, "--job_name=mine"])[-1] == "--job_name=mine"
    assert runs_locally(PipelineOptions(script)), "the worker pool shares this machine's disk"
    with pytest.raises(ValueError, match="EMBER_FLINK_JOB_PORT='x'"):
        flink_cluster_args({"EMBER_FLINK_JOB_PORT": "x"})


def test_the_session_cluster_builds_the_same_bytes_as_fnapi(sample: SampleCorpus, reference: dict[str, str],
                                                           cluster: list[str], tmp_path: Path) -> None:
    finished_before = rest("/overview")["jobs-finished"]
    assert build(parse_config(sample.config(str(tmp_path))), cluster) == "DONE"
    assert file_digests(tmp_path) == reference
    assert rest("/overview")["jobs-finished"] == finished_before + 1, "the job ran on the session cluster"


def test_ctrl_c_stops_the_build_and_cancels_its_flink_job(sample: SampleCorpus, cluster: list[str], tmp_path: Path) -> None:
    """SIGINT to `ember corpus build` while its job runs on the cluster: the one-line "interrupted" message,
    exit 130, and the job CANCELED on the cluster (Beam 2.62's job server alone leaves it running there)."""
    known = {j["jid"] for j in rest("/jobs/overview")["jobs"]}
    cli = _cli_build(sample, tmp_path)
    try:
        job = _running_job(known, cli)
        assert job, "no job of this build reached its running tasks"
        cli.send_signal(signal.SIGINT)
        output, _ = cli.communicate(timeout=60)
    finally:
        cli.terminate()
    assert cli.returncode == 130, output
    assert "interrupted: SIGINT" in output and "Traceback" not in output, output
    deadline = time.monotonic() + 30
    while rest(f"/jobs/{job}")["state"] == "CANCELLING" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert rest(f"/jobs/{job}")["state"] == "CANCELED"
    assert not list(tmp_path.rglob("manifest.json")), sorted(tmp_path.rglob("*"))


def test_a_stage_that_cannot_recover_fails_the_build_with_one_line_and_no_manifest(
    sample: SampleCorpus, cluster: list[str], tmp_path: Path
) -> None:
    """Once the job's tasks run, kill -9 the worker pool's process group (the pool and every SDK harness)
    and both TaskManager JVMs, and keep the pool down: a node lost with its workers. Killing the
    TaskManagers makes the loss one Flink always sees (heartbeat timeout; a harness killed alone can leave
    a task blocked on it, the job RUNNING with no failure), and their supervisor-restarted JVMs hold no
    cached harness, so each of Flink's restarts (fixed-delay, 4 attempts 2 s apart) asks the dead pool for
    one and fails. The job ends FAILED and `ember corpus build` says so in one line, exit 1, with no
    manifest.json or stats.json written. The worker pool is started again afterwards (the supervisors have
    restarted the TaskManagers) and the cluster must report itself running: a whole-cluster restart costs a minute."""
    known = {j["jid"] for j in rest("/jobs/overview")["jobs"]}
    cli = _cli_build(sample, tmp_path)
    try:
        job = _running_job(known, cli)
        assert job, "no job of this build reached its running tasks"
        os.killpg(_pool_pid(), signal.SIGKILL)
        for n in (1, 2):
            os.kill(_tm_pid(n), signal.SIGKILL)
        output, _ = cli.communicate(timeout=420)
        state = rest(f"/jobs/{job}")["state"]
    finally:
        cli.terminate()  # a no-op once it has exited; else SIGTERM stops its job process too
        services.start("flink")  # the idempotent start brings back what is down: the worker pool killed here
    assert cli.returncode == 1, output
    assert "Traceback" not in output, output
    assert "failed: it ended in state FAILED" in output and "(the log: " in output, output
    assert state == "FAILED"
    assert not list(tmp_path.rglob("manifest.json")) and not list(tmp_path.rglob("stats.json")), sorted(tmp_path.rglob("*"))
    assert "worker pool 127.0.0.1" in services.run_script("flink-cluster.sh", "status").stdout


def _cli_build(sample: SampleCorpus, tmp_path: Path) -> subprocess.Popen:
    """`ember corpus build <the sample> --flink_cluster` in a process of its own, output into tmp_path/out."""
    config = tmp_path / "corpus.yaml"
    config.write_text(yaml.safe_dump(sample.config(str(tmp_path / "out"))))
    command = [sys.executable, "-c", "from ember.cli import app; app()", "corpus", "build", str(config), FLINK_CLUSTER_FLAG]
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _running_job(known: set[str], cli: subprocess.Popen) -> str | None:
    """The Flink job id of the build `cli` submitted, once one of its tasks runs."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and cli.poll() is None:
        for j in rest("/jobs/overview")["jobs"]:
            if j["jid"] not in known and j["state"] == "RUNNING" and j["tasks"]["running"] + j["tasks"]["finished"]:
                return j["jid"]
        time.sleep(0.5)
    return None


def _pool_pid() -> int:
    """The worker pool's pid, which leads its process group (infra/common.sh start_bg runs it under setsid)."""
    home = Path(os.environ.get("EMBER_HOME", REPO / ".ember"))
    return int((home / "run" / "flink-cluster" / "worker-pool.pid").read_text().split()[0])


def _tm_pid(n: int, timeout_s: float = 60) -> int:
    """The JVM pid of TaskManager n (its supervisor's child). Waits, bounded, while the supervisor is between two
    JVMs: on a loaded machine a TaskManager can exit and be restarted while a job runs (seen under xdist)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = subprocess.run(["bash", str(services.INFRA_DIR / "flink-cluster.sh"), "tm-pid", str(n)],
                                capture_output=True, text=True)
        if result.returncode == 0:
            return int(result.stdout.strip())
        assert time.monotonic() < deadline, f"TaskManager {n} had no live JVM for {timeout_s:.0f} s: {result.stderr}"
        time.sleep(1)
