"""The whole corpus build on a mixed code + web sample: FnApiRunner (in-process and the multi-process
default), the Flink runner (embedded Flink via the job-server jar), the CLI, the report and the demo."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from ember.configs import CorpusConfigError
from ember.dev import services
from tests.conftest import start
from ember.pipelines.cli import app
from ember.pipelines.corpus.build import build_corpus
from ember.pipelines.corpus.config import parse_config
from ember.pipelines.corpus.report import read_stats
from ember.pipelines.jobs.output_guard import OWNERSHIP_FILE
from ember.demo.sample_corpus import SampleCorpus, write_sample_corpus
from ember.schemas.documents import CLUSTER_SCHEMA, DOCUMENT_SCHEMA, REJECTED_SCHEMA
from ember.schemas.versioning import schema_identity
from ember.tokenize.shardset import verify_shard_set

from tests.pipelines.corpus_support import IN_PROCESS, build, file_digests, forget_build, rows


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleCorpus:
    return write_sample_corpus(tmp_path_factory.mktemp("corpus-input"))


@pytest.fixture(scope="module")
def built(sample: SampleCorpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus-out")
    assert build(parse_config(sample.config(str(out)))) == "DONE"
    return out


def test_every_input_unit_is_kept_or_rejected_with_a_counted_reason(sample: SampleCorpus, built: Path) -> None:
    stats = read_stats(str(built))
    totals = stats["totals"]
    assert totals["balanced"] and all(s["balanced"] for s in stats["sources"].values())
    assert totals["docs_in"] == totals["kept"] + totals["rejected"] == 66
    assert totals["rejected_by_reason"] == dict(sorted(sample.expected_reasons.items()))
    assert len(rows(built, "documents")) == totals["kept"]
    rejects = rows(built, "rejects")
    assert len(rejects) == totals["rejected"]
    assert all(r["location"].startswith(str(Path(sample.web_glob).parent.parent)) for r in rejects)
    blank = [r for r in rejects if r["reason"] == "blank_line"]
    assert [r["location"] for r in blank] == [f"{Path(sample.web_glob).parent}/part-0.jsonl:line=30"]


def test_outputs_are_zstd_parquet_in_the_shared_schemas_sharded_by_source(built: Path) -> None:
    assert sorted(p.name for p in (built / "documents").iterdir()) == ["code", "code_gz", "web", "web_zst"]
    for name, schema in (("documents", DOCUMENT_SCHEMA), ("rejects", REJECTED_SCHEMA), ("clusters", CLUSTER_SCHEMA)):
        for path in (built / name).rglob("*.parquet"):
            table = pq.read_table(path)
            assert schema_identity(table.schema) == schema_identity(schema) and table.schema.equals(schema)
            assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
            if name == "documents":
                assert set(table.column("source").to_pylist()) == {path.parent.name}
                ids = table.column("id").to_pylist()
                assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_secrets_are_replaced_by_typed_placeholders(built: Path) -> None:
    texts = "\n".join(d["text"] for d in rows(built, "documents"))
    for secret in ("AKIAIOSFODNN7EXAMPLE", "hunter2hunter2", "jane.doe@example.org", "93.184.216.34"):
        assert secret not in texts
    for placeholder in ("<KEY>", "<PASSWORD>", "<EMAIL>", "<IP_ADDRESS>"):
        assert placeholder in texts
    assert read_stats(str(built))["totals"]["redactions"] == {"aws_access_key": 1, "email": 1, "ip_address": 1, "password": 1}


def test_cluster_ids_audit_the_representative_choice(built: Path) -> None:
    docs = {d["id"]: d for d in rows(built, "documents")}
    near = [c for c in rows(built, "clusters") if c["stage"] == "near_dedup"]
    code_cluster = [c for c in near if c["source"] == "code"]
    kept = [c for c in code_cluster if c["kept"]]
    assert len(code_cluster) == 2 and len(kept) == 1
    assert docs[kept[0]["cluster_id"]]["metadata"]["repo"] == "org/repo5", "the original (more stars) beats the fork"
    removed = [r for r in rows(built, "rejects") if r["reason"] == "near_duplicate" and r["source"] == "code"]
    assert removed[0]["detail"] == f"cluster={kept[0]['cluster_id']}"


def test_rerun_writes_byte_identical_outputs(sample: SampleCorpus, built: Path, tmp_path: Path) -> None:
    config = parse_config(sample.config(str(tmp_path / "out")))
    build_corpus(config, IN_PROCESS)
    before = file_digests(tmp_path / "out")
    forget_build(tmp_path / "out")
    rerun = build_corpus(config, IN_PROCESS)  # replaces the previous build whole (tests/pipelines/jobs/test_output_safety.py)
    assert rerun.phases == {"documents": "ran", "output": "ran"}
    after = file_digests(tmp_path / "out")
    assert after.pop("report.html") != "" and before.pop("report.html") != ""  # the page records when it was written
    assert after == before
    assert {k: v for k, v in before.items() if k not in ("report.md", OWNERSHIP_FILE)} == file_digests(built)


@pytest.fixture(scope="module")
def flink_args() -> list[str]:
    start("flink", "the Flink job server")
    jar = services.run_script("flink.sh", "path").stdout.strip()
    return ["--runner=FlinkRunner", "--flink_master=[local]", "--flink_version=1.19",
            f"--flink_job_server_jar={jar}", "--environment_type=LOOPBACK"]


def test_cli_build_on_the_multiprocess_runner(sample: SampleCorpus, built: Path, tmp_path: Path) -> None:
    config = tmp_path / "corpus.yaml"
    config.write_text(yaml.safe_dump(sample.config(str(tmp_path / "out"))))
    workers = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]  # the sample alone would run in-process
    result = CliRunner().invoke(app, ["build", str(config), *workers])
    assert result.exit_code == 0, result.output
    assert "corpus build summary" in result.output and "balanced (in = kept + rejected)" in result.output
    assert re.search(r"\] read +66 docs", result.output), "worker progress files reached the progress lines"
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Rejects by stage and reason" in report and "near_duplicate" in report
    assert (tmp_path / "out" / "report.html").read_text().count('class="plotly-graph-div"') >= 5
    outputs = {k: v for k, v in file_digests(tmp_path / "out").items() if k not in ("report.md", "report.html", OWNERSHIP_FILE)}
    assert outputs == file_digests(built)


def test_cli_reports_config_errors_with_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("sources: [{name: w, kind: web, inputs: ['*.jsonl'], format: csv}]\noutput: {directory: o}\n")
    result = CliRunner().invoke(app, ["build", str(config), "--runner=FnApiRunner"])
    assert result.exit_code == 2 and "sources.0.format" in result.output
    missing = tmp_path / "missing.yaml"
    missing.write_text(f"sources: [{{name: w, kind: web, inputs: ['{tmp_path}/none/*.jsonl']}}]\noutput: {{directory: o}}\n")
    result = CliRunner().invoke(app, ["build", str(missing)])
    assert result.exit_code == 2 and "matches no file" in result.output


def test_report_command_renders_a_finished_build(built: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(built)])
    assert result.exit_code == 0, result.output
    assert (built / "report.md").read_text().startswith("# Corpus build report")
    assert CliRunner().invoke(app, ["report", str(built / "nothing-here")]).exit_code == 2


def with_tokenize(config: dict, tokenizer: Path) -> dict:
    return {**config, "tokenize": {
        "seq_len": 128, "window_documents": 8, "sequences_per_shard": 4, "rows_per_batch": 2, "seed": 3,
        "tokenizer": {"kind": "huggingface", "path": str(tokenizer), "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"},
    }}


NAME_THEIR_PLACE = {"shards/manifest.json", OWNERSHIP_FILE, "report.md", "report.html"}
"""Outputs that name the build's place (the manifest's hash and provenance, the output's owner, the report's title)."""


def test_one_command_builds_a_verified_shard_set_identically_on_fnapi_and_flink(
    sample: SampleCorpus, flink_args: list[str], hf_tokenizer_path: Path, tmp_path: Path
) -> None:
    outcomes = {}
    for runner, args in {"fnapi": ["--runner=FnApiRunner"], "flink": flink_args}.items():
        config = parse_config(with_tokenize(sample.config(str(tmp_path / runner)), hf_tokenizer_path))
        outcomes[runner] = build_corpus(config, args)
        shards = tmp_path / runner / "shards"
        assert verify_shard_set(shards) == []
    fnapi, flink = outcomes["fnapi"].shards, outcomes["flink"].shards
    kept = {name: s["kept"] for name, s in outcomes["fnapi"].stats["sources"].items()}
    assert {name: s.documents for name, s in fnapi.sources.items()} == {n: k for n, k in kept.items() if k}
    differ = {"created_at", "config_hash", "provenance"}  # the hash and the provenance cover the source paths, which differ here
    assert fnapi.model_dump(exclude=differ) == flink.model_dump(exclude=differ)
    shard_files = [{k: v for k, v in file_digests(tmp_path / r / "shards").items() if k != "manifest.json"} for r in outcomes]
    assert shard_files[0] == shard_files[1] and shard_files[0]
    # Every other output byte for byte too: the Flink runner keeps the same documents (one Flink build checks both).
    assert {d["id"] for d in rows(tmp_path / "flink", "documents")} == {d["id"] for d in rows(tmp_path / "fnapi", "documents")}
    outputs = [{k: v for k, v in file_digests(tmp_path / r).items() if k not in NAME_THEIR_PLACE} for r in outcomes]
    assert outputs[0] == outputs[1] and {"documents", "rejects", "clusters", "stats.json"} <= {k.split("/")[0] for k in outputs[0]}


def test_tokenize_stage_config_errors_are_named(sample: SampleCorpus, tmp_path: Path) -> None:
    config = with_tokenize(sample.config(str(tmp_path)), tmp_path / "tokenizer.json")
    with pytest.raises(CorpusConfigError, match="tokenize.seq_len"):
        parse_config({**config, "tokenize": {**config["tokenize"], "seq_len": 1}})
    with pytest.raises(Exception, match="tokenizer.json"):
        build_corpus(parse_config(config), ["--runner=FnApiRunner"])
    assert not (tmp_path / "documents").exists(), "a tokenizer that does not load fails before the build runs"
