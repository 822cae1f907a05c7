"""Reading raw corpus files into document rows, and writing sorted Parquet shards, on any Beam filesystem.

Reading never raises for bad data: every input unit (a JSONL line, a Parquet row, an empty or
unreadable file) comes out either as a document row or as a reject with `path:line=N` / `path:row=N`
and a reason. Document rows are plain dicts in `DOCUMENT_SCHEMA` layout plus `location`, the cheapest
shape for Beam's coders.

A file that breaks part way (a truncated or corrupt gzip/zstd stream, a Parquet page that fails its
checksum or does not decode, an I/O error, a plain JSONL file that ends inside a line) follows one
rule: the units read before the break are kept, and the break is one `unreadable_file` reject at the
line/row reached. How many lines followed the break cannot be known, so that one reject stands for
all of them; the read stage counts such files as `files_unreadable` and the report says so.

A JSONL line is read at most `max_line_bytes` (the source's setting) at a time: a longer one is a
`line_too_long` reject at its `path:line=N`, skipped to its newline in bounded reads without being held,
so a small compressed file holding one huge line costs the worker no more memory than a line at the cap.
Decompression is bounded the same way (gzip's reader by its own design, zstd by `ZstdFrames`).

WARC archives (`format: warc`, ember/pipelines/web/warc.py) give one unit per response record,
at `path:record=N`, and HTML files (`format: html`) one per file; their pages become text in
ember/pipelines/web/html_text.py, and a page that does not (too large, undecodable, empty, over the time
limit) is a reject with that reason. A cut WARC follows the rule above at the record reached.

Source trees (`format: files`, ember/pipelines/corpus/trees.py) give one unit per file, at its path: a
document with id `<source>:<repo>/<relpath>` and the repository's metadata, or a `binary_file` reject (a
NUL byte in the first 8 KiB, or not UTF-8), or `file_too_large` for a file that grew past the size the
walk admitted (read no further).

Text with C0 control characters other than tab, newline, carriage return and form feed (a NUL from an
escaped `\u0000`, ESC, ...) is never kept as is: a source's `control_characters` policy rejects the
document (`control_characters`, with the first one's code point and offset, never the text) or
strips them.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from ember.files import bounded_lines
from ember.pipelines.quality.code_filters import language_from_path
from ember.pipelines.corpus.config import CorpusSource
from ember.pipelines.corpus.trees import TreeFile
from ember.pipelines.web.html_text import ExtractOptions, HtmlExtractor, Submitted, thread_extractor
from ember.pipelines.web.warc import WarcBreak, WarcPage, WarcReject, read_warc
from ember.schemas.documents import METADATA_KEYS, content_hash, make_document_id, reject_row

READ_STAGE = "read"
UNREADABLE = "unreadable_file"
LINE_TOO_LONG = "line_too_long"
PARQUET_BATCH_ROWS = 1024
ZSTD_READ_BYTES = 1 << 16
# zstd's densest block (RLE: 4 bytes for 128 KiB) expands 32768-fold, so one decompress call on this much
# input yields at most 8 MiB however the file was built (held twice while zstandard joins its pieces). The
# price: about half zstandard's throughput on ordinary JSONL, still above json.loads' on what it yields.
ZSTD_FEED_BYTES = 256
# C0 controls except \t \n \f \r (form feeds are page breaks in real source code).
CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b\x0e-\x1f]")

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


def _control_detail(text: str, first: re.Match[str]) -> str:
    """Where the control characters are, never what the text says."""
    count = len(CONTROL_CHARACTERS.findall(text))
    return f"{count} control character(s), the first U+{ord(first.group()):04X} at character {first.start()}"


def _checked_text(text: str, source: CorpusSource) -> tuple[str, str, str]:
    """(text, "", "") with the control-character policy applied, or ("", reason, detail)."""
    if source.control_characters == "strip":
        text = CONTROL_CHARACTERS.sub("", text)
    if not text.strip():
        return "", "empty_text", ""
    if not _encodable(text):
        return "", "invalid_unicode", "text holds lone surrogates"
    control = CONTROL_CHARACTERS.search(text)
    if control:
        return "", "control_characters", _control_detail(text, control)
    return text, "", ""


def _document_row(text: str, source: CorpusSource, location: str, doc_id: str, metadata: dict[str, Any]) -> Row:
    return {
        "id": doc_id,
        "source": source.name,
        "kind": source.kind,
        "text": text,
        "content_hash": content_hash(text),
        "metadata": {k: metadata.get(k) for k in METADATA_KEYS},
        "location": location,
    }


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
    text, reason, detail = _checked_text(text, source)
    if reason:
        return bad(reason, detail)
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
    return _document_row(text, source, location, doc_id, metadata), None


class TruncatedStream(EOFError):
    """A compressed stream that ends before its last frame does."""


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of consecutive zstd frames, raising `TruncatedStream` when the input ends
    inside a frame; zstandard's stream reader ends quietly there, losing the rest of the file unseen.

    Input goes to the decompressor `ZSTD_FEED_BYTES` at a time, so what one read holds in memory is bounded
    whatever the compression ratio (a few KiB of zstd can hold hundreds of MiB of one repeated byte)."""

    def __init__(self, raw: Any):
        super().__init__()
        self._raw = raw
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame: Any = None
        self._input = memoryview(b"")
        self._carry = b""  # what a piece held past its frame's end: the next frame's first piece
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def _feed(self) -> bytes:
        """The output of the next piece of input, at most `ZSTD_FEED_BYTES`."""
        if self._frame is None or self._frame.eof:
            self._frame = self._decompressor.decompressobj()
        if self._carry:
            piece, self._carry = self._carry, b""
        else:
            piece, self._input = self._input[:ZSTD_FEED_BYTES], self._input[ZSTD_FEED_BYTES:]
        out = self._frame.decompress(piece)
        if self._frame.eof:
            self._carry = self._frame.unused_data
        return out

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            if not self._input and not self._carry:
                self._input = memoryview(self._raw.read(ZSTD_READ_BYTES))
                if not self._input:
                    if self._frame is not None and not self._frame.eof:
                        raise TruncatedStream("the zstd stream ends inside a frame (truncated file)")
                    return 0
            self._pending = memoryview(self._feed())
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]  # a view: no copy of what is still pending
        return n


def _decompressed(raw: Any, fmt: str) -> io.BufferedIOBase:
    if fmt == "jsonl.gz":
        return gzip.GzipFile(fileobj=raw)  # raises EOFError on a truncated member, BadGzipFile on a bad CRC
    if fmt == "jsonl.zst":
        return io.BufferedReader(ZstdFrames(raw))
    return raw


def _broken(name: str, path: str, unit: str, reached: int, exc: BaseException) -> Row:
    """The one reject a file that breaks part way gets: at the unit reached; what followed is unknown."""
    return reject_row(
        name, f"{path}:{unit}={reached + 1}", READ_STAGE, UNREADABLE,
        f"{type(exc).__name__}: {exc}; read stopped after {unit} {reached} of {path}, what followed is unknown",
    )


def _parse_line(line: bytes) -> tuple[Any, str, str]:
    """(record, "", "") or (None, reason, detail) for one JSONL line without its newline."""
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, "invalid_utf8", f"byte {exc.start}: {exc.reason}"
    try:
        return json.loads(decoded), "", ""
    except json.JSONDecodeError as exc:
        return None, "invalid_json", f"column {exc.colno}: {exc.msg}"
    except RecursionError:
        return None, "invalid_json", "nested too deeply"
    except ValueError as exc:  # integers longer than Python's int conversion limit
        return None, "invalid_json", str(exc).split(":")[0]


def _jsonl_rows(path: str, source: CorpusSource) -> Iterator[tuple[Row | None, Row | None]]:
    line_no = 0
    name = source.name
    cap = source.max_line_bytes
    try:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as raw:
            stream = _decompressed(raw, source.format)
            for line_no, (line, length) in enumerate(bounded_lines(stream, cap), 1):
                location = f"{path}:line={line_no}"
                if line is None:
                    yield None, reject_row(
                        name, location, READ_STAGE, LINE_TOO_LONG,
                        f"line {line_no} of {path} has {length:,} bytes, more than max_line_bytes ({cap:,}): skipped unread",
                    )
                    continue
                terminated = line.endswith(b"\n")
                line = line.rstrip(b"\r\n")
                if not line.strip():
                    yield None, reject_row(name, location, READ_STAGE, "blank_line")
                    continue
                record, reason, detail = _parse_line(line)
                if reason and not terminated:  # the last line, cut: the file is truncated, not just one bad line
                    yield None, reject_row(
                        name, location, READ_STAGE, UNREADABLE,
                        f"{path} ends inside line {line_no}, which has no newline and is not a record ({reason}: {detail}): truncated",
                    )
                elif reason:
                    yield None, reject_row(name, location, READ_STAGE, reason, detail)
                else:
                    yield record_to_row(record, source, location)
    except Exception as exc:  # corrupt or truncated gzip/zstd streams, vanished or unreadable files
        yield None, _broken(name, path, "line", line_no, exc)
        return
    if line_no == 0:
        yield None, reject_row(name, path, READ_STAGE, "empty_file")


def _records(batch: pa.RecordBatch) -> Iterator[tuple[Any, BaseException | None]]:
    """A batch's rows as Python objects; a row that does not convert (invalid UTF-8 in a string
    column) is that row's error, not the end of the file."""
    try:
        records = batch.to_pylist()
    except (UnicodeDecodeError, ValueError, OverflowError, pa.ArrowException):
        for i in range(batch.num_rows):
            try:
                yield batch.slice(i, 1).to_pylist()[0], None
            except (UnicodeDecodeError, ValueError, OverflowError, pa.ArrowException) as exc:
                yield None, exc
        return
    for record in records:
        yield record, None


def _parquet_rows(path: str, source: CorpusSource) -> Iterator[tuple[Row | None, Row | None]]:
    row_no = 0
    name = source.name
    try:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as raw:
            # Page CRCs, where the writer stored them, catch flipped bytes that would otherwise decode as text.
            parquet = pq.ParquetFile(raw, page_checksum_verification=True)
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                for record, error in _records(batch):
                    row_no += 1
                    location = f"{path}:row={row_no}"
                    if error is not None:
                        yield None, reject_row(name, location, READ_STAGE, "unconvertible_row", f"{type(error).__name__}: {error}")
                    else:
                        yield record_to_row(record, source, location)
    except Exception as exc:  # not Parquet, truncated footer, corrupt page, unreadable
        yield None, _broken(name, path, "row", row_no, exc)
        return
    if row_no == 0:
        yield None, reject_row(name, path, READ_STAGE, "empty_file")


def _extractor(source: CorpusSource) -> HtmlExtractor:
    return thread_extractor(ExtractOptions(source.html.time_limit_s, source.html.max_bytes, source.html.main_content))


def _page_row(extracted: tuple[str, str, str], source: CorpusSource, location: str, doc_id: str,
              metadata: dict[str, Any]) -> tuple[Row | None, Row | None]:
    """One HTML page's document, or its reject: the extraction's verdict, then the text checks."""
    text, reason, detail = extracted
    if not reason:
        text, reason, detail = _checked_text(text, source)
    if reason:
        return None, reject_row(source.name, location, READ_STAGE, reason, detail)
    return _document_row(text, source, location, doc_id, metadata), None


def _warc_item_row(item: WarcBreak | WarcReject, path: str, name: str) -> Row:
    if isinstance(item, WarcReject):
        return reject_row(name, f"{path}:record={item.number}", READ_STAGE, item.reason, f"{item.url or item.record_id}: {item.detail}")
    return reject_row(
        name, f"{path}:record={item.whole + 1}", READ_STAGE, UNREADABLE,
        f"{type(item.error).__name__}: {item.error}; at byte {item.offset:,} of the (decompressed) WARC, "
        f"read stopped after record {item.whole} of {path}, what followed is unknown",
    )


def _warc_rows(path: str, source: CorpusSource) -> Iterator[tuple[Row | None, Row | None]]:
    """Each HTML response record: a document with id `<source>:<WARC-Record-ID>` (the target URI where a record
    has none), or a reject at `path:record=N`; a cut or corrupt archive ends with one unreadable_file reject.

    A page goes to the extraction child before the next record is read, so reading and extraction overlap;
    units still come out in file order."""
    name = source.name
    extractor = _extractor(source)
    units = 0
    pending: tuple[WarcPage, Submitted] | None = None

    def finished(page: WarcPage, submitted: Submitted) -> tuple[Row | None, Row | None]:
        location = f"{path}:record={page.number}"
        metadata = {"url": page.url, "fetch_date": page.date, "content_type": page.content_type}
        return _page_row(extractor.collect(submitted), source, location, f"{name}:{page.record_id or page.url or location}", metadata)

    try:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as raw:
            for item in read_warc(raw, source.html.max_bytes):
                units += 1
                if pending is not None:
                    yield finished(*pending)
                    pending = None
                if isinstance(item, WarcPage):
                    pending = item, extractor.submit(item.payload, item.charset)
                else:
                    yield None, _warc_item_row(item, path, name)
            if pending is not None:
                yield finished(*pending)
    except Exception as exc:  # the file vanished or cannot be opened
        yield None, _broken(name, path, "record", 0, exc)
        return
    if units == 0:
        yield None, reject_row(name, path, READ_STAGE, "empty_file", "no HTML response record")


def _html_file_rows(path: str, source: CorpusSource) -> Iterator[tuple[Row | None, Row | None]]:
    """One HTML page per file, its path the id; the charset comes from the page (<meta>) or detection."""
    try:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as raw:
            html = raw.read(source.html.max_bytes + 1)  # a larger file is rejected unread past its limit
    except Exception as exc:
        yield None, _broken(source.name, path, "page", 0, exc)
        return
    if not html:
        yield None, reject_row(source.name, path, READ_STAGE, "empty_file")
        return
    yield _page_row(_extractor(source).extract(html), source, path, f"{source.name}:{path}", {"path": path, "content_type": "text/html"})


BINARY_SNIFF_BYTES = 8192  # where git itself looks for a NUL to call a file binary


def _tree_file_rows(unit: TreeFile, source: CorpusSource) -> Iterator[tuple[Row | None, Row | None]]:
    """One file of a source tree; at most the size the walk saw (plus one byte, to notice growth) is read."""
    name, path = source.name, unit.path

    def bad(reason: str, detail: str) -> Iterator[tuple[None, Row]]:
        yield None, reject_row(name, path, READ_STAGE, reason, detail)

    try:
        with open(path, "rb") as handle:
            data = handle.read(unit.size + 1)
    except OSError as exc:
        yield None, _broken(name, path, "file", 0, exc)
        return
    if len(data) > unit.size:
        yield from bad("file_too_large", f"{unit.relpath} grew past the {unit.size:,} bytes it had when listed: read no further")
        return
    nul = data.find(b"\0", 0, BINARY_SNIFF_BYTES)
    if nul >= 0:
        yield from bad("binary_file", f"{unit.relpath}: NUL byte at offset {nul}")
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        yield from bad("binary_file", f"{unit.relpath}: not UTF-8 (byte {exc.start}: {exc.reason})")
        return
    text, reason, detail = _checked_text(text, source)
    if reason:
        yield from bad(reason, f"{unit.relpath}: {detail}" if detail else unit.relpath)
        return
    metadata = {"repo": unit.repo, "path": unit.relpath, "license": unit.license, "language": language_from_path(unit.relpath)}
    yield _document_row(text, source, path, f"{name}:{unit.repo}/{unit.relpath}", metadata), None


def read_file(path: str | TreeFile, source: CorpusSource) -> Iterator[tuple[Row | None, Row | None]]:
    """Every input unit of one file, in file order, as (row, None) or (None, reject); a `files` source's
    unit is one `TreeFile` its walk listed."""
    if isinstance(path, TreeFile):
        return _tree_file_rows(path, source)
    if source.format == "parquet":
        return _parquet_rows(path, source)
    if source.format == "warc":
        return _warc_rows(path, source)
    if source.format == "html":
        return _html_file_rows(path, source)
    return _jsonl_rows(path, source)


ROW_GROUP_ROWS = 8192


def write_parquet(path: str, rows: Iterable[Row], schema: pa.Schema) -> None:
    """One zstd Parquet file; rows must already be in their stated order so reruns write identical bytes. Written
    one row group at a time, straight into the file: only one group's rows are ever in Arrow (a part of long
    documents was three copies in memory: the rows, the table and the encoded file)."""
    with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as out:
        with pq.ParquetWriter(out, schema, compression="zstd") as writer:
            batches = itertools.batched(rows, ROW_GROUP_ROWS)
            for batch in itertools.chain([next(batches, ())], batches):  # no rows: one empty group, as write_table
                table = pa.Table.from_pylist([{f: row.get(f) for f in schema.names} for row in batch], schema=schema)
                writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
