"""Reading raw corpus files into document rows, and writing sorted Parquet shards, on any Beam filesystem.

Reading never raises for bad data: every input unit (a JSONL line, a Parquet row, an empty or
unreadable file) comes out either as a document row or as a reject with `path:line=N` / `path:row=N`
and a reason. Document rows are plain dicts in `DOCUMENT_SCHEMA` layout plus `location`, the cheapest
shape for Beam's coders.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from ember.pipelines.code_filters import language_from_path
from ember.pipelines.corpus_config import CorpusSource
from ember.schemas.documents import METADATA_KEYS, content_hash, make_document_id, reject_row

READ_STAGE = "read"
PARQUET_BATCH_ROWS = 1024

Row = dict[str, Any]


def _lookup(record: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _encodable(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _metadata(record: dict[str, Any], source: CorpusSource) -> tuple[dict[str, Any], str]:
    """Mapped metadata with ember's types, or ({}, problem) naming the first field that does not fit."""
    metadata: dict[str, Any] = {}
    for key, field in source.fields.metadata.items():
        found, value = _lookup(record, field)
        if not found or value is None:
            continue
        if key == "stars":
            if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
                return {}, f"metadata.stars from field '{field}' must be an integer, got {value!r}"
            metadata[key] = int(value)
        elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
            text = str(value)
            if not _encodable(text):
                return {}, f"metadata.{key} from field '{field}' is not valid Unicode"
            metadata[key] = text.lower() if key == "license" else text
        else:
            return {}, f"metadata.{key} from field '{field}' must be a string, got {type(value).__name__}"
    if source.kind == "code" and "language" not in metadata:
        language = language_from_path(metadata.get("path"))
        if language is not None:
            metadata["language"] = language
    return metadata, ""


def record_to_row(record: Any, source: CorpusSource, location: str) -> tuple[Row | None, Row | None]:
    """(document row, None) or (None, reject row) for one decoded record."""
    name = source.name

    def bad(reason: str, detail: str = "") -> tuple[None, Row]:
        return None, reject_row(name, location, READ_STAGE, reason, detail)

    if not isinstance(record, dict):
        return bad("not_an_object", f"got {type(record).__name__}")
    found, text = _lookup(record, source.fields.text)
    if not found or text is None:
        return bad("missing_text_field", f"no field '{source.fields.text}'")
    if not isinstance(text, str):
        return bad("text_not_string", f"field '{source.fields.text}' is {type(text).__name__}")
    if not text.strip():
        return bad("empty_text")
    if not _encodable(text):
        return bad("invalid_unicode", "text holds lone surrogates")
    metadata, problem = _metadata(record, source)
    if problem:
        return bad("invalid_metadata", problem)
    if source.fields.id is not None:
        found, raw_id = _lookup(record, source.fields.id)
        if not found or raw_id is None:
            return bad("missing_id_field", f"no field '{source.fields.id}'")
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or "\x00" in str(raw_id) or not _encodable(str(raw_id)):
            return bad("invalid_id", f"field '{source.fields.id}' must be a string or integer without NUL, got {raw_id!r}")
        doc_id = f"{name}:{raw_id}"
    else:
        doc_id = make_document_id(name, text)
    row = {
        "id": doc_id,
        "source": name,
        "kind": source.kind,
        "text": text,
        "content_hash": content_hash(text),
        "metadata": {k: metadata.get(k) for k in METADATA_KEYS},
        "location": location,
    }
    return row, None


def _decompressed(raw: Any, fmt: str) -> io.BufferedIOBase:
    if fmt == "jsonl.gz":
        return gzip.GzipFile(fileobj=raw)
    if fmt == "jsonl.zst":
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw


def _jsonl_rows(path: str, source: CorpusSource) -> Iterator[tuple[Row | None, Row | None]]:
    line_no = 0
    name = source.name
    try:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as raw:
            stream = _decompressed(raw, source.format)
            for line_no, line in enumerate(stream, 1):
                location = f"{path}:line={line_no}"
                line = line.rstrip(b"\r\n")
                if not line.strip():
                    yield None, reject_row(name, location, READ_STAGE, "blank_line")
                    continue
                try:
                    decoded = line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield None, reject_row(name, location, READ_STAGE, "invalid_utf8", f"byte {exc.start}: {exc.reason}")
                    continue
                try:
                    record = json.loads(decoded)
                except json.JSONDecodeError as exc:
                    yield None, reject_row(name, location, READ_STAGE, "invalid_json", f"column {exc.colno}: {exc.msg}")
                    continue
                yield record_to_row(record, source, location)
    except Exception as exc:  # corrupt gzip/zstd streams, vanished or unreadable files: the rest of the file is lost
        yield None, reject_row(name, f"{path}:line={line_no + 1}", READ_STAGE, "unreadable_file", f"{type(exc).__name__}: {exc}")
        return
    if line_no == 0:
        yield None, reject_row(name, path, READ_STAGE, "empty_file")


def _parquet_rows(path: str, source: CorpusSource) -> Iterator[tuple[Row | None, Row | None]]:
    row_no = 0
    name = source.name
    try:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as raw:
            parquet = pq.ParquetFile(raw)
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                for record in batch.to_pylist():
                    row_no += 1
                    yield record_to_row(record, source, f"{path}:row={row_no}")
    except Exception as exc:  # not Parquet, truncated footer, unreadable
        yield None, reject_row(name, f"{path}:row={row_no + 1}", READ_STAGE, "unreadable_file", f"{type(exc).__name__}: {exc}")
        return
    if row_no == 0:
        yield None, reject_row(name, path, READ_STAGE, "empty_file")


def read_file(path: str, source: CorpusSource) -> Iterator[tuple[Row | None, Row | None]]:
    """Every input unit of one file, in file order, as (row, None) or (None, reject)."""
    if source.format == "parquet":
        return _parquet_rows(path, source)
    return _jsonl_rows(path, source)


def write_parquet(path: str, rows: list[Row], schema: pa.Schema) -> None:
    """One zstd Parquet file; rows must already be in their stated order so reruns write identical bytes."""
    table = pa.Table.from_pylist([{f: row.get(f) for f in schema.names} for row in rows], schema=schema)
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer, compression="zstd", row_group_size=8192)
    with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as out:
        out.write(buffer.getvalue().to_pybytes())
