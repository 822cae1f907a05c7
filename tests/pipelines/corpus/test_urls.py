"""`ember corpus build` between object stores (the real local fake-gcs-server and moto S3 of infra/objectstores.sh):
inputs read from one store, documents, rejects, clusters, stats, report and the shard set written to the other, the
bytes the same as the same build writing to local disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ember import storage
from ember.cli import app
from ember.demo.sample_corpus import SampleCorpus, write_sample_corpus
from ember.pipelines.corpus.build import build_corpus
from ember.pipelines.corpus.config import parse_config
from ember.pipelines.jobs.output_guard import OutputUnusable
from tests.conftest import _new_bucket
from tests.pipelines.corpus.test_build import with_tokenize

pytestmark = pytest.mark.integration
# Name the build's place (report pages) or its inputs and output (the manifest's hash and provenance); compared apart.
NAMES_PLACES = {"report.md", "report.html", "manifest.json", ".ember-output.json"}


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleCorpus:
    return write_sample_corpus(tmp_path_factory.mktemp("url-input"))


@pytest.fixture(scope="module")
def stores(object_stores, sample: SampleCorpus) -> dict[str, str]:
    """The sample's input files on a fresh s3:// bucket and a fresh gs:// bucket; scheme -> bucket URL."""
    root = Path(sample.web_glob).parents[1]
    buckets = {scheme: _new_bucket(scheme) for scheme in ("s3", "gs")}
    for bucket in buckets.values():
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            storage.upload(path, f"{bucket}/input/{path.relative_to(root).as_posix()}")
    return buckets


def config_for(sample: SampleCorpus, tokenizer: Path, inputs: str | None, output: str) -> dict:
    """The sample build with tokenize, reading its inputs under `inputs` (a bucket URL; None: local disk)."""
    config = with_tokenize(sample.config(output), tokenizer)
    if inputs is not None:
        root = str(Path(sample.web_glob).parents[1])
        for source in config["sources"]:
            source["inputs"] = [pattern.replace(root, f"{inputs}/input") for pattern in source["inputs"]]
    return config


def outputs(location: str | Path) -> dict[str, bytes]:
    return {name: storage.read_bytes(storage.join(location, name)) for name in storage.list_files(location)}


def manifest_fields(data: bytes) -> dict:
    return {k: v for k, v in json.loads(data).items() if k not in {"created_at", "config_hash", "provenance"}}


@pytest.mark.parametrize("source, target", [("s3", "gs"), ("gs", "s3")])
def test_a_build_between_stores_writes_what_the_local_build_writes(
    source, target, sample, stores, hf_tokenizer_path, tmp_path
) -> None:
    """Two builds with the tokenize stage (~1 min each on 2 busy cores, mostly Beam's fixed costs): the same inputs on
    `source` written once to local disk and once to `target`."""
    local_out = tmp_path / "local"
    build_corpus(parse_config(config_for(sample, hf_tokenizer_path, stores[source], str(local_out))), ["--runner=FnApiRunner"])
    remote_out = f"{stores[target]}/out-from-{source}"
    outcome = build_corpus(parse_config(config_for(sample, hf_tokenizer_path, stores[source], remote_out)),
                           ["--runner=FnApiRunner"])
    local, remote = outputs(local_out), outputs(remote_out)
    assert set(remote) == set(local) - {".ember-output.json"}
    kinds = {name.split("/")[0] for name in remote}
    assert {"documents", "rejects", "clusters", "shards", "stats.json", "report.md", "report.html"} <= kinds
    assert {n: b for n, b in remote.items() if Path(n).name not in NAMES_PLACES} == {
        n: b for n, b in local.items() if Path(n).name not in NAMES_PLACES
    }
    assert manifest_fields(remote["shards/manifest.json"]) == manifest_fields(local["shards/manifest.json"])
    assert outcome.shards is not None and outcome.shards.num_sequences > 0
    verified = CliRunner().invoke(app, ["corpus", "verify", f"{remote_out}/shards"])
    assert verified.exit_code == 0, verified.output
    report = CliRunner().invoke(app, ["corpus", "report", remote_out])
    assert report.exit_code == 0, report.output


def _build_cli(tmp_path: Path, config: dict):
    path = tmp_path / "corpus.yaml"
    path.write_text(yaml.safe_dump(config))
    return CliRunner().invoke(app, ["corpus", "build", str(path), "--runner=FnApiRunner"])


@pytest.mark.parametrize(
    "where, url, message",
    [
        ("output", "gs://ember-no-such-bucket/out", "gs://ember-no-such-bucket/out: bucket 'ember-no-such-bucket' does not exist"),
        ("output", "s3:///out", "s3:///out: no bucket name after s3://"),
        ("output", "gcs://bucket/out", "gcs://bucket/out: unknown scheme 'gcs'"),
        ("input", "s3://ember-no-such-bucket", "s3://ember-no-such-bucket/input/web/*.jsonl: bucket 'ember-no-such-bucket' does not exist"),
    ],
)
def test_a_bad_url_fails_before_any_work_naming_it(
    where, url, message, sample, stores, hf_tokenizer_path, tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a build to a URL leaves nothing in the working directory (its log goes beside the output)
    inputs, output = (url, str(tmp_path / "out")) if where == "input" else (stores["s3"], url)
    result = _build_cli(tmp_path, config_for(sample, hf_tokenizer_path, inputs, output))
    assert result.exit_code != 0
    assert "".join(message.split()) in "".join(result.output.split()), result.output
    assert not (tmp_path / "out").exists()


def test_leftovers_of_an_interrupted_shard_commit_are_refused_before_any_work(sample, stores, hf_tokenizer_path, tmp_path):
    shards = f"{stores['gs']}/half/shards"
    storage.write_bytes(f"{shards}/shard-00000.arrow", b"half a set")
    config = config_for(sample, hf_tokenizer_path, stores["s3"], f"{stores['gs']}/half")
    with pytest.raises(OutputUnusable, match=f"{shards} holds 1 files and no manifest.json"):
        build_corpus(parse_config(config), ["--runner=FnApiRunner"])
    assert storage.list_files(f"{stores['gs']}/half") == {"shards/shard-00000.arrow": 10}, "no work started"


def test_a_config_on_an_object_store_is_read_from_its_url(sample, stores, hf_tokenizer_path, tmp_path, monkeypatch) -> None:
    """The config argument is a URL string, not a Path (which folds gs:// into gs:/): the build reads it, then stops at
    its unusable output before any work; a missing config is named by its URL."""
    monkeypatch.chdir(tmp_path)
    config = f"{stores['gs']}/configs/corpus.yaml"
    output = "s3://ember-no-such-bucket/out"
    storage.write_bytes(config, yaml.safe_dump(config_for(sample, hf_tokenizer_path, stores["s3"], output)).encode())
    result = CliRunner().invoke(app, ["corpus", "build", config, "--runner=FnApiRunner"])
    assert result.exit_code == 2, result.output
    assert f"{output}: bucket 'ember-no-such-bucket' does not exist" in " ".join(result.output.split())
    missing = f"{stores['gs']}/configs/missing.yaml"
    result = CliRunner().invoke(app, ["corpus", "build", missing])
    assert result.exit_code == 2 and f"{missing}: cannot read the config file" in " ".join(result.output.split()), result.output
