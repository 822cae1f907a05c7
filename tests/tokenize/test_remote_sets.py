"""Readers of shard sets on the real local object stores (infra/objectstores.sh): `ember corpus verify | inspect`,
`ember export megatron` and the mid-training loader take gs:// and s3:// URLs as they take paths."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ember import storage
from ember.cli import app
from tests.tokenize.test_shardset import squeezed, write_shard_set

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Local copies of remote sets and verified-once markers go to this test's tmp dir."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(params=["gs", "s3"])
def bucket(request) -> str:
    return request.getfixturevalue(f"{request.param}_bucket")


def upload_set(local: Path, url: str) -> str:
    """The local set's files under `url`, its manifest last (as a writer commits a set)."""
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file() and p.name != "manifest.json")
    for name in names:
        storage.upload(local / name, storage.join(url, name))
    storage.upload(local / "manifest.json", storage.join(url, "manifest.json"))
    return url


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_verify_a_set_on_an_object_store_and_catch_a_changed_or_unfinished_one(tmp_path, bucket):
    shard = write_shard_set(tmp_path / "set")
    url = upload_set(tmp_path / "set", f"{bucket}/shards")
    result = invoke("corpus", "verify", url)
    assert result.exit_code == 0, result.output
    assert squeezed(f"OK {url}: every shard matches its manifest") in squeezed(result.output)

    data = bytearray(shard.read_bytes())
    data[-20] ^= 0xFF  # same size: only the hash can tell, and verify downloads afresh
    storage.write_bytes(f"{url}/shard-00000.arrow", bytes(data))
    result = invoke("corpus", "verify", url)
    assert result.exit_code == 1 and "shard-00000.arrow: sha256 mismatch" in " ".join(result.output.split())

    storage.delete([f"{url}/manifest.json"])  # what an interrupted writer leaves: shards, no manifest
    result = invoke("corpus", "verify", url)
    assert result.exit_code == 2
    assert squeezed(f"{url}/manifest.json does not exist: {url} is not a finished shard set; {url} holds 1 files and "
                    "no manifest.json") in squeezed(result.output)


@pytest.mark.parametrize(
    "url, message",
    [
        ("gcs://bucket/shards", "gcs://bucket/shards: unknown scheme 'gcs'"),
        ("s3:///shards", "s3:///shards: no bucket name after s3://"),
        ("gs://ember-no-such-bucket/shards", "gs://ember-no-such-bucket/shards: bucket 'ember-no-such-bucket' does not exist"),
        ("s3://ember-no-such-bucket/shards", "s3://ember-no-such-bucket/shards: bucket 'ember-no-such-bucket' does not exist"),
    ],
)
def test_verify_names_a_bad_url_and_exits_non_zero(url, message, object_stores):
    result = invoke("corpus", "verify", url)
    assert result.exit_code == 2 and squeezed(message) in squeezed(result.output), result.output


def test_inspect_a_shard_by_its_url(tmp_path, s3_bucket):
    write_shard_set(tmp_path / "set")
    url = upload_set(tmp_path / "set", f"{s3_bucket}/deep/shards")
    result = invoke("corpus", "inspect", "--locate", f"{url}/shard-00000.arrow", "1", "1")
    assert squeezed(f"shard {url}/shard-00000.arrow row 1 token 1: id 2, source code") in squeezed(result.output)
    assert squeezed("document d1 token 1") in squeezed(result.output)
    # the hand-written set records no provenance, as in test_shardset's local case: exit 1, said plainly
    assert result.exit_code == 1 and squeezed("the manifest records no provenance") in squeezed(result.output)
    loose = invoke("corpus", "inspect", "--locate", f"{s3_bucket}/elsewhere/shard-00000.arrow", "0", "0")
    assert loose.exit_code == 2 and squeezed("no manifest.json in its directory or above") in squeezed(loose.output)


def test_export_megatron_from_s3_to_gs_matches_the_local_export(tmp_path, s3_bucket, gs_bucket):
    write_shard_set(tmp_path / "set", rows=5)
    url = upload_set(tmp_path / "set", f"{s3_bucket}/shards")
    local = invoke("export", "megatron", str(tmp_path / "set"), str(tmp_path / "out" / "data"))
    assert local.exit_code == 0, local.output
    remote = invoke("export", "megatron", url, f"{gs_bucket}/megatron/data")
    assert remote.exit_code == 0, remote.output
    for ext in ("bin", "idx"):
        assert storage.read_bytes(f"{gs_bucket}/megatron/data.{ext}") == (tmp_path / "out" / f"data.{ext}").read_bytes()
    missing = invoke("export", "megatron", url, "gs://ember-no-such-bucket/data")
    assert missing.exit_code == 2 and squeezed("bucket 'ember-no-such-bucket' does not exist") in squeezed(missing.output)


def test_midtrain_trains_a_step_from_shards_on_s3(tmp_path, s3_bucket, cache):
    """One rank, one step of the tiny MoE model on a set read from s3:// (torchrun and megatron-core start: ~1 min on
    2 idle cores)."""
    from ember.midtrain.config import load_config
    from ember.midtrain.data import DataError
    from ember.midtrain.launch import check_data
    from tests.midtrain.configs import tiny_run

    config_path = tiny_run(tmp_path / "run", steps=1, save_interval=1)
    config = yaml.safe_load(config_path.read_text())
    config["schedule"] = {"warmup_steps": 0, "decay_steps": 1}
    config["data"]["shard_sets"] = [
        {"path": upload_set(tmp_path / "run" / "code", f"{s3_bucket}/code"), "weight": 0.7},
        {"path": "web", "weight": 0.3},
    ]
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    result = subprocess.run(
        [sys.executable, "-m", "ember.midtrain.cli", "train", str(config_path), "--nproc-per-node", "1", "--threads", "1"],
        capture_output=True, text=True, timeout=480,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    metrics = [yaml.safe_load(line) for line in (tmp_path / "run" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1] and set(metrics[0]["source_loss"]) <= {"code", "web"}
    assert list(cache.glob("objects/*/shard-*.arrow"))  # the s3 set was read through its local copy

    config["data"]["shard_sets"][0]["path"] = f"{s3_bucket}/nothing-here"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(DataError, match=re.escape(f"{s3_bucket}/nothing-here/manifest.json does not exist")):
        check_data(load_config(config_path))  # what `midtrain train` runs before it starts any rank
