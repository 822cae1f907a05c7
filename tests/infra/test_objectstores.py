"""The local object stores (infra/objectstores.sh) and the URL layer (ember/storage.py) against them: real
fake-gcs-server and moto S3 servers, reached through the standard client settings only."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from ember import storage
from tests.ports import free_port, free_ports

from .infra_support import REPO, ember_home

pytestmark = pytest.mark.integration


def _script(env: dict[str, str], action: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(REPO / "infra" / "objectstores.sh"), action], capture_output=True, text=True, env=env,
        timeout=180, stdin=subprocess.DEVNULL,
    )


def _status(env: dict[str, str]) -> dict[str, str]:
    lines = _script(env, "status").stdout.strip().splitlines()
    return {line.split("\t")[0]: line.split("\t")[1] for line in lines}


def test_stores_start_from_nothing_idempotently_and_stop(tmp_path: Path, object_stores) -> None:
    """A second pair of stores on free ports under a fresh EMBER_HOME (the fake-gcs-server binary reused from the
    shared cache, which the object_stores fixture built): start serves both, a second start reuses the same
    processes, stop ends them and frees the ports."""
    home = tmp_path / "home"
    cached = ember_home() / "cache" / "fake-gcs-server"
    (home / "cache").mkdir(parents=True)
    (home / "cache" / "fake-gcs-server").symlink_to(cached)
    gcs_port, s3_port = free_ports(2)
    env = {**os.environ, "EMBER_HOME": str(home), "EMBER_GCS_PORT": str(gcs_port), "EMBER_S3_PORT": str(s3_port)}
    assert _status(env) == {"gcs": "stopped", "s3": "stopped"}
    try:
        first = _script(env, "start")
        assert first.returncode == 0, first.stderr
        assert _status(env) == {"gcs": "running", "s3": "running"}
        pids = {p.name: p.read_text() for p in (home / "run").glob("*.pid")}
        assert set(pids) == {"fake-gcs-server.pid", "moto-s3.pid"}
        again = _script(env, "start")
        assert again.returncode == 0, again.stderr
        assert "already running" in again.stderr
        assert {p.name: p.read_text() for p in (home / "run").glob("*.pid")} == pids
        settings = dict(
            line.removeprefix("export ").split("=", 1) for line in _script(env, "env").stdout.splitlines()
        )
        assert settings["STORAGE_EMULATOR_HOST"] == f"http://127.0.0.1:{gcs_port}"
        assert settings["AWS_ENDPOINT_URL"] == f"http://127.0.0.1:{s3_port}"
    finally:
        stopped = _script(env, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert _status(env) == {"gcs": "stopped", "s3": "stopped"}
    for port in (gcs_port, s3_port):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0


def test_start_refuses_a_port_taken_by_another_process(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "EMBER_HOME": str(tmp_path), "EMBER_GCS_PORT": str(port), "EMBER_S3_PORT": str(free_port())}
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "fake-gcs-server").symlink_to(ember_home() / "cache" / "fake-gcs-server")
        result = _script(env, "start")
    assert result.returncode != 0
    assert f"port 127.0.0.1:{port} is taken by a process this script did not start" in result.stderr


@pytest.fixture(params=["gs", "s3"])
def bucket(request) -> str:
    return request.getfixturevalue(f"{request.param}_bucket")


def test_beam_filesystems_write_read_list_delete(bucket: str) -> None:
    """Beam's own FileSystems (what pipeline workers use) and the URL layer agree on both stores."""
    from apache_beam.io.filesystems import FileSystems

    base = f"{bucket}/dir"
    storage.write_bytes(f"{base}/a.bin", b"alpha")
    storage.write_bytes(f"{base}/sub/b.bin", b"bravo!")
    assert FileSystems.open(f"{base}/a.bin").read() == b"alpha"
    assert storage.read_bytes(f"{base}/sub/b.bin") == b"bravo!"
    assert storage.list_files(base) == {"a.bin": 5, "sub/b.bin": 6}
    assert sorted(m.path for m in FileSystems.match([f"{base}/*.bin"])[0].metadata_list) == [f"{base}/a.bin"]
    storage.delete([f"{base}/a.bin"])
    assert not storage.exists(f"{base}/a.bin") and storage.exists(f"{base}/sub/b.bin")
    with pytest.raises(FileNotFoundError, match=re.escape(f"{base}/a.bin")):
        storage.read_bytes(f"{base}/a.bin")


def _local_set(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_a_set_is_committed_manifest_last_and_a_half_written_one_is_refused(bucket: str, tmp_path: Path) -> None:
    out = f"{bucket}/shards"
    assert storage.prepare_output(out).files == {}
    storage.write_bytes(f"{out}/shard-00000.arrow", b"x" * 10)  # what an interrupted commit leaves: no manifest
    state = storage.output_state(out)
    assert not state.finished and state.leftovers == ["shard-00000.arrow"]
    with pytest.raises(storage.StorageError, match=re.escape(f"{out} holds 1 files and no manifest.json: what an "
                                                             "interrupted run left behind (shard-00000.arrow)")):
        storage.prepare_output(out)
    storage.delete([f"{out}/shard-00000.arrow"])
    with pytest.raises(storage.StorageError, match="no manifest.json: not a finished set, nothing committed"):
        storage.commit_files(_local_set(tmp_path / "unfinished", {"a.arrow": b"a"}), out)
    assert storage.list_files(out) == {}
    local = _local_set(tmp_path / "set", {"shard-0.arrow": b"aaa", "sub/shard-1.arrow": b"bbbb", "manifest.json": b"{}"})
    storage.commit_files(local, out)
    assert storage.list_files(out) == {"shard-0.arrow": 3, "sub/shard-1.arrow": 4, "manifest.json": 2}
    with pytest.raises(storage.StorageError, match="holds a finished set"):
        storage.prepare_output(out)


def test_fetch_set_copies_the_listed_files(bucket: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    storage.commit_files(_local_set(tmp_path / "set", {"s/0.arrow": b"zero", "s/1.arrow": b"one", "manifest.json": b"{}"}),
                         f"{bucket}/set")
    local = storage.fetch_set(f"{bucket}/set", {"s/0.arrow": 4, "s/1.arrow": 3}, b"{}")
    assert (local / "s/0.arrow").read_bytes() == b"zero" and (local / "s/1.arrow").read_bytes() == b"one"
    assert (local / "manifest.json").read_bytes() == b"{}"
    storage.write_bytes(f"{bucket}/set/s/1.arrow", b"ONE")  # same size: the cached copy stays, unless refreshed
    assert (storage.fetch_set(f"{bucket}/set", {"s/0.arrow": 4, "s/1.arrow": 3}, b"{}") / "s/1.arrow").read_bytes() == b"one"
    refreshed = storage.fetch_set(f"{bucket}/set", {"s/0.arrow": 4, "s/1.arrow": 3}, b"{}", refresh=True)
    assert (refreshed / "s/1.arrow").read_bytes() == b"ONE"
    assert local.is_relative_to(tmp_path / "cache")


# ------------------------------------------------------------- preflight --


@pytest.mark.parametrize(
    "url, message",
    [
        ("gcs://bucket/x", "unknown scheme 'gcs'"),
        ("s3:///x", "no bucket name after s3://"),
        ("gs://My_Bucket/x", "'My_Bucket' is not a valid gs:// bucket name"),
        ("s3://a/x", "'a' is not a valid s3:// bucket name"),
    ],
)
def test_preflight_names_a_typo_in_the_url(url: str, message: str) -> None:
    with pytest.raises(storage.StorageError, match=re.escape(f"{url}: {message}")):
        storage.preflight(url)


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_preflight_names_a_missing_bucket(scheme: str, object_stores) -> None:
    url = f"{scheme}://ember-no-such-bucket/out"
    with pytest.raises(storage.StorageError, match=re.escape(f"{url}: bucket 'ember-no-such-bucket' does not exist")):
        storage.preflight(url)


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_preflight_names_an_unreachable_endpoint(scheme: str, object_stores, monkeypatch) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST" if scheme == "gs" else "AWS_ENDPOINT_URL", closed)
    url = f"{scheme}://ember-any-bucket/out"
    with pytest.raises(storage.StorageError, match=re.escape(f"{url}: storage endpoint {closed}") + ".* unreachable"):
        storage.preflight(url)


def test_preflight_names_missing_credentials(object_stores, monkeypatch, tmp_path: Path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(storage.StorageError, match=re.escape("s3://ember-any-bucket/out: no AWS credentials")):
        storage.preflight("s3://ember-any-bucket/out")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    with pytest.raises(storage.StorageError, match=re.escape("gs://ember-any-bucket/out: no Google credentials")):
        storage.preflight("gs://ember-any-bucket/out")


def test_preflight_for_writing_creates_and_deletes_a_probe(bucket: str) -> None:
    storage.preflight(f"{bucket}/out", write=True)
    assert storage.list_files(bucket) == {}


def test_dev_up_starts_the_stores_and_status_lists_them(object_stores) -> None:
    from ember.dev import services

    assert "objectstores" in services.SERVICES, "ember dev up starts the object stores by default"
    listed = {s.name: s for s in services.status()}
    assert (listed["gcs"].state, listed["gcs"].address) == ("running", object_stores["STORAGE_EMULATOR_HOST"])
    assert (listed["s3"].state, listed["s3"].address) == ("running", object_stores["AWS_ENDPOINT_URL"])
    dev = subprocess.run(["bash", str(REPO / "infra" / "dev.sh"), "status"], capture_output=True, text=True, timeout=120)
    rows = [line.split("\t")[:2] for line in dev.stdout.splitlines()]
    assert ["gcs", "running"] in rows and ["s3", "running"] in rows
