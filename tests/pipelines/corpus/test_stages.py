"""Each corpus-build stage as a PTransform on FnApiRunner, plus the pure ordering and stats helpers."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import apache_beam as beam
import pyarrow.parquet as pq
import pytest
import yaml
from apache_beam.testing.util import assert_that, equal_to
from typer.testing import CliRunner

from ember.cli import app
from ember.pipelines.corpus.config import CorpusSource, Dedup, parse_config
from ember.pipelines.corpus.report import read_stats

from ember.pipelines.quality.settings import Redaction
from ember.pipelines.corpus.formats import record_to_row
from ember.pipelines.corpus.outputs import WriteParquetParts
from ember.pipelines.corpus.phases import cache_root
from ember.pipelines.corpus.pipeline import corpus_stages
from ember.pipelines.corpus.stages import (
    CLUSTER_TEXT_FIELDS, REJECT_TEXT_FIELDS, TIMED_OUT_FIELD, ExactDedup, NearDedup, PerDocument, RedactDocuments, RedactRows,
    StageOutput, UniqueIds,
    node_key, rank_key, size_bin, text_bytes,
)
from ember.pipelines.jobs.output_guard import OWNERSHIP_FILE
from ember.demo.sample_corpus import near_duplicate, prose
from ember.schemas.documents import DOCUMENT_SCHEMA, content_hash, reject_row

from tests.pipelines.corpus_support import rows
from tests.pipelines.redaction_adversarial import INPUTS

CODE = CorpusSource.model_validate({"name": "code", "kind": "code", "inputs": ["x"], "fields": {
    "id": "id", "metadata": {"license": "license", "stars": "stars", "path": "path"}}})


def _row(doc_id: str, text: str, license_: str | None = "mit", stars: int | None = None, line: int = 1) -> dict:
    record = {"id": doc_id, "text": text, "license": license_, "stars": stars, "path": f"{doc_id}.py"}
    row, rejected = record_to_row(record, CODE, f"in.jsonl:line={line}")
    assert rejected is None
    return row


def test_rank_key_orders_by_preference_then_id() -> None:
    dedup = Dedup()
    rows = [_row("d", "t", "gpl-3.0", 900), _row("c", "t", "mit", 5), _row("b", "t", "mit", 50), _row("a", "t", None, 50)]
    assert [r["id"] for r in sorted(rows, key=lambda r: node_key(r, dedup))] == ["code:b", "code:c", "code:d", "code:a"]
    by_length = Dedup(prefer=["longest"])
    assert rank_key(_row("x", "longer text"), by_length) < rank_key(_row("y", "short"), by_length)
    assert rank_key(_row("x", "t"), Dedup(prefer=[])) == ""


def test_the_graph_is_the_list_of_stages_the_config_asks_for() -> None:
    with_ids = {"sources": [{"name": "code", "kind": "code", "inputs": ["x"], "fields": {"id": "id"}}], "output": {"directory": "o"}}
    assert [s.label for s in corpus_stages(parse_config(with_ids))] == [
        "ReadSources", "UniqueIds", "Filter", "Redact", "ExactDedup", "NearDedup"]
    plain = {**with_ids, "sources": [{"name": "web", "kind": "web", "inputs": ["x"]}], "dedup": {"exact": False, "near": False}}
    assert [s.label for s in corpus_stages(parse_config(plain))] == ["ReadSources", "Filter", "Redact"]


def test_size_bins() -> None:
    assert [size_bin(n) for n in (2, 3, 4, 5, 8, 9, 100)] == ["2", "3-4", "3-4", "5-8", "5-8", "9-16", "65-128"]


def test_exact_dedup_keeps_the_preferred_copy_and_records_the_cluster() -> None:
    text = "def area(r):\n    return 3.14159 * r * r\n"
    rows = [_row("gpl", text, "gpl-3.0", 1000, 1), _row("few", text, "mit", 3, 2), _row("many", text + "  \n", "mit", 40, 3),
            _row("other", "def other():\n    return 42\n", "mit", 1, 4)]
    with beam.Pipeline(runner="FnApiRunner") as p:
        out = p | beam.Create(rows) | ExactDedup(Dedup(), None)
        assert isinstance(out, StageOutput)
        assert_that(out.documents | beam.Map(lambda d: d["id"]), equal_to(["code:many", "code:other"]), label="docs")
        assert_that(out.rejects | beam.Map(lambda r: (r["document_id"], r["stage"], r["reason"], r["detail"])), equal_to([
            ("code:few", "exact_dedup", "exact_duplicate", "cluster=code:many"),
            ("code:gpl", "exact_dedup", "exact_duplicate", "cluster=code:many")]), label="rejects")
        assert_that(out.clusters | beam.Map(lambda c: (c["document_id"], c["cluster_id"], c["kept"])), equal_to([
            ("code:few", "code:many", False), ("code:gpl", "code:many", False), ("code:many", "code:many", True)]), label="clusters")
        kept_bytes = text_bytes(rows[2]) + text_bytes(rows[3])
        assert_that(out.stats | beam.CombinePerKey(sum), equal_to([
            (("*", "exact_dedup", "cluster_size.3-4"), 1), (("*", "exact_dedup", "clusters"), 1),
            (("code", "exact_dedup", "docs_out"), 2), (("code", "exact_dedup", "bytes_out"), kept_bytes)]), label="stats")


def test_near_dedup_clusters_planted_variants_and_keeps_the_representative() -> None:
    rng = random.Random(4)
    base = prose(rng, 14)
    variants = [near_duplicate(rng, base, 2) for _ in range(3)]
    unrelated = [prose(rng, 14) for _ in range(4)]
    rows = [_row("base", base, "mit", 5, 1)] + [_row(f"v{i}", t, "mit", 50 + i, 2 + i) for i, t in enumerate(variants)]
    rows += [_row(f"u{i}", t, "mit", 1, 10 + i) for i, t in enumerate(unrelated)]
    representative = "code:v2"  # the most stars among the cluster's permissive members
    with beam.Pipeline(runner="FnApiRunner") as p:
        docs, rejects, clusters, stats = p | beam.Create(rows) | NearDedup(Dedup(), None)
        assert_that(docs | beam.Map(lambda d: d["id"]), equal_to([representative] + [f"code:u{i}" for i in range(4)]), label="docs")
        assert_that(rejects | beam.Map(lambda r: (r["document_id"], r["reason"], r["detail"])), equal_to(
            [(f"code:{n}", "near_duplicate", f"cluster={representative}") for n in ("base", "v0", "v1")]), label="rejects")
        assert_that(clusters | beam.Map(lambda c: (c["document_id"], c["cluster_id"], c["kept"])), equal_to(
            [(f"code:{n}", representative, n == "v2") for n in ("base", "v0", "v1", "v2")]), label="clusters")
        assert_that(stats, equal_to([(("*", "near_dedup", "cc_unconverged_edges"), 0), (("*", "near_dedup", "clusters"), 1),
                                     (("*", "near_dedup", "cluster_size.3-4"), 1)]), label="stats")


def test_unique_ids_keeps_one_row_per_id() -> None:
    rows = [_row("same", "a = 1", line=1), _row("same", "b = 2", line=2), _row("solo", "c = 3", line=3)]
    with beam.Pipeline(runner="FnApiRunner") as p:
        docs, rejects, clusters, stats = p | beam.Create(rows) | UniqueIds(frozenset({"code"}))
        kept_first = min(rows[:2], key=lambda r: r["content_hash"])
        assert_that(docs | beam.Map(lambda r: r["location"]), equal_to([kept_first["location"], "in.jsonl:line=3"]), label="docs")
        assert_that(rejects | beam.Map(lambda r: (r["stage"], r["reason"])), equal_to([("unique_ids", "duplicate_id")]), label="rejects")
        assert_that(clusters, equal_to([]), label="clusters")
        assert_that(stats, equal_to([]), label="stats")


@pytest.mark.parametrize("per_shard", [2, 100])
def test_write_shards_are_named_by_count_and_sorted(tmp_path: Path, per_shard: int) -> None:
    rows = [_row(f"d{i}", f"x = {i}", line=i) for i in range(5)]
    random.Random(1).shuffle(rows)
    with beam.Pipeline(runner="FnApiRunner") as p:
        _ = p | beam.Create(rows) | WriteParquetParts(str(tmp_path), DOCUMENT_SCHEMA, "source", "id", ("id", "location"), per_shard, None)
    files = sorted(tmp_path.rglob("*.parquet"))
    shards = -(-5 // per_shard)
    assert {f.name.split("-of-")[1] for f in files} == {f"{shards:05d}.parquet"} and all(f.parent.name == "code" for f in files)
    for f in files:
        table = pq.read_table(f)
        assert table.schema.equals(DOCUMENT_SCHEMA, check_metadata=True)
        assert table.column("id").to_pylist() == sorted(table.column("id").to_pylist())
    assert sum(pq.read_metadata(f).num_rows for f in files) == 5


AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
GH_TOKEN = "ghp_abcdefghijklmnopqrstuvwxyz0123456789AB"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
DB_PASSWORD = "Tr0ub4dor-x9"
LEAKS = (AWS_KEY, GH_TOKEN, JWT, DB_PASSWORD)


def test_redact_stage_covers_metadata_and_counts_it() -> None:
    record = {"id": "m", "text": f"DSN = 'postgres://admin:{DB_PASSWORD}@db.internal/app'\n",
              "url": f"https://example.com/get?api_key={AWS_KEY}", "path": f"keys/{GH_TOKEN}.py", "stars": 3}
    source = CorpusSource.model_validate({"name": "code", "kind": "code", "inputs": ["x"], "fields": {
        "id": "id", "metadata": {"url": "url", "path": "path", "stars": "stars"}}})
    row, _ = record_to_row(record, source, "in.jsonl:line=1")
    with beam.Pipeline(runner="FnApiRunner") as p:
        out = p | beam.Create([row]) | PerDocument(RedactDocuments(Redaction(), None), counted=False)
        assert_that(out.documents | beam.Map(lambda d: (d["text"], d["metadata"]["url"], d["metadata"]["path"],
                                                        d["metadata"]["stars"], d["content_hash"] == content_hash(d["text"]))),
                    equal_to([("DSN = 'postgres://admin:<PASSWORD>@db.internal/app'\n", "https://example.com/get?api_key=<KEY>",
                               "keys/<KEY>.py", 3, True)]), label="docs")
        assert_that(out.stats | beam.CombinePerKey(sum), equal_to([
            (("code", "redact", "redactions.url_password"), 1), (("code", "redact", "redactions.aws_access_key"), 1),
            (("code", "redact", "redactions.github_token"), 1), (("code", "redact", "docs_redacted"), 1)]), label="stats")


def test_reject_details_and_locations_never_repeat_a_secret() -> None:
    rejects = [reject_row("code", f"/data/{AWS_KEY}/in.jsonl:line=4", "filter", "language_not_allowed",
                          f"language 'ruby' (from 'deploy/{GH_TOKEN}.rb')", "code:x")]
    clusters = [{"document_id": "code:y", "source": "code", "location": f"/data/{AWS_KEY}/in.jsonl:line=5",
                 "stage": "exact_dedup", "cluster_id": "code:z", "kept": False}]
    with beam.Pipeline(runner="FnApiRunner") as p:
        redacted = p | "Rejects" >> beam.Create(rejects) | "RedactRejects" >> RedactRows(Redaction(), REJECT_TEXT_FIELDS)
        assert_that(redacted | beam.Map(lambda r: (r["location"], r["detail"], r["reason"])), equal_to([
            ("/data/<KEY>/in.jsonl:line=4", "language 'ruby' (from 'deploy/<KEY>.rb')", "language_not_allowed")]), label="rejects")
        kept = p | "Clusters" >> beam.Create(clusters) | "RedactClusters" >> RedactRows(Redaction(), CLUSTER_TEXT_FIELDS)
        assert_that(kept | beam.Map(lambda c: c["location"]), equal_to(["/data/<KEY>/in.jsonl:line=5"]), label="clusters")
        off = p | "Off" >> beam.Create(rejects) | "RedactOff" >> RedactRows(Redaction(enabled=False), REJECT_TEXT_FIELDS)
        assert_that(off, equal_to(rejects), label="disabled")


# ~0.4 s of CPU to redact (a line of 5,957 public addresses, each looked at in its context), against limits of
# 0.01-0.05 s that a short document stays far below.
SLOW_TO_REDACT = INPUTS["ip_address: public addresses on one line"](2**16)


def test_a_reject_field_past_the_time_limit_is_replaced_whole_and_the_others_redacted() -> None:
    rejects = [reject_row("code", f"/data/{AWS_KEY}/in.jsonl:line=4", "filter", "language_not_allowed", SLOW_TO_REDACT, "code:x")]
    with beam.Pipeline(runner="FnApiRunner") as p:
        redacted = p | beam.Create(rejects) | RedactRows(Redaction(time_limit_s=0.01), REJECT_TEXT_FIELDS)
        assert_that(redacted | beam.Map(lambda r: (r["location"], r["detail"], r["reason"])), equal_to([
            ("/data/<KEY>/in.jsonl:line=4", TIMED_OUT_FIELD, "language_not_allowed")]))


def test_a_document_past_the_redaction_time_limit_is_a_counted_reject_and_the_build_finishes(tmp_path: Path) -> None:
    """One hostile document among ordinary ones: it is rejected with its reason, the others are redacted and
    kept, the stats balance, and the report and the build's warning say which setting to raise."""
    records = [
        {"text": f"DSN = 'postgres://admin:{DB_PASSWORD}@db/app'\nprint('connected')\n", "path": "a.py"},
        {"text": "def add(a, b):\n    return a + b\n", "path": "b.py"},
        {"text": SLOW_TO_REDACT.replace(" ", "\n"), "path": "hosts.py"},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {
        "sources": [{"name": "code", "kind": "code", "inputs": [str(tmp_path / "in.jsonl")], "fields": {"metadata": {"path": "path"}}}],
        "filters": {"code": {"max_line_length": None, "max_mean_line_length": None, "min_alphanum_fraction": None,
                             "max_encoded_fraction": None}},
        "redaction": {"time_limit_s": 0.05},
        "dedup": {"near": False},
        "output": {"directory": str(tmp_path / "out")},
        "warn_share": 0.2,
    }
    (tmp_path / "corpus.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["corpus", "build", str(tmp_path / "corpus.yaml"), "--runner=FnApiRunner"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    [reject] = rows(out, "rejects")
    assert (reject["stage"], reject["reason"], reject["location"]) == ("redact", "redaction_timeout", f"{tmp_path}/in.jsonl:line=3")
    assert "ran past redaction.time_limit_s (0.05 s of CPU)" in reject["detail"]
    assert sorted(d["metadata"]["path"] for d in rows(out, "documents")) == ["a.py", "b.py"]
    assert any("admin:<PASSWORD>@db" in d["text"] for d in rows(out, "documents"))
    totals = read_stats(str(out))["totals"]
    assert totals["balanced"] and totals["rejected_by_reason"] == {"redact:redaction_timeout": 1}
    assert "| redact | redaction_timeout | 1 |" in (out / "report.md").read_text()
    assert "redact:redaction_timeout rejected 1 of 3 documents (33%). Fix: raise redaction.time_limit_s" in " ".join(result.output.split())


def _as_text(path: Path) -> bytes:
    """A Parquet file as the JSON of its rows and its key-value metadata; any other file as its bytes."""
    if path.suffix != ".parquet":
        return path.read_bytes()
    rows_json = json.dumps(pq.read_table(path).to_pylist(), default=str)
    return (rows_json + repr(pq.read_metadata(path).metadata)).encode("utf-8")


def test_no_file_a_build_writes_holds_a_planted_secret(tmp_path: Path) -> None:
    """Secrets in text, metadata, a rejected document's path and the input's own path: `ember corpus build` writes
    none of them anywhere. Every file it leaves (the Parquet tables, stats.json, report.md, report.html, the
    ownership file, the phase cache beside the output and the job log) is searched, and what it prints."""
    inputs = tmp_path / f"dump-{AWS_KEY}"
    inputs.mkdir()
    body = f"import requests\n\nHEADERS = {{'Authorization': 'Bearer {JWT}'}}\nDSN = 'postgres://admin:{DB_PASSWORD}@db/app'\n"
    records = [
        {"id": "a", "text": body, "url": f"https://example.com/a?api_key={AWS_KEY}", "path": "svc/a.py"},
        {"id": "b", "text": body, "url": "https://example.com/b", "path": "svc/b.py"},  # an exact duplicate of a
        {"id": "c", "text": "puts 'hello from ruby, a file long enough to be kept'\n", "path": f"deploy/{GH_TOKEN}.rb"},
    ]
    (inputs / "part-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = tmp_path / "corpus.yaml"
    config.write_text(yaml.safe_dump({
        "sources": [{"name": "code", "kind": "code", "inputs": [str(inputs / "*.jsonl")],
                     "fields": {"id": "id", "metadata": {"url": "url", "path": "path"}}}],
        "filters": {"code": {"languages": ["python"]}},
        "dedup": {"near": False},
        "output": {"directory": str(tmp_path / "out")},
    }))
    result = CliRunner().invoke(app, ["corpus", "build", str(config), "--runner=FnApiRunner"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    tables = {name: rows(out, name) for name in ("documents", "rejects", "clusters")}
    assert [len(tables[n]) for n in ("documents", "rejects", "clusters")] == [1, 2, 2]
    assert {r["reason"] for r in tables["rejects"]} == {"language_not_allowed", "exact_duplicate"}
    log = Path(re.search(r"^log: (.+)$", result.output, re.MULTILINE).group(1))
    written = {p: _as_text(p) for p in sorted(tmp_path.rglob("*")) if p.is_file() and p != config and inputs not in p.parents}
    expected = {log, out / "stats.json", out / "report.md", out / "report.html", out / OWNERSHIP_FILE}
    assert expected <= set(written), sorted(expected - set(written))
    assert any(cache_root(out) in p.parents for p in written), "the phase cache was not searched"
    assert b"INFO" in written[log], "the job log holds no log lines"
    searched = {str(p.relative_to(tmp_path)): data for p, data in written.items()}
    searched["the command's output"] = result.output.encode("utf-8")
    leaks = [(where, secret) for where, data in searched.items() for secret in LEAKS if secret.encode("utf-8") in data]
    assert not leaks, f"planted secrets written by the build (file, secret): {leaks}"
    assert "Bearer <KEY>" in tables["documents"][0]["text"] and "admin:<PASSWORD>@db" in tables["documents"][0]["text"]
