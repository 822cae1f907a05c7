"""`ember corpus tokenize` between the real local object stores (infra/objectstores.sh): sources on s3://, the shard
set on gs://, the config itself read from a URL; the set committed shards first, manifest last, and refused rather
than mixed on a rerun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import boto3
import botocore.exceptions
import pytest
import yaml
from typer.testing import CliRunner

from ember import storage
from ember.cli import app
from tests.tokenize.support import mixed_documents, write_documents

pytestmark = pytest.mark.integration

VARIES_WITH_PLACE = ("created_at", "config_hash", "provenance")  # the hash covers the source paths


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Local copies of remote sets go to this test's tmp dir, which is also the working directory (a tokenize to a URL
    must leave nothing there)."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result.exit_code, " ".join(result.output.split())


def config(tokenizer, sources: dict[str, str], output_dir: str) -> dict:
    return {
        "output_dir": output_dir, "seq_len": 128, "window_documents": 16, "sequences_per_shard": 8, "rows_per_batch": 4,
        "seed": 3,
        "tokenizer": {"kind": "huggingface", "path": str(tokenizer), "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"},
        "sources": [{"name": name, "path": path} for name, path in sources.items()],
    }


@pytest.fixture
def inputs(tmp_path, s3_bucket) -> dict[str, dict[str, str]]:
    """The same two Parquet sources on local disk and on s3://."""
    docs = mixed_documents(copies=1)
    local, remote = {}, {}
    for name in ("code", "web"):
        path = write_documents(tmp_path / "in" / name / "part-0.parquet", docs[name])
        storage.upload(path, f"{s3_bucket}/in/{name}/part-0.parquet")
        local[name] = str(tmp_path / "in" / name / "*.parquet")
        remote[name] = f"{s3_bucket}/in/{name}/*.parquet"
    return {"local": local, "remote": remote}


def test_s3_sources_to_gs_output_write_the_local_bytes_and_a_rerun_is_refused(tmp_path, inputs, s3_bucket, gs_bucket,
                                                                               hf_tokenizer_path):
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(config(hf_tokenizer_path, inputs["local"], str(tmp_path / "out"))))
    code, output = invoke("corpus", "tokenize", tmp_path / "local.yaml")
    assert code == 0, output
    out = f"{gs_bucket}/shards"
    remote_config = f"{s3_bucket}/configs/tokenize.yaml"  # a URL config: `config: Path` would have read gs:/...
    storage.write_bytes(remote_config, yaml.safe_dump(config(hf_tokenizer_path, inputs["remote"], out)).encode())
    code, output = invoke("corpus", "tokenize", remote_config)
    assert code == 0, output
    assert f"shards in {out}" in output and "tokenize: progress" in output
    assert f"(copied to {out}.log when the job ends)" in output
    assert b"beam job ended: tokenize" in storage.read_bytes(f"{out}.log"), "the job's log is beside its URL output"
    assert not (tmp_path / "shards.log").exists(), "nothing of a URL output's job lands in the working directory"

    local = storage.list_files(tmp_path / "out")
    assert storage.list_files(out).keys() == local.keys()
    for name in local:
        if name != "manifest.json":
            assert storage.read_bytes(storage.join(out, name)) == (tmp_path / "out" / name).read_bytes(), name
    manifests = [json.loads(storage.read_bytes(storage.join(d, "manifest.json"))) for d in (str(tmp_path / "out"), out)]
    for manifest in manifests:
        for key in VARIES_WITH_PLACE:
            manifest.pop(key)
    assert manifests[0] == manifests[1]
    code, output = invoke("corpus", "verify", out)
    assert code == 0 and f"OK {out}: every shard matches its manifest" in output, output

    code, output = invoke("corpus", "tokenize", remote_config)
    assert code == 2 and f"output_dir: {out} holds a finished set" in output and "--overwrite" in output, output
    storage.write_bytes(f"{out}/set-0123456789ab/shard-000000.arrow", b"a failed replacement's leftover")
    code, output = invoke("corpus", "tokenize", remote_config, "--overwrite")
    assert code == 0, output
    # The new set went under a fresh prefix beside the old one and the manifest switched to it in one write; the old
    # set's files and the failed replacement's leftover were deleted after the switch.
    manifest = json.loads(storage.read_bytes(storage.join(out, "manifest.json")))
    prefix = manifest["shards"][0]["path"].split("/")[0]
    assert prefix.startswith("set-") and manifest["rejected_file"] == f"{prefix}/rejected.parquet"
    replaced = storage.list_files(out)
    assert replaced.keys() == {"manifest.json"} | {f"{prefix}/{name}" for name in local if name != "manifest.json"}
    for name in local:
        if name != "manifest.json":
            assert storage.read_bytes(f"{out}/{prefix}/{name}") == (tmp_path / "out" / name).read_bytes(), name
    assert invoke("corpus", "verify", out)[0] == 0

    storage.delete([storage.join(out, "manifest.json")])  # what an interrupted commit leaves: shards, no manifest
    code, output = invoke("corpus", "tokenize", remote_config, "--overwrite")
    assert code == 2 and f"{out} holds {len(local) - 1} files and no manifest.json" in output, output
    assert storage.list_files(out).keys() == replaced.keys() - {"manifest.json"}  # nothing deleted


@pytest.mark.parametrize(
    "output_dir, message",
    [
        ("gcs://bucket/shards", "gcs://bucket/shards: unknown scheme 'gcs'"),
        ("gs://ember-no-such-bucket/shards", "gs://ember-no-such-bucket/shards: bucket 'ember-no-such-bucket' does not exist"),
        ("s3://ember-no-such-bucket/shards", "s3://ember-no-such-bucket/shards: bucket 'ember-no-such-bucket' does not exist"),
    ],
)
def test_a_bad_output_url_fails_before_any_work_naming_it(tmp_path, inputs, output_dir, message, hf_tokenizer_path):
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(config(hf_tokenizer_path, inputs["local"], output_dir)))
    code, output = invoke("corpus", "tokenize", tmp_path / "t.yaml")
    assert code == 2 and message in output, output
    assert "tokenize: progress" not in output  # the pipeline never started


def test_a_bad_source_bucket_fails_before_any_work_naming_it(tmp_path, gs_bucket, hf_tokenizer_path):
    source = "s3://ember-no-such-bucket/in/*.parquet"
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(config(hf_tokenizer_path, {"web": source}, f"{gs_bucket}/out")))
    code, output = invoke("corpus", "tokenize", tmp_path / "t.yaml")
    assert code == 2 and f"{source}: bucket 'ember-no-such-bucket' does not exist" in output, output
    assert storage.list_files(f"{gs_bucket}/out") == {}


@pytest.fixture(scope="module")
def locked_s3() -> Iterator[dict[str, str]]:
    """A second moto S3 server, on a free port, that enforces IAM (INITIAL_NO_AUTH_ACTION_COUNT: the first three
    requests are let through to create bucket `locked` and a user with no policy and its keys): the client settings
    of that user, who may do nothing on S3. Stopped after the module."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, f"moto_server on {endpoint} did not start"
                time.sleep(0.1)
        admin = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "admin",
                 "aws_secret_access_key": "admin"}
        boto3.client("s3", **admin).create_bucket(Bucket="locked")
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        yield {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
               "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"], "AWS_DEFAULT_REGION": "us-east-1"}
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_no_permission_on_the_output_bucket_fails_before_any_work_naming_it(tmp_path, inputs, locked_s3, monkeypatch,
                                                                             hf_tokenizer_path):
    for name, value in locked_s3.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(botocore.exceptions.ClientError, match="AccessDenied"):  # the store knows and refuses this user
        boto3.session.Session().client("s3").list_objects_v2(Bucket="locked")
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(config(hf_tokenizer_path, inputs["local"], "s3://locked/out")))
    code, output = invoke("corpus", "tokenize", tmp_path / "t.yaml")
    assert code == 2 and "s3://locked/out: permission denied on bucket 'locked'" in output, output
    assert "tokenize: progress" not in output  # the pipeline never started


def test_a_missing_config_url_is_named(gs_bucket):
    missing = f"{gs_bucket}/configs/missing.yaml"
    code, output = invoke("corpus", "tokenize", missing)
    assert code == 2 and f"{missing}: cannot read the config file" in output, output
