"""Each corpus-build stage as a PTransform on FnApiRunner, plus the pure ordering and stats helpers."""

from __future__ import annotations

import random
from pathlib import Path

import apache_beam as beam
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.util import assert_that, equal_to

from ember.pipelines.corpus_config import CorpusSource, Dedup, parse_config
from ember.pipelines.corpus_io import record_to_row
from ember.pipelines.corpus_outputs import WriteParquetParts
from ember.pipelines.corpus_pipeline import corpus_stages
from ember.pipelines.corpus_stages import ExactDedup, NearDedup, StageOutput, UniqueIds, node_key, rank_key, size_bin, text_bytes
from ember.demo.sample_corpus import near_duplicate, prose
from ember.schemas.documents import DOCUMENT_SCHEMA

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
