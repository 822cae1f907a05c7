"""Writing a local file so that it appears under its name only complete; telling a local path from a URL;
reading lines of untrusted files without holding an arbitrarily long one.

Manifests, shards, ownership lists and verification markers all need the same guarantee: a reader sees the old
file, no file, or the whole new one, and a failed write (a full disk) leaves nothing under either name.
"""

from __future__ import annotations

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
