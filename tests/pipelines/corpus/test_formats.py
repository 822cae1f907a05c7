"""Reading: every input unit becomes a document row or a reject with file, line/row and reason."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from ember.configs import CorpusConfigError
from ember.pipelines.corpus.config import CorpusSource, parse_config
from ember.pipelines.corpus.formats import read_file
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
                                       "language": "rust", "stars": 3, "fetch_date": None, "content_type": None,
                                       "language_score": None, "quality_score": None}
        assert docs[0]["id"] == make_document_id("s", "def f0(): pass")
        assert docs[0]["content_hash"] == content_hash("def f0(): pass")


def test_id_field_gives_source_scoped_ids(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"id": 7, "text": "a = 1"}, {"text": "b = 2"}, {"id": [1], "text": "c"}]))
    got = [(r["id"] if r else j["reason"]) for r, j in read_file(str(path), _source(id="id"))]
    assert got == ["s:7", "missing_id_field", "invalid_id"]


def _lines(n: int, start: int = 0) -> bytes:
    return b"".join(json.dumps({"text": f"line {i}"}).encode() + b"\n" for i in range(start, start + n))


def _parquet_bytes(texts: list[str], **options) -> bytes:
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": texts}), buffer, **options)
    return buffer.getvalue().to_pybytes()


def _cut(data: bytes) -> bytes:
    """A file cut short as by an interrupted copy: the last 40% of its bytes are gone."""
    return data[: len(data) * 3 // 5]


def _break_outcomes(path: Path, fmt: str) -> tuple[int, tuple[str, str], str]:
    """(documents before the break, (location, reason) of the last unit, that unit's detail)."""
    results = list(read_file(str(path), _source(fmt)))
    docs = [r for r, _ in results if r is not None]
    last = results[-1][1]
    assert last is not None and len(docs) == len(results) - 1
    return len(docs), (last["location"], last["reason"]), last["detail"]


def test_a_zstd_file_cut_inside_a_frame_is_an_unreadable_file_at_the_line_reached(tmp_path: Path) -> None:
    compress = zstandard.ZstdCompressor().compress
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(compress(_lines(100)) + _cut(compress(_lines(100, 100))))
    kept, last, detail = _break_outcomes(path, "jsonl.zst")
    assert (kept, last) == (100, (f"{path}:line=101", "unreadable_file"))
    assert str(path) in detail and "after line 100" in detail and "ends inside a frame" in detail
    whole = tmp_path / "frames.jsonl.zst"  # consecutive frames and an empty one read through, nothing rejected
    whole.write_bytes(compress(_lines(100)) + compress(b"") + compress(_lines(100, 100)))
    assert [r["text"] for r, _ in read_file(str(whole), _source("jsonl.zst"))] == [f"line {i}" for i in range(200)]


def test_every_input_format_cut_short_ends_in_one_unreadable_file_reject(tmp_path: Path) -> None:
    texts = [f"line {i}" for i in range(3000)]
    plain = _lines(3000)
    cases = {
        "jsonl": _cut(plain),
        "jsonl.gz": _cut(gzip.compress(plain)),
        "jsonl.zst": _cut(zstandard.ZstdCompressor(write_content_size=False).compress(plain)),
        "parquet": _cut(_parquet_bytes(texts)),
    }
    for fmt, data in cases.items():
        path = tmp_path / f"cut.{fmt}"
        path.write_bytes(data)
        kept, (location, reason), detail = _break_outcomes(path, fmt)
        unit = "row" if fmt == "parquet" else "line"
        assert reason == "unreadable_file" and location == f"{path}:{unit}={kept + 1}", fmt
        assert str(path) in detail, fmt
        assert 0 <= kept < 3000, fmt


def test_a_gzip_file_with_a_bad_checksum_is_unreadable_after_what_it_yielded(tmp_path: Path) -> None:
    data = bytearray(gzip.compress(_lines(50)))
    data[-8] ^= 0xFF  # the CRC32 in the trailer
    path = tmp_path / "crc.jsonl.gz"
    path.write_bytes(bytes(data))
    kept, last, detail = _break_outcomes(path, "jsonl.gz")
    assert (kept, last) == (50, (f"{path}:line=51", "unreadable_file")) and "CRC" in detail


def test_a_flipped_byte_in_a_checksummed_parquet_page_is_not_read_as_text(tmp_path: Path) -> None:
    texts = [f"hello world {i}" for i in range(100)]
    data = bytearray(_parquet_bytes(texts, compression="none", use_dictionary=False, write_page_checksum=True))
    data[data.find(b"hello world 50")] = ord("j")
    path = tmp_path / "flipped.parquet"
    path.write_bytes(bytes(data))
    assert _outcomes(path, _source("parquet")) == [(f"{path}:row=1", "unreadable_file")]


def test_one_parquet_row_that_does_not_convert_loses_only_itself(tmp_path: Path) -> None:
    binary = pa.array([b"ok = 1", b"bad \xff byte", b"fine = 2"], pa.binary())
    table = pa.table({"text": pa.Array.from_buffers(pa.string(), len(binary), binary.buffers())})
    path = tmp_path / "utf8.parquet"
    pq.write_table(table, path)
    assert _outcomes(path, _source("parquet")) == [
        (f"{path}:row=1", "doc"), (f"{path}:row=2", "unconvertible_row"), (f"{path}:row=3", "doc")]


def test_hostile_json_lines_are_invalid_json_and_the_file_reads_on(tmp_path: Path) -> None:
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(b"\n".join([
        b'{"text": "x", "n": ' + b"1" * 5000 + b"}",
        b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        json.dumps({"text": "after"}).encode(),
    ]) + b"\n")
    p = str(path)
    assert _outcomes(path, _source()) == [(f"{p}:line=1", "invalid_json"), (f"{p}:line=2", "invalid_json"), (f"{p}:line=3", "doc")]


def test_a_plain_jsonl_file_ending_inside_a_line_is_truncated_but_a_missing_last_newline_is_not(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(_lines(2) + b'{"text": "li')
    assert _outcomes(path, _source())[-1] == (f"{path}:line=3", "unreadable_file")
    path.write_bytes(_lines(2) + b'{"text": "complete"}')
    assert _outcomes(path, _source())[-1] == (f"{path}:line=3", "doc")
    path.write_bytes(_lines(2) + b'{"text": "broken\n')
    assert _outcomes(path, _source())[-1] == (f"{path}:line=3", "invalid_json")


def test_control_characters_are_rejected_by_default_with_their_offset_not_the_text(tmp_path: Path) -> None:
    path = tmp_path / "ctl.jsonl"
    path.write_text("\n".join([
        r'{"text": "secret\u0000tail and more \u0000"}',
        r'{"text": "colour \u001b[31m red"}',
        json.dumps({"text": "tabs\tnewlines\nform\x0cfeeds\r\nare text"}),
    ]) + "\n")
    results = list(read_file(str(path), _source()))
    rejects = [j for _, j in results if j is not None]
    assert [(j["reason"], j["detail"]) for j in rejects] == [
        ("control_characters", "2 control character(s), the first U+0000 at character 6"),
        ("control_characters", "1 control character(s), the first U+001B at character 7"),
    ]
    assert results[2][0]["text"] == "tabs\tnewlines\nform\x0cfeeds\r\nare text"


def test_control_characters_strip_policy_removes_them_before_ids_and_hashes(tmp_path: Path) -> None:
    path = tmp_path / "ctl.jsonl"
    path.write_text("\n".join([r'{"text": "a\u0000b\u0007c\td"}', r'{"text": "\u0000\u0001"}']) + "\n")
    results = list(read_file(str(path), _source(**{}).model_copy(update={"control_characters": "strip"})))
    row = results[0][0]
    assert row["text"] == "abc\td" and row["content_hash"] == content_hash("abc\td") and row["id"] == make_document_id("s", "abc\td")
    assert results[1][1]["reason"] == "empty_text"


BOMB_BYTES = 96 * 2**20


def _write_with_bomb(path: Path, fmt: str) -> None:
    """Two good lines around one of BOMB_BYTES, written in pieces (the test never holds the bomb either)."""
    opened = {"jsonl": lambda: path.open("wb"), "jsonl.gz": lambda: gzip.open(path, "wb", compresslevel=1),
              "jsonl.zst": lambda: zstandard.ZstdCompressor().stream_writer(path.open("wb"))}[fmt]
    with opened() as out:
        out.write(_lines(1))
        out.write(b'{"text": "')
        for _ in range(BOMB_BYTES // 2**20):
            out.write(b"x" * 2**20)
        out.write(b'"}\n')
        out.write(_lines(1, start=1))


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst"])
def test_a_line_over_max_line_bytes_is_skipped_unread_and_the_file_reads_on(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"a.{fmt}"
    _write_with_bomb(path, fmt)
    source = _source(fmt).model_copy(update={"max_line_bytes": 64 * 2**10})
    tracemalloc.start()
    try:
        units = list(read_file(str(path), source))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(r or j)["location"] for r, j in units] == [f"{path}:line={n}" for n in (1, 2, 3)]
    assert [j["reason"] if j else "doc" for _, j in units] == ["doc", "line_too_long", "doc"]
    assert units[1][1]["detail"] == (
        f"line 2 of {path} has {BOMB_BYTES + 13:,} bytes, more than max_line_bytes ({64 * 2**10:,}): skipped unread")
    assert peak < BOMB_BYTES / 2, f"reading held {peak:,} bytes at once"


def test_max_line_bytes_counts_the_bytes_before_the_newline(tmp_path: Path) -> None:
    cap = 1024
    at_cap = b'{"text": "' + b"y" * (cap - 12) + b'"}'
    path = tmp_path / "a.jsonl"
    path.write_bytes(at_cap + b"\n" + at_cap[:-2] + b'y"}\n' + at_cap)
    source = _source().model_copy(update={"max_line_bytes": cap})
    assert len(at_cap) == cap
    assert [o for _, o in _outcomes(path, source)] == ["doc", "line_too_long", "doc"]


def test_a_code_source_whose_lines_cannot_hold_a_document_the_filters_keep_is_a_config_error() -> None:
    base = {"output": {"directory": "out"}, "filters": {"code": {"max_chars": 10_000}}}
    code = {"name": "c", "kind": "code", "inputs": ["x"], "max_line_bytes": 100_000}
    with pytest.raises(CorpusConfigError, match=r"sources\.0\.max_line_bytes: 100,000 is less than 12 x filters.code.max_chars = 120,000"):
        parse_config({**base, "sources": [code]})
    parse_config({**base, "sources": [{**code, "max_line_bytes": 120_000}]})
    parse_config({**base, "sources": [{**code, "kind": "web"}]})  # no max_chars applies to web documents
