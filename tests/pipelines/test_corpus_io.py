"""Reading: every input unit becomes a document row or a reject with file, line/row and reason."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from ember.pipelines.corpus_config import CorpusSource
from ember.pipelines.corpus_io import read_file
from ember.schemas.documents import content_hash, make_document_id


def _source(fmt: str = "jsonl", **fields) -> CorpusSource:
    return CorpusSource.model_validate({"name": "s", "kind": "code", "inputs": ["x"], "format": fmt, "fields": fields})


def _outcomes(path: Path, source: CorpusSource) -> list[tuple[str, str]]:
    """(location, 'doc' or reason) per input unit, in file order."""
    return [(r["location"], "doc") if r else (j["location"], j["reason"]) for r, j in read_file(str(path), source)]


def test_malformed_jsonl_lines_are_rejected_with_their_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    lines = [
        json.dumps({"text": "print('ok')"}).encode(),
        b'{"text": "broken',
        json.dumps({"body": "no text"}).encode(),
        b"   ",
        b'{"text": "bad \xff byte"}',
        json.dumps([1, 2]).encode(),
        json.dumps({"text": 42}).encode(),
        json.dumps({"text": "  \n "}).encode(),
        b'{"text": "lone \\ud800 surrogate"}',
        json.dumps({"text": "x = 1", "stars": "many"}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\r\n")
    source = _source(metadata={"stars": "stars"})
    p = str(path)
    assert _outcomes(path, source) == [
        (f"{p}:line=1", "doc"), (f"{p}:line=2", "invalid_json"), (f"{p}:line=3", "missing_text_field"),
        (f"{p}:line=4", "blank_line"), (f"{p}:line=5", "invalid_utf8"), (f"{p}:line=6", "not_an_object"),
        (f"{p}:line=7", "text_not_string"), (f"{p}:line=8", "empty_text"), (f"{p}:line=9", "invalid_unicode"),
        (f"{p}:line=10", "invalid_metadata"),
    ]


def test_empty_and_corrupt_files_are_rejects_not_crashes(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert _outcomes(tmp_path / "empty.jsonl", _source()) == [(str(tmp_path / "empty.jsonl"), "empty_file")]
    good = gzip.compress(b"".join(json.dumps({"text": f"line {i}"}).encode() + b"\n" for i in range(200)))
    (tmp_path / "cut.jsonl.gz").write_bytes(good[: len(good) // 2])
    outcomes = _outcomes(tmp_path / "cut.jsonl.gz", _source("jsonl.gz"))
    assert outcomes[-1][1] == "unreadable_file" and all(o == "doc" for _, o in outcomes[:-1])
    assert outcomes[-1][0] == f"{tmp_path / 'cut.jsonl.gz'}:line={len(outcomes)}"
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    assert _outcomes(tmp_path / "junk.parquet", _source("parquet")) == [(f"{tmp_path / 'junk.parquet'}:row=1", "unreadable_file")]


def test_compressed_and_parquet_inputs_with_nested_field_mapping(tmp_path: Path) -> None:
    records = [{"doc": {"body": f"def f{i}(): pass"}, "meta": {"file": f"src/f{i}.rs", "lic": "MIT", "stars": 3.0}} for i in range(3)]
    source_fields = {"text": "doc.body", "metadata": {"path": "meta.file", "license": "meta.lic", "stars": "meta.stars"}}
    raw = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet")
    for name, fmt in (("a.jsonl.zst", "jsonl.zst"), ("a.jsonl.gz", "jsonl.gz"), ("a.parquet", "parquet")):
        docs = [r for r, _ in read_file(str(tmp_path / name), _source(fmt, **source_fields))]
        assert [d["text"] for d in docs] == [f"def f{i}(): pass" for i in range(3)], name
        assert docs[0]["metadata"] == {"url": None, "repo": None, "path": "src/f0.rs", "license": "mit",
                                       "language": "rust", "stars": 3}
        assert docs[0]["id"] == make_document_id("s", "def f0(): pass")
        assert docs[0]["content_hash"] == content_hash("def f0(): pass")


def test_id_field_gives_source_scoped_ids(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"id": 7, "text": "a = 1"}, {"text": "b = 2"}, {"id": [1], "text": "c"}]))
    got = [(r["id"] if r else j["reason"]) for r, j in read_file(str(path), _source(id="id"))]
    assert got == ["s:7", "missing_id_field", "invalid_id"]
