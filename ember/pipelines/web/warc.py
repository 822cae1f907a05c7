"""WARC files (Common Crawl's .warc.gz, or plain .warc) as HTML pages, with warcio; no Beam.

Only `response` records are pages; request, metadata, warcinfo and other records are skipped (they
hold no document). A response whose HTTP status is not 2xx, or whose payload is not HTML (a PDF, an
image), comes out as a `WarcReject` with its reason (`http_status:<code>`, `not_html:<type>`), so the
build's rejects say what the archive held.

warcio ends its iteration quietly where a file is cut (it treats a short read as the end of the
archive), so breaks are found here: gzip is decompressed by Python's `gzip` (which raises on a cut
member) under a reader that remembers the error, and a record whose payload is shorter than its
Content-Length is cut. Either ends the file with one `WarcBreak` at the record reached.

A payload is read at most `max_payload` bytes (html.max_bytes) into memory: a larger page is an
`html_too_large` reject whose rest is read past in pieces, and skipped records are read past the same way,
so a small .warc.gz whose record holds gigabytes of one byte costs no more than a page at the limit.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from warcio.archiveiterator import ArchiveIterator
from warcio.exceptions import ArchiveLoadFailed

from ember.pipelines.web.html_text import TOO_LARGE

GZIP_MAGIC = b"\x1f\x8b"
SKIP_READ_BYTES = 1 << 20
HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})


@dataclass(frozen=True)
class WarcPage:
    """One HTML response: its payload bytes and what the WARC and HTTP headers say about it."""

    number: int  # 1-based among all records of the file
    offset: int  # byte offset of the record in the (decompressed) WARC stream
    record_id: str
    url: str | None
    date: str | None
    content_type: str
    charset: str | None
    payload: bytes


@dataclass(frozen=True)
class WarcReject:
    number: int
    offset: int
    record_id: str
    url: str | None
    reason: str
    detail: str


@dataclass(frozen=True)
class WarcBreak:
    """The file cannot be read past its first `whole` records: the next, at `offset`, is cut or corrupt."""

    whole: int
    offset: int
    error: BaseException


class _Remembering(io.RawIOBase):
    """A stream whose read errors end it (warcio would swallow them) and are kept for the caller."""

    def __init__(self, stream: Any):
        super().__init__()
        self._stream = stream
        self.error: BaseException | None = None
        self.position = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.error is not None:
            return 0
        try:
            data = self._stream.read1(len(buffer))  # one raw read: a read() that fails part way loses what it had
        except (EOFError, OSError, gzip.BadGzipFile) as exc:  # a cut or corrupt gzip member, an I/O error
            self.error = exc
            return 0
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


def _media_type(value: str | None) -> tuple[str, str | None]:
    """('text/html', 'utf-8') from 'text/html; charset=UTF-8'; ('', None) when absent."""
    if not value:
        return "", None
    media, *params = value.split(";")
    charset = None
    for param in params:
        key, _, val = param.partition("=")
        if key.strip().lower() == "charset" and val.strip():
            charset = val.strip().strip("\"'").lower()
    return media.strip().lower(), charset


def _record_id(record: Any) -> str:
    return (record.rec_headers.get_header("WARC-Record-ID") or "").strip("<>")


def read_warc(raw: Any, max_payload: int) -> Iterator[WarcPage | WarcReject | WarcBreak]:
    """Every response record of one WARC stream in file order, payloads of at most `max_payload` bytes;
    a `WarcBreak` is always the last item."""
    head = raw.read(2)
    body = io.BufferedReader(_Concat(head, raw))
    stream = _Remembering(gzip.GzipFile(fileobj=body) if head == GZIP_MAGIC else body)
    whole, offset = 0, 0
    try:
        records = ArchiveIterator(io.BufferedReader(stream))
        for record in records:
            offset = records.offset
            if record.format != "warc":  # warcio reads any five-word line as an ARC header
                raise ArchiveLoadFailed(f"record {whole + 1} is no WARC record (warcio reads it as {record.format})")
            if not (record.rec_headers.get_header("Content-Length") or "").strip().isdigit():  # mandatory: cut headers
                raise EOFError(f"record {whole + 1} has no Content-Length (its WARC headers end early)")
            item = _item(record, whole + 1, offset, max_payload)
            short = getattr(record.raw_stream, "limit", 0)  # bytes of the Content-Length never read
            if short:  # the stream ended (or broke: read errors end it) inside this record
                raise stream.error or EOFError(f"record {whole + 1} ends {short:,} bytes before its Content-Length")
            whole += 1
            if item is not None:
                yield item
        offset = records.offset
    except Exception as exc:  # not a WARC, headers cut short (warcio then fails anywhere), unreadable
        yield WarcBreak(whole, offset, exc)
        return
    if stream.error is not None:
        yield WarcBreak(whole, offset, stream.error)
    elif stream.position > offset:  # warcio stops quietly at a record whose headers are cut
        yield WarcBreak(whole, offset, EOFError(f"{stream.position - offset:,} bytes after the last whole record are no WARC record"))


def _read_past(record: Any) -> None:
    """Consume the rest of a record's bytes as stored (compressed, if its HTTP body is) without holding them."""
    while record.raw_stream.read(SKIP_READ_BYTES):
        pass


def _item(record: Any, number: int, offset: int, max_payload: int) -> WarcPage | WarcReject | None:
    """The page or reject of one record (its payload read up to `max_payload` bytes), or None for a non-response record."""
    if record.rec_type != "response":
        _read_past(record)
        return None
    record_id = _record_id(record)
    url = record.rec_headers.get_header("WARC-Target-URI")
    http = record.http_headers
    payload = record.content_stream().read(max_payload + 1)
    size = f"{len(payload):,} bytes"
    if len(payload) > max_payload:
        _read_past(record)
        size = f"more than {max_payload:,} bytes"
    if http is None:
        return WarcReject(number, offset, record_id, url, "not_http", "the response record holds no HTTP response")
    status = http.get_statuscode() or ""
    if not status.startswith("2"):
        return WarcReject(number, offset, record_id, url, f"http_status:{status or 'none'}", http.protocol + " " + (http.statusline or ""))
    media, charset = _media_type(http.get_header("Content-Type"))
    if media not in HTML_TYPES:
        return WarcReject(number, offset, record_id, url, f"not_html:{media or 'none'}", f"{size} of payload")
    if len(payload) > max_payload:
        return WarcReject(number, offset, record_id, url, TOO_LARGE, f"{size} of HTML > html.max_bytes {max_payload:,}; the rest read past")
    return WarcPage(number, offset, record_id, url, record.rec_headers.get_header("WARC-Date"), media, charset, payload)


class _Concat(io.RawIOBase):
    """The two bytes read to sniff gzip, then the rest of the raw stream."""

    def __init__(self, head: bytes, rest: Any):
        super().__init__()
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._rest.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
