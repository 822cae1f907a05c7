"""HTML -> plain text with resiliparse, under a per-document time limit that is enforced.

resiliparse's extractor is native code: a thread cannot be interrupted inside it and a signal would
reach the whole Beam worker. So extraction runs in a child process (one per worker thread, started
once through the forkserver and kept), and a page that overruns `time_limit_s` gets its child
killed and replaced; the page becomes an `html_timeout` reject and the next page goes to the new child.

Bytes are decoded here, not by the caller: the charset the HTTP header declares, else the one
resiliparse detects (a `<meta charset>` included), then UTF-8 and cp1252; a page that none of them
decode without error is an `html_decode_error` reject. Failures are (reason, detail) pairs, never raised.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from resiliparse.extract.html2text import extract_plain_text
from resiliparse.parse.encoding import bytes_to_str, detect_encoding

FALLBACK_ENCODINGS = ("utf-8", "cp1252")

TIMEOUT = "html_timeout"
TOO_LARGE = "html_too_large"
DECODE_ERROR = "html_decode_error"
EMPTY = "html_empty"
EXTRACT_ERROR = "html_extract_error"


@dataclass(frozen=True)
class ExtractOptions:
    """What `HtmlExtractor` needs of a source's `html:` settings (kept free of the config models)."""

    time_limit_s: float
    max_bytes: int
    main_content: bool = True


def decode_html(data: bytes, charset: str | None) -> str:
    """The page as text: declared charset, else detected, then the fallbacks; raises UnicodeDecodeError
    when none decodes it (resiliparse raises the first encoding's error)."""
    encoding = charset or detect_encoding(data, from_html_meta=True) or "utf-8"
    try:
        return bytes_to_str(data, encoding, errors="strict", fallback_encodings=FALLBACK_ENCODINGS)
    except LookupError:  # a declared charset Python does not know: detect instead
        detected = detect_encoding(data, from_html_meta=True) or "utf-8"
        return bytes_to_str(data, detected, errors="strict", fallback_encodings=FALLBACK_ENCODINGS)


def extract(data: bytes, charset: str | None, main_content: bool) -> tuple[str, str, str]:
    """(text, "", "") or ("", reason, detail), in this process and without a time limit."""
    try:
        html = decode_html(data, charset)
    except UnicodeDecodeError as exc:
        return "", DECODE_ERROR, f"{exc.encoding} at byte {exc.start}: {exc.reason} (fallbacks {', '.join(FALLBACK_ENCODINGS)} failed too)"
    try:
        text = extract_plain_text(html, main_content=main_content, preserve_formatting=True)
    except Exception as exc:  # resiliparse's HTMLParserException, or anything its native code reports
        return "", EXTRACT_ERROR, f"{type(exc).__name__}: {exc}"
    if not text.strip():
        return "", EMPTY, f"no text in {len(data):,} bytes of HTML" + (" (main_content)" if main_content else "")
    return text, "", ""


def _serve(conn: Connection, main_content: bool) -> None:
    """The child: extract every (bytes, charset) it is sent until the parent closes the pipe."""
    conn.send("ready")
    while True:
        try:
            data, charset = conn.recv()
        except EOFError:
            return
        conn.send(extract(data, charset, main_content))


@dataclass(frozen=True)
class Submitted:
    """A page handed to the child: its size and deadline, or its result already (too large, child gone)."""

    size: int
    deadline: float
    result: tuple[str, str, str] | None = None


class HtmlExtractor:
    """Extraction in a kept child process; a page over the time limit kills it (a new one starts for the next)."""

    def __init__(self, options: ExtractOptions):
        self.options = options
        self._process: Any = None
        self._conn: Connection | None = None
        self._busy = False  # a page is in the child

    def _start(self) -> Connection:
        context = multiprocessing.get_context("forkserver")  # never fork a threaded Beam worker
        parent, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self.options.main_content), daemon=True)
        self._process.start()
        child.close()
        parent.recv()  # "ready": start-up is not part of any page's time limit
        self._conn = parent
        return parent

    def close(self) -> None:
        self._busy = False
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._process = None

    def submit(self, data: bytes, charset: str | None = None) -> Submitted:
        """Hand a page to the child and return at once, so the caller can read the next record meanwhile;
        `collect` waits for it until `time_limit_s` after the hand-over (the child starts on it right away)."""
        limit = self.options.max_bytes
        if len(data) > limit:
            return Submitted(len(data), 0.0, ("", TOO_LARGE, f"{len(data):,} bytes of HTML > html.max_bytes {limit:,}"))
        if self._busy:  # an earlier page was never collected (its reader was abandoned): its answer must not leak
            self.close()
        conn = self._conn or self._start()
        try:
            conn.send((data, charset))
        except OSError as exc:  # the child died (out of memory, a native crash)
            self.close()
            return Submitted(len(data), 0.0, ("", EXTRACT_ERROR, f"the extraction process ended: {type(exc).__name__}: {exc}"))
        self._busy = True
        return Submitted(len(data), time.monotonic() + self.options.time_limit_s)

    def collect(self, submitted: Submitted) -> tuple[str, str, str]:
        """(text, "", "") or ("", reason, detail): too large, decode error, empty, extractor error or timeout."""
        if submitted.result is not None:
            return submitted.result
        conn = self._conn
        assert conn is not None and self._busy, "collect() follows its submit()"
        try:
            if conn.poll(max(0.0, submitted.deadline - time.monotonic())):
                result = conn.recv()
                self._busy = False
                return result
            reason = TIMEOUT
            detail = f"extraction of {submitted.size:,} bytes took over html.time_limit_s {self.options.time_limit_s}s"
        except (EOFError, OSError) as exc:  # the child died (out of memory, a native crash)
            reason, detail = EXTRACT_ERROR, f"the extraction process ended: {type(exc).__name__}: {exc}"
        self.close()
        return "", reason, detail

    def extract(self, data: bytes, charset: str | None = None) -> tuple[str, str, str]:
        return self.collect(self.submit(data, charset))

    def __enter__(self) -> HtmlExtractor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_local = threading.local()


def thread_extractor(options: ExtractOptions) -> HtmlExtractor:
    """This thread's extractor for `options`, started on first use and kept: Beam runs a DoFn's bundles on
    several threads, and each needs its own child to keep extraction parallel."""
    extractors = _local.__dict__.setdefault("extractors", {})
    if options not in extractors:
        extractors[options] = HtmlExtractor(options)
    return extractors[options]
