"""WARC and HTML input on archives and pages the tests write with warcio: which records become pages,
which become rejects with their reason, and that a cut archive ends in one unreadable_file reject."""

from __future__ import annotations

import io
import tracemalloc
from pathlib import Path

import pytest

from ember.configs import CorpusConfigError
from ember.pipelines.corpus.config import CorpusSource, parse_config
from ember.pipelines.corpus.formats import read_file
from ember.pipelines.web.warc import WarcBreak, WarcPage, WarcReject, read_warc

from tests.pipelines.web_support import PROSE, Record, page, warc_bytes

MAX_PAYLOAD = 10 * 2**20
RECORDS = [
    Record("http://example.com/", b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n", rec_type="request"),
    Record("http://example.com/en", page("River", [PROSE["en"]])),
    Record("http://example.com/report.pdf", b"%PDF-1.4 binary", content_type="application/pdf"),
    Record("http://example.com/missing", page("Gone", ["Not found here."]), status="404 Not Found"),
    Record("http://example.com/de", page("Fluss", [PROSE["de"]], charset="iso-8859-1"),
           content_type="text/html; charset=ISO-8859-1"),
]


def _source(fmt: str = "warc", **html: object) -> CorpusSource:
    return CorpusSource.model_validate({"name": "cc", "kind": "web", "inputs": ["x"], "format": fmt, "html": html})


@pytest.mark.parametrize("gzip", [True, False], ids=["warc.gz", "warc"])
def test_response_records_become_pages_and_other_payloads_rejects(gzip: bool) -> None:
    items = list(read_warc(io.BytesIO(warc_bytes(RECORDS, gzip)), MAX_PAYLOAD))
    assert [type(i) for i in items] == [WarcPage, WarcReject, WarcReject, WarcPage], "the request record is skipped"
    en, pdf, missing, de = items
    assert (en.number, en.url, en.content_type, en.charset) == (2, "http://example.com/en", "text/html", "utf-8")
    assert en.record_id.startswith("urn:uuid:") and en.date and en.payload == RECORDS[1].payload
    assert (pdf.reason, pdf.url) == ("not_html:application/pdf", "http://example.com/report.pdf")
    assert missing.reason == "http_status:404"
    assert (de.charset, de.payload) == ("iso-8859-1", RECORDS[4].payload)
    assert en.offset < pdf.offset < missing.offset < de.offset


@pytest.mark.parametrize("gzip", [True, False], ids=["warc.gz", "warc"])
def test_every_cut_either_breaks_or_falls_between_whole_records(gzip: bool) -> None:
    """Cut at every byte: the pages read before the cut are intact, and the cut is reported unless it falls
    where a shorter archive could end (between records, or inside the blank lines that close one)."""
    data = warc_bytes(RECORDS, gzip)
    whole = list(read_warc(io.BytesIO(data), MAX_PAYLOAD))
    # where a shorter, valid archive ends: the next record (or gzip member) starts right after
    ends = {len(data)} | {cut for cut in range(len(data)) if data[cut:cut + 4] in (b"WARC", b"\x1f\x8b\x08\x00")}
    silent = []
    for cut in range(1, len(data)):
        items = list(read_warc(io.BytesIO(data[:cut]), MAX_PAYLOAD))
        broke = bool(items) and isinstance(items[-1], WarcBreak)
        kept = items[:-1] if broke else items
        assert kept == whole[: len(kept)], f"cut at {cut}: a page changed"
        if not broke and len(kept) < len(whole):
            silent.append(cut)
    # Plain WARC: a cut inside the CRLF CRLF that closes a record is indistinguishable from an archive ending there.
    assert all(min(abs(cut - e) for e in ends) <= (0 if gzip else 4) for cut in silent), silent


def test_a_cut_warc_keeps_its_whole_records_and_names_where_it_broke(tmp_path: Path) -> None:
    data = warc_bytes(RECORDS, gzip=True)
    path = tmp_path / "cut.warc.gz"
    path.write_bytes(data[: len(data) - 40])
    results = list(read_file(str(path), _source()))
    docs = [r for r, _ in results if r is not None]
    rejects = [j for _, j in results if j is not None]
    assert [d["metadata"]["url"] for d in docs] == ["http://example.com/en"]
    assert [j["reason"] for j in rejects] == ["not_html:application/pdf", "http_status:404", "unreadable_file"]
    broken = rejects[-1]
    assert broken["location"] == f"{path}:record=5"
    assert "read stopped after record 4" in broken["detail"] and "at byte" in broken["detail"]
    assert "EOFError" in broken["detail"]


def test_warc_documents_carry_record_id_url_date_and_content_type(tmp_path: Path) -> None:
    path = tmp_path / "a.warc"
    path.write_bytes(warc_bytes(RECORDS, gzip=False))
    docs = [r for r, _ in read_file(str(path), _source()) if r is not None]
    assert [d["location"] for d in docs] == [f"{path}:record=2", f"{path}:record=5"]
    en, de = docs
    assert en["id"].startswith("cc:urn:uuid:") and en["kind"] == "web"
    assert en["metadata"]["url"] == "http://example.com/en" and en["metadata"]["content_type"] == "text/html"
    assert en["metadata"]["fetch_date"].endswith("Z")
    assert PROSE["en"] in en["text"] and "About us" not in en["text"], "main content only: no navigation"
    assert PROSE["de"] in de["text"], "the declared ISO-8859-1 charset decodes the umlauts"


def test_html_files_one_page_each_with_charset_from_the_page(tmp_path: Path) -> None:
    (tmp_path / "a.html").write_bytes(page("Fluss", [PROSE["de"]], charset="iso-8859-1"))
    (tmp_path / "scripts.html").write_bytes(b"<html><head><script>var x = 1;</script></head><body></body></html>")
    (tmp_path / "empty.html").write_bytes(b"")
    (tmp_path / "big.html").write_bytes(page("Big", [PROSE["en"]] * 50))
    source = _source("html", max_bytes=10_000)
    out = {}
    for name in ("a.html", "scripts.html", "empty.html", "big.html"):
        [(row, rejected)] = list(read_file(str(tmp_path / name), source))
        out[name] = row or rejected
    assert out["a.html"]["id"] == f"cc:{tmp_path / 'a.html'}" and PROSE["de"] in out["a.html"]["text"]
    assert out["a.html"]["metadata"]["path"] == str(tmp_path / "a.html")
    assert out["scripts.html"]["reason"] == "html_empty"
    assert out["empty.html"]["reason"] == "empty_file"
    assert out["big.html"]["reason"] == "html_too_large" and "html.max_bytes 10,000" in out["big.html"]["detail"]


def test_a_file_that_is_no_warc_is_one_unreadable_reject(tmp_path: Path) -> None:
    path = tmp_path / "notes.warc"
    path.write_bytes(b"these are my notes, not an archive\n")
    [(row, rejected)] = list(read_file(str(path), _source()))
    assert row is None and rejected["reason"] == "unreadable_file" and rejected["location"] == f"{path}:record=1"
    assert "ArchiveLoadFailed: record 1 is no WARC record" in rejected["detail"]


def test_warc_and_html_sources_are_web_without_field_mappings() -> None:
    base = {"name": "cc", "inputs": ["x"], "format": "warc"}
    with pytest.raises(CorpusConfigError, match="format warc reads web pages: set kind: web"):
        parse_config({"sources": [{**base, "kind": "code"}], "output": {"directory": "o"}})
    with pytest.raises(CorpusConfigError, match="format warc takes no fields mapping"):
        parse_config({"sources": [{**base, "kind": "web", "fields": {"text": "body"}}], "output": {"directory": "o"}})
    with pytest.raises(CorpusConfigError, match="time_limit_s"):
        parse_config({"sources": [{**base, "kind": "web", "html": {"time_limit_s": 0}}], "output": {"directory": "o"}})


def test_a_payload_over_max_payload_is_an_html_too_large_reject_read_past_without_being_held() -> None:
    huge = 32 * 2**20
    data = warc_bytes([
        RECORDS[1],
        Record("http://example.com/huge", b"<html><body><p>" + b"a" * huge + b"</p></body></html>"),
        Record("http://example.com/huge.bin", b"\0" * huge, content_type="application/octet-stream"),
        Record("http://example.com/ask", b"POST /ask HTTP/1.1\r\nHost: example.com\r\n\r\n" + b"\0" * huge, rec_type="request"),
        RECORDS[4],
    ], gzip=True)
    assert len(data) < huge // 100
    tracemalloc.start()
    try:
        items = list(read_warc(io.BytesIO(data), 2**20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [type(i) for i in items] == [WarcPage, WarcReject, WarcReject, WarcPage], "the request record is skipped"
    assert (items[1].reason, items[1].detail) == (
        "html_too_large", f"more than {2**20:,} bytes of HTML > html.max_bytes {2**20:,}; the rest read past")
    assert (items[2].reason, items[2].detail) == ("not_html:application/octet-stream", f"more than {2**20:,} bytes of payload")
    assert items[3].payload == RECORDS[4].payload
    assert peak < huge // 4, f"reading held {peak:,} bytes at once"
