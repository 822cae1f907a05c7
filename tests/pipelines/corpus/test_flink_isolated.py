"""Builds on a Flink session cluster whose workers share no disk with the driver: infra/flink-cluster.sh with
EMBER_FLINK_ISOLATED=1 runs the worker pool, so every SDK harness and every byte the job reads or writes, in a
mount namespace of its own (bubblewrap: a private /tmp, where the driver works and writes; this module's temporary
directories hidden too). Inputs and outputs are on the real local object stores (fake-gcs-server, moto S3).

On that cluster a tokenize build from gs:// to gs:// and from s3:// to s3:// finishes with the shard set FnApiRunner
writes, byte for byte; the same build to a local output is refused before any job is submitted; and a corpus build
survives a TaskManager killed with -9 with FnApiRunner's bytes. The cluster is this module's own (free ports, its own
state under $EMBER_HOME/flink-isolated), started once and stopped at the end; the shared cluster is not touched.
Slow by necessity, like tests/pipelines/corpus/test_flink_cluster.py (whose TaskManager kill test moved here): on two
heavily shared cores the cluster started in 30-56 s, the gs:// and s3:// tests took 152 s and 222 s (a FnApiRunner
build and a 78-task cluster job each), the kill test 232 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from ember import storage
from ember.demo.sample_corpus import SampleCorpus, write_sample_corpus
from ember.dev import services
from ember.pipelines.corpus.config import parse_config
from ember.pipelines.jobs.output_guard import OutputUnusable
from ember.pipelines.jobs.runners import runs_locally
from ember.pipelines.tokenize_pipeline import run as tokenize
from ember.tokenize.config import TokenizeConfig
from tests.conftest import _new_bucket
from tests.pipelines.corpus_support import build, file_digests
from tests.tokenize.support import mixed_documents, write_documents

pytestmark = [pytest.mark.xdist_group("flink"), pytest.mark.integration]

SCRIPT = services.INFRA_DIR / "flink-cluster.sh"
PORTS = ("RPC", "REST", "BLOB", "JOB", "ARTIFACT", "EXPANSION", "WORKER_POOL")
FNAPI = ["--runner=FnApiRunner"]
REPO_MARKER = SCRIPT  # a file of the checkout the workers import ember from


@dataclass(frozen=True)
class Cluster:
    env: dict[str, str]
    args: list[str]

    def script(self, *args: str) -> str:
        return subprocess.run(["bash", str(SCRIPT), *args], env=self.env, capture_output=True, text=True,
                              check=True, timeout=300).stdout

    def rest(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.env['EMBER_FLINK_REST_PORT']}{path}", timeout=5) as response:
            return json.load(response)

    def pool_pid(self) -> int:
        run_dir = Path(self.env["EMBER_HOME"]) / "run" / self.env["EMBER_FLINK_CLUSTER"]
        return int((run_dir / "worker-pool.pid").read_text().split()[0])


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="module")
def isolated(object_stores, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The isolated cluster, started with this process's object-store settings (the workers reach the stores)."""
    env = {**os.environ, "EMBER_FLINK_CLUSTER": "flink-isolated", "EMBER_FLINK_ISOLATED": "1",
           "EMBER_FLINK_HIDE": str(tmp_path_factory.getbasetemp()),
           "EMBER_HOME": os.environ.get("EMBER_HOME", str(services.INFRA_DIR.parent / ".ember"))}
    env.update({f"EMBER_FLINK_{name}_PORT": str(port) for name, port in zip(PORTS, free_ports(len(PORTS)))})
    cluster = Cluster(env, [])
    try:
        cluster.script("start")
        yield Cluster(env, cluster.script("args").split())
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=120)


def test_the_workers_see_none_of_the_drivers_disk(isolated: Cluster, tmp_path: Path) -> None:
    """What the driver writes in its temporary directory does not exist for the pool (its harnesses are its
    children, in its namespace), and ember counts the pool as sharing no disk with this machine."""
    (tmp_path / "driver-only").write_text("here")
    pool = subprocess.run(["pgrep", "-P", str(isolated.pool_pid())], capture_output=True, text=True).stdout.split()
    assert pool, "bubblewrap's child runs the worker pool"
    inside = Path(f"/proc/{pool[0]}/root")
    assert (inside / str(REPO_MARKER).lstrip("/")).exists(), "the pool sees the code it imports"
    assert not (inside / str(tmp_path / "driver-only").lstrip("/")).exists()
    assert not runs_locally(PipelineOptions(isolated.args))


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    docs = mixed_documents(copies=1)
    root = tmp_path_factory.mktemp("documents")
    return {name: write_documents(root / name / "part-0.parquet", docs[name]) for name in ("code", "web")}


def tokenize_config(sources: dict[str, str], output_dir: str) -> TokenizeConfig:
    return TokenizeConfig(
        output_dir=output_dir, seq_len=128, window_documents=16, sequences_per_shard=8, rows_per_batch=4, seed=3,
        tokenizer={"name": "cl100k_base"}, sources=[{"name": name, "path": path} for name, path in sources.items()],
    )


def shard_files(location: str) -> dict[str, bytes]:
    return {name: storage.read_bytes(storage.join(location, name)) for name in storage.list_files(location)}


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_tokenize_build_between_urls_writes_fnapis_shard_set(scheme, isolated, documents, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the driver's working directory: hidden from the workers
    bucket = _new_bucket(scheme)
    storage.preflight(bucket, write=True)
    sources = {}
    for name, path in documents.items():
        storage.upload(path, f"{bucket}/in/{name}/part-0.parquet")
        sources[name] = f"{bucket}/in/{name}/*.parquet"
    tokenize(tokenize_config(sources, f"{bucket}/fnapi"), FNAPI)
    finished = isolated.rest("/overview")["jobs-finished"]
    started = time.monotonic()
    tokenize(tokenize_config(sources, f"{bucket}/cluster"), isolated.args)
    print(f"\n{scheme}: tokenize on the isolated cluster {time.monotonic() - started:.1f} s")
    assert isolated.rest("/overview")["jobs-finished"] == finished + 1, "the job ran on the isolated cluster"
    reference, written = shard_files(f"{bucket}/fnapi"), shard_files(f"{bucket}/cluster")
    assert written.keys() == reference.keys() and len(written) > 3
    assert {n: b for n, b in written.items() if n != "manifest.json"} == {
        n: b for n, b in reference.items() if n != "manifest.json"}
    manifests = [json.loads(files["manifest.json"]) for files in (reference, written)]
    for manifest in manifests:
        for varies in ("created_at", "config_hash", "provenance"):  # the hash covers the output's place
            manifest.pop(varies)
    assert manifests[0] == manifests[1]

    local = tmp_path / "shards"
    finished = isolated.rest("/overview")["jobs-finished"] + isolated.rest("/overview")["jobs-running"]
    with pytest.raises(OutputUnusable, match=f"output_dir: {local} is a local path, but the PortableRunner workers"):
        tokenize(tokenize_config(sources, str(local)), isolated.args)
    overview = isolated.rest("/overview")
    assert overview["jobs-finished"] + overview["jobs-running"] == finished and not local.exists(), "refused before any job"


@pytest.fixture(scope="module")
def sample(object_stores, tmp_path_factory: pytest.TempPathFactory) -> tuple[SampleCorpus, str]:
    """The sample corpus's input files on a fresh gs:// bucket: (the sample, the bucket)."""
    sample = write_sample_corpus(tmp_path_factory.mktemp("isolated-input"))
    root = Path(sample.web_glob).parents[1]
    bucket = _new_bucket("gs")
    storage.preflight(bucket, write=True)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        storage.upload(path, f"{bucket}/input/{path.relative_to(root).as_posix()}")
    return sample, bucket


def sample_config(sample: tuple[SampleCorpus, str], output: str):
    corpus, bucket = sample
    config = corpus.config(output)
    root = str(Path(corpus.web_glob).parents[1])
    for source in config["sources"]:
        source["inputs"] = [pattern.replace(root, f"{bucket}/input") for pattern in source["inputs"]]
    return parse_config(config)


def remote_digests(location: str) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in shard_files(location).items()}


def test_a_taskmanager_killed_mid_build_is_recovered_with_identical_output(isolated: Cluster, sample, tmp_path) -> None:
    """kill -9 of TaskManager 1 once the job's tasks run: Flink declares it lost (6 s heartbeat), restarts the job
    (fixed-delay), its supervisor restarts the JVM, and the output on gs:// is the FnApiRunner bytes."""
    assert build(sample_config(sample, str(tmp_path / "fnapi"))) == "DONE"
    reference = file_digests(tmp_path / "fnapi")
    output = f"{sample[1]}/kill-out"
    known = {j["jid"] for j in isolated.rest("/jobs/overview")["jobs"]}
    outcome: dict[str, object] = {}

    def run_build() -> None:
        try:
            outcome["state"] = build(sample_config(sample, output), isolated.args)
        except Exception as exc:  # reported by the assertion below
            outcome["error"] = exc

    worker = threading.Thread(target=run_build)
    worker.start()
    job = None
    deadline = time.monotonic() + 300
    while job is None and time.monotonic() < deadline and worker.is_alive():
        running = [j for j in isolated.rest("/jobs/overview")["jobs"] if j["jid"] not in known and j["state"] == "RUNNING"]
        if running and running[0]["tasks"]["finished"] >= 4:
            job = running[0]["jid"]
        time.sleep(0.5)
    assert job, f"no job of this build reached its running tasks: {outcome}"
    victim = int(isolated.script("tm-pid", "1"))
    os.kill(victim, signal.SIGKILL)
    worker.join(timeout=600)
    assert not worker.is_alive(), "the build did not finish within 10 minutes of the kill"
    assert outcome.get("state") == "DONE", outcome
    assert remote_digests(output) == reference, "nothing doubled or lost after the restart"
    history = isolated.rest(f"/jobs/{job}/exceptions")["exceptionHistory"]["entries"]
    assert history, "Flink recorded the lost TaskManager as a failure it recovered from"
    assert isolated.rest("/overview")["taskmanagers"] >= 2
