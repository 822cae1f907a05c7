"""The tokenize job as Dataflow would receive it names nothing on this machine's disk: its workers share none. The
graph is rendered for Beam's DataflowRunner (no submit, no network beyond the local fake-gcs-server its sources sit
on), and every pickled function in the pipeline proto and every option is searched for `file://` and for absolute
paths that exist here. A local output, source or tokenizer file with such a runner is refused before any work."""

from __future__ import annotations

import base64
import bz2
import os
import re
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from ember import storage
from ember.pipelines.jobs.output_guard import OutputUnusable
from ember.pipelines.tokenize_pipeline import build, run
from ember.tokenize.config import TokenizeConfig
from ember.tokenize.tokenizers import load_tokenizer
from tests.tokenize.support import mixed_documents, write_documents

pytestmark = pytest.mark.integration

DATAFLOW = ["--runner=DataflowRunner", "--project=ember-prod", "--region=us-central1",
            "--temp_location=gs://ember-corpus/tmp", "--sdk_container_image=us-docker.pkg.dev/ember-prod/corpus/ember:1"]
PICKLED = re.compile(rb"QlpoOTFB[A-Za-z0-9+/]+=*")
ABSOLUTE_PATH = re.compile(rb"/[\w.@+-]+(?:/[\w.@+-]+)*")


def config(sources: dict[str, str], output_dir: str, tokenizer: dict | None = None) -> TokenizeConfig:
    return TokenizeConfig(
        output_dir=output_dir, seq_len=128, window_documents=16, sequences_per_shard=8, rows_per_batch=4,
        tokenizer=tokenizer or {"name": "cl100k_base"},
        sources=[{"name": name, "path": path} for name, path in sources.items()],
    )


def pickled_objects(proto: bytes) -> list[bytes]:
    """Every pickled object in a serialized pipeline (functions, configs, coders), as the pickle bytes a worker
    unpickles: Beam stores each as base64 of its bz2 stream, which begins "BZh9" ("QlpoOTFB" in base64)."""
    return [bz2.decompress(base64.b64decode(blob)) for blob in PICKLED.findall(proto)]


def local_paths(data: bytes) -> set[str]:
    """`file://` URLs and absolute paths that exist on this machine, in `data`; not Python source files, which a
    function pickled by value names for its tracebacks only (`co_filename`)."""
    found = {m.decode() for m in ABSOLUTE_PATH.findall(data)}
    hits = {p for p in found if len(p) > 1 and not p.endswith(".py") and os.path.exists(p)}
    return hits | ({"file://"} if b"file://" in data else set())


def test_the_rendered_dataflow_job_names_no_local_path(gs_bucket, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    docs = mixed_documents(copies=1)
    sources = {}
    for name in ("code", "web"):
        local = write_documents(tmp_path / "in" / name / "part-0.parquet", docs[name])
        storage.upload(local, f"{gs_bucket}/in/{name}/part-0.parquet")
        sources[name] = f"{gs_bucket}/in/{name}/*.parquet"
    settings = config(sources, f"{gs_bucket}/shards")
    # dry_run while the Pipeline checks its options, as `ember corpus dataflow-render` does: no bucket probes.
    pipeline = beam.Pipeline(options=PipelineOptions([*DATAFLOW, "--dry_run=True"]))
    build(pipeline, settings, load_tokenizer(settings.tokenizer))
    proto = pipeline.to_runner_api()

    serialized = proto.SerializeToString()
    pickled = pickled_objects(serialized)
    assert len(pickled) > 20 and any(sources["web"].encode() in data for data in pickled), "the scan reads the configs"
    assert any(b"WriteShard" in data for data in pickled) and any(b"_finish" in data for data in pickled)
    assert not [hits for data in pickled if (hits := local_paths(data))]
    assert not local_paths(serialized)
    options = repr(sorted(pipeline.options.get_all_options(drop_default=True).items())).encode()
    assert not local_paths(options), options
    # The check can fail: the same graph given a local progress folder (what a local run gets) names it.
    progress = tmp_path / "progress"
    progress.mkdir()
    leaking = beam.Pipeline(options=PipelineOptions([*DATAFLOW, "--dry_run=True"]))
    build(leaking, settings, load_tokenizer(settings.tokenizer), progress_dir=str(progress))
    assert str(progress) in set().union(*map(local_paths, pickled_objects(leaking.to_runner_api().SerializeToString())))


@pytest.mark.parametrize("where", ["output_dir", "sources.0.path", "tokenizer.path"])
def test_a_local_path_with_workers_that_share_no_disk_is_refused_before_any_work(where, tmp_path) -> None:
    remote = "gs://ember-no-such-bucket"  # never reached: the refusal comes first
    local = str(tmp_path / "x")
    settings = config(
        {"web": local if where == "sources.0.path" else f"{remote}/in/*.parquet"},
        local if where == "output_dir" else f"{remote}/out",
        {"path": local} if where == "tokenizer.path" else None,
    )
    with pytest.raises(OutputUnusable) as refused:
        run(settings, DATAFLOW)
    message = str(refused.value)
    assert message.startswith(f"{where}: {local} is a local path, but the DataflowRunner workers do not share"), message
    assert ("tokenizer.name" if where == "tokenizer.path" else "gs://BUCKET/... or s3://BUCKET/...") in message
    assert "\n" not in message and not Path(local).exists()
