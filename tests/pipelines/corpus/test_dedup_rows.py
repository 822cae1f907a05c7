"""Dedup without the text: `SplitText` rows carry no text through exact and near dedup, the write joins each kept
row with its text again, and the row-group-at-a-time Parquet writer writes the bytes `pq.write_table` would."""

from __future__ import annotations

import random
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.testing.util import assert_that, equal_to

from ember.demo.sample_corpus import near_duplicate, prose
from ember.pipelines.corpus.config import CorpusSource, Dedup
from ember.pipelines.corpus.formats import ROW_GROUP_ROWS, record_to_row, write_parquet
from ember.pipelines.corpus.outputs import WriteParquetParts
from ember.pipelines.corpus.stages import ExactDedup, NearDedup, SplitText
from ember.schemas.documents import DOCUMENT_SCHEMA

SOURCES = {name: CorpusSource.model_validate({"name": name, "kind": "web", "inputs": ["x"], "fields": {"id": "id"}})
           for name in ("a", "b")}


def _rows() -> list[dict]:
    """Source a: pages, near duplicates of one, an exact copy; source b: only a copy of one of a's pages, so dedup
    removes all of b and its text has no part to go to."""
    rng = random.Random(7)
    base, other = prose(rng, 14), prose(rng, 12)
    texts = [("a", "base", base), ("a", "other", other), ("a", "copy", base)]
    texts += [("a", f"near{i}", near_duplicate(rng, base, 2)) for i in range(3)]
    texts += [("a", f"solo{i}", prose(rng, 10)) for i in range(4)] + [("b", "only", other)]
    out = []
    for line, (source, doc_id, text) in enumerate(texts, 1):
        row, rejected = record_to_row({"id": doc_id, "text": text}, SOURCES[source], f"{source}.jsonl:line={line}")
        assert rejected is None
        out.append(row)
    return out


def _build(rows: list[dict], out: Path, split: bool) -> None:
    dedup = Dedup()
    with beam.Pipeline(runner="FnApiRunner") as p:
        docs, texts = p | beam.Create(rows), None
        if split:
            docs, texts = docs | SplitText(dedup)
            assert_that(docs | beam.Map(lambda r: "text" in r), equal_to([False] * len(rows)), label="NoText")
        docs = (docs | ExactDedup(dedup, None)).documents
        docs = (docs | "Near" >> NearDedup(dedup, None)).documents
        _ = docs | WriteParquetParts(str(out), DOCUMENT_SCHEMA, "source", "id", ("id", "location"), 4, None, texts)


def test_a_split_build_writes_the_same_files_as_one_that_carries_the_text(tmp_path: Path) -> None:
    rows = _rows()
    _build(rows, tmp_path / "whole", split=False)
    _build(rows, tmp_path / "split", split=True)
    whole = sorted(p.relative_to(tmp_path / "whole") for p in (tmp_path / "whole").rglob("*.parquet"))
    assert whole == sorted(p.relative_to(tmp_path / "split") for p in (tmp_path / "split").rglob("*.parquet"))
    assert not (tmp_path / "split" / "b").exists()  # every document of b was removed: no part, no crash
    kept = [r for p in whole for r in pq.read_table(tmp_path / "whole" / p).to_pylist()]
    assert sorted(r["id"] for r in kept) == ["a:base", "a:other", "a:solo0", "a:solo1", "a:solo2", "a:solo3"]
    for part in whole:
        assert (tmp_path / "whole" / part).read_bytes() == (tmp_path / "split" / part).read_bytes(), part


def test_the_row_group_writer_writes_the_bytes_of_write_table(tmp_path: Path) -> None:
    schema = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("text", pa.string())])
    for n in (0, 3, 2 * ROW_GROUP_ROWS + 5):
        rows = [{"id": f"d{i:06d}", "text": "x" * (i % 97)} for i in range(n)]
        expected = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), expected, compression="zstd", row_group_size=ROW_GROUP_ROWS)
        write_parquet(str(tmp_path / f"{n}.parquet"), iter(rows), schema)
        assert (tmp_path / f"{n}.parquet").read_bytes() == expected.getvalue().to_pybytes(), n
