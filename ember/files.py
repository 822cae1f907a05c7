"""Writing a local file so that it appears under its name only complete; telling a local path from a URL;
reading lines of untrusted files without holding an arbitrarily long one.

Manifests, shards, ownership lists and verification markers all need the same guarantee: a reader sees the old
file, no file, or the whole new one, and a failed write (a full disk) leaves nothing under either name.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

SKIP_READ_BYTES = 1 << 20  # a too-long line is read past in pieces of this size


def write_atomically(path: str | Path, data: bytes, *, durable: bool = True) -> Path:
    """Write `data` to a hidden temporary beside `path`, fsync it (unless `durable=False`, for caches), then
    `os.replace` it onto `path`; on any failure the temporary is removed. The file is 0644, readable by the
    other users' jobs that read outputs (mkstemp alone creates 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def is_url(location: str | Path) -> bool:
    """gs://, s3:// (any scheme): here, not in ember.storage, so configs can tell without importing Beam."""
    return "://" in str(location)


def bounded_lines(stream: BinaryIO, cap: int) -> Iterator[tuple[bytes | None, int]]:
    """(line with its newline, its length) for each line of a binary stream, or (None, length) for a line of more
    than `cap` bytes before its newline: that one is read past in `SKIP_READ_BYTES` pieces, never held whole (a
    few KiB of gzip can hold a line of hundreds of MiB)."""
    while line := stream.readline(cap + 1):
        if len(line) <= cap or line.endswith(b"\n"):
            yield line, len(line)
            continue
        length = len(line)
        while not line.endswith(b"\n") and (line := stream.readline(SKIP_READ_BYTES)):
            length += len(line)
        yield None, length


def record_format(path: str | Path, error: type[Exception], what: str, setting: str) -> str:
    """jsonl for .jsonl/.json/.jsonl.gz, parquet for .parquet; anything else is `error` naming the file, `what` it
    should have been (e.g. "task set") and the `setting` that names a format instead."""
    name = str(path).lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz", ".json")):
        return "jsonl"
    raise error(f"{path}: unknown {what} type; use .jsonl, .jsonl.gz or .parquet (or set {setting})")


def read_records(path: Path, fmt: str, error: type[Exception], max_line_bytes: int) -> Iterator[tuple[str, dict]]:
    """(where, record) for each record of a small JSONL (.gz too) or Parquet file of JSON objects (a benchmark, a
    prompt or task set): `where` is `path:line` or `path row N`, and anything unusable (not the format, a cut gzip,
    invalid UTF-8, a line over `max_line_bytes`, a value that is not an object) is `error` naming it."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several types for a file that is not Parquet; invalid UTF-8 too
            raise error(f"{path}: not a readable Parquet file: {type(exc).__name__}: {exc}") from None
        for i, row in enumerate(rows):
            yield f"{path} row {i}", row
        return
    opener = gzip.open if path.name.endswith(".gz") else open
    number = 0
    try:
        with opener(path, "rb") as stream:
            for number, (line, length) in enumerate(bounded_lines(stream, max_line_bytes), 1):
                where = f"{path}:{number}"
                if line is None:
                    raise error(f"{where}: a line of {length:,} bytes, more than {max_line_bytes:,}")
                if line.strip():
                    yield where, _json_object(line, where, error)
    except (OSError, EOFError) as exc:  # unreadable, not gzip, a cut or corrupt gzip stream
        raise error(f"{path}: unreadable after {number} line(s): {type(exc).__name__}: {exc}") from None


def _json_object(line: bytes, where: str, error: type[Exception]) -> dict:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 (byte {exc.start}: {exc.reason})") from None
    except RecursionError:
        raise error(f"{where}: not a JSON object: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer past Python's conversion limit
        raise error(f"{where}: not a JSON object: {exc}") from None
    if not isinstance(record, dict):
        raise error(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record
