"""Checks that a shard set on disk is complete and unchanged since its manifest was written.

`verify_shard_set` is the audit (`ember corpus verify`): every size, sha256, column, row count and
token id, every time. `ShardVerifier` is what readers call before they use a shard's data (the
training loader, `ember corpus inspect`, `ember export megatron`): size and sha256 against the
manifest, hashed once per version of the file thanks to a verified-once marker.

Markers live in a cache directory (`$EMBER_CACHE_DIR`, else `$XDG_CACHE_HOME/ember`, else
`~/.cache/ember`; subdirectory `verified-shards`), not beside the set: shard sets are often shared
and read-only, and a rebuild must find nothing in its output that it did not write. One JSON marker
per shard records its resolved path, the manifest's size and sha256 for it, and the file's size,
mtime_ns, ctime_ns and inode when it was hashed; it is trusted only while all of them are unchanged.
A write in the same clock tick as the hash would leave mtime and ctime unchanged, so (as git does
for its index) a marker is written only for a file whose mtime and ctime are `RACY_NS` older than
the start of the hash.
Several processes (data-parallel ranks, jobs) check each shard under an exclusive flock on one of
256 lock files (chosen by the marker's name, so the cache holds a bounded number of them), taking
free shards first and waiting for busy ones after, so a shard is hashed once, not once per rank; a
marker is written to a temporary name and renamed, so a reader sees no marker or a complete one.
An unwritable cache directory only costs rehashing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ember.files import write_atomically
from ember.schemas import PACKED_SEQUENCE_SCHEMA, Manifest, read_manifest
from ember.schemas.shards import MANIFEST_FILENAME, ShardEntry
from ember.tokenize.shards import read_row

RACY_NS = 2_000_000_000  # above the mtime granularity of common local and network filesystems
MARKER_SUBDIR = "verified-shards"


class ShardError(ValueError):
    """A shard is missing, differs from its manifest entry, or holds data its manifest rules out;
    the message names the shard file and what differs."""


def file_sha256(path: Path, chunk: int = 8 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileState:
    """What a file's metadata says about its version: a write or a replacement changes at least one of
    these (mtime and ctime within the filesystem's clock tick: see `RACY_NS`)."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int

    @classmethod
    def of(cls, path: Path) -> "FileState":
        st = path.stat()
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def size_problem(path: Path, entry: ShardEntry) -> str | None:
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    return None if size == entry.bytes else f"{size} bytes, the manifest says {entry.bytes}"


def hash_problem(digest: str, entry: ShardEntry) -> str | None:
    if digest == entry.sha256:
        return None
    return (
        f"sha256 mismatch: the file hashes to {digest[:16]}..., the manifest says {entry.sha256[:16]}... "
        "(the file changed after the manifest was written)"
    )


def vocab_problem(tokens: np.ndarray, vocab_size: int, first_row: int) -> str | None:
    """The first token id >= vocab_size in a [rows, seq_len] block, named by row and position."""
    found = vocab_problem_at(tokens, vocab_size)
    return None if found is None else f"row {first_row + found[0]}{found[1]}"


def vocab_problem_at(tokens: np.ndarray, vocab_size: int | np.ndarray) -> tuple[int, str] | None:
    """(row, " position P: ...") of the first token id outside the vocabulary in a [rows, seq_len] block;
    `vocab_size` is one for all rows or one per row (rows gathered from shard sets of different tokenizers)."""
    if tokens.size == 0:
        return None
    limits = np.broadcast_to(vocab_size, tokens.shape[:1])
    over = tokens.max(axis=1) >= limits
    if not over.any():
        return None
    row = int(np.flatnonzero(over)[0])
    limit = int(limits[row])
    position = int(np.flatnonzero(tokens[row] >= limit)[0])
    return row, (f" position {position}: token id {int(tokens[row, position])} is outside the vocabulary "
                 f"(tokenizer.vocab_size {limit})")


def default_marker_dir() -> Path:
    base = os.environ.get("EMBER_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ember"
    return Path(base) / MARKER_SUBDIR


@dataclass(frozen=True)
class Verified:
    states: dict[str, FileState]  # manifest path -> the file version that matched the manifest
    hashed: list[str]  # manifest paths hashed by this call (the others had a valid marker)


class ShardVerifier:
    """Size and sha256 of shards against their manifest entries, each file version hashed once."""

    def __init__(self, marker_dir: Path | None = None, racy_ns: int = RACY_NS):
        self.marker_dir = marker_dir or default_marker_dir()
        self.racy_ns = racy_ns

    def check(self, directory: str | Path, entries: Sequence[ShardEntry]) -> Verified:
        """Raises ShardError naming every missing, resized or changed shard; sizes are checked for all
        shards before any is hashed, so a missing file is reported at once."""
        directory = Path(directory)
        problems = [f"{directory / e.path}: {p}" for e in entries if (p := size_problem(directory / e.path, e))]
        if problems:
            raise ShardError("; ".join(problems))
        markers = self._markers()
        states: dict[str, FileState] = {}
        hashed: list[str] = []
        pending = list(entries)
        for blocking in (False, True):  # free shards first: other processes hash the ones they hold meanwhile
            busy = []
            for entry in pending:
                try:
                    done = self._check_one(directory / entry.path, entry, markers, blocking=blocking)
                except ShardError as exc:
                    problems.append(str(exc))
                    continue
                if done is None:
                    busy.append(entry)
                    continue
                states[entry.path], was_hashed = done
                hashed += [entry.path] if was_hashed else []
            pending = busy
        if problems:
            raise ShardError("; ".join(problems))
        return Verified({e.path: states[e.path] for e in entries}, hashed)

    def _markers(self) -> Path | None:
        try:
            self.marker_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        return self.marker_dir if os.access(self.marker_dir, os.W_OK) else None

    def _check_one(
        self, path: Path, entry: ShardEntry, markers: Path | None, *, blocking: bool
    ) -> tuple[FileState, bool] | None:
        """(verified state, hashed?), or None when another process holds the shard and blocking is off."""
        try:
            return self._locked_check(path, entry, markers, blocking=blocking)
        except OSError as exc:  # removed or made unreadable since the size check
            raise ShardError(f"{path}: {exc.strerror or exc}") from None

    def _locked_check(
        self, path: Path, entry: ShardEntry, markers: Path | None, *, blocking: bool
    ) -> tuple[FileState, bool] | None:
        if markers is None:
            return self._hash(path, entry, None), True
        name = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:40]
        try:
            lock = os.open(markers / f"{name[:2]}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:  # a cache we cannot lock in is no cache
            return self._hash(path, entry, None), True
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                return None
            marker = markers / f"{name}.json"
            state = FileState.of(path)
            if _read_marker(marker) == _marker_record(path, entry, state):
                return state, False
            return self._hash(path, entry, marker), True
        finally:
            os.close(lock)  # releases the flock

    def _hash(self, path: Path, entry: ShardEntry, marker: Path | None) -> FileState:
        started = time.time_ns()
        before = FileState.of(path)
        if before.size != entry.bytes:
            raise ShardError(f"{path}: {before.size} bytes, the manifest says {entry.bytes}")
        digest = file_sha256(path)
        if FileState.of(path) != before:
            raise ShardError(f"{path}: changed while it was being verified")
        if problem := hash_problem(digest, entry):
            raise ShardError(f"{path}: {problem}")
        if marker is not None and max(before.mtime_ns, before.ctime_ns) + self.racy_ns < started:
            _write_marker(marker, _marker_record(path, entry, before))
        return before


def _marker_record(path: Path, entry: ShardEntry, state: FileState) -> dict:
    return {"path": str(path.resolve()), "sha256": entry.sha256, "bytes": entry.bytes, **asdict(state)}


def _read_marker(marker: Path) -> dict | None:
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def _write_marker(marker: Path, record: dict) -> None:
    try:
        write_atomically(marker, json.dumps(record).encode("utf-8"), durable=False)
    except OSError:
        return  # a cache that cannot be written only costs a rehash next time


def content_problems(path: Path, entry: ShardEntry, manifest: Manifest) -> list[str]:
    """Columns, row count, row lengths and token ids of one shard (its bytes already verified)."""
    try:
        with ipc.open_file(path) as reader:
            missing = [f.name for f in PACKED_SEQUENCE_SCHEMA if not f.nullable and f.name not in reader.schema.names]
            if missing:
                return [f"missing required columns {missing}"]
            rows = 0
            for i in range(reader.num_record_batches):
                column = reader.get_batch(i).column("tokens")
                lengths = np.diff(column.offsets.to_numpy())
                if np.any(lengths != manifest.seq_len):
                    bad = int(np.flatnonzero(lengths != manifest.seq_len)[0])
                    return [f"row {rows + bad} holds {int(lengths[bad])} tokens, seq_len is {manifest.seq_len}"]
                tokens = column.flatten().to_numpy().reshape(len(column), -1)
                if problem := vocab_problem(tokens, manifest.tokenizer.vocab_size, rows):
                    return [problem]
                rows += len(column)
    except (pa.ArrowException, OSError) as exc:
        return [f"not a readable Arrow IPC shard ({exc})"]
    return [] if rows == entry.rows else [f"{rows} rows, the manifest says {entry.rows}"]


def summary_rows(manifest: Manifest) -> list[tuple[str, str]]:
    """(label, value) pairs that say what a shard set holds, for `verify` and `inspect`: what an operator checks
    before training on it (tokenizer, sizes, fill, and each source's share of the tokens)."""
    tokens = sum(s.tokens for s in manifest.sources.values())
    rows = sum(e.rows for e in manifest.shards)
    slots = rows * manifest.seq_len
    out = [
        ("tokenizer", f"{manifest.tokenizer.name} (vocab {manifest.tokenizer.vocab_size:,}, {manifest.dtype})"),
        ("seq_len", f"{manifest.seq_len:,}"),
        ("shards", f"{len(manifest.shards):,} ({sum(e.bytes for e in manifest.shards) / 1e6:,.1f} MB)"),
        ("sequences", f"{rows:,}"),
        ("document tokens", f"{tokens:,}" + (f" ({tokens / slots:.1%} of the token slots)" if slots else "")),
    ]
    for name, s in manifest.sources.items():
        share = f"{s.tokens / tokens:.1%}" if tokens else "-"
        weight = "" if s.mixture_weight is None else f", weight {s.mixture_weight:g}"
        out.append((f"  source {name}", f"{s.documents:,} documents, {s.tokens:,} tokens ({share}{weight})"))
    return out


def verify_shard_set(directory: str | Path) -> list[str]:
    """Returns one line per problem (empty when the set is intact); always rehashes every shard."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    problems: list[str] = []
    for entry in manifest.shards:
        path = directory / entry.path
        problem = size_problem(path, entry) or hash_problem(file_sha256(path), entry)
        found = [problem] if problem else content_problems(path, entry, manifest)
        problems += [f"{entry.path}: {p}" for p in found]
    return problems


def shard_set_of(shard: Path) -> tuple[Path, Manifest, ShardEntry]:
    """The set a shard file belongs to: the nearest directory above it with a manifest, which must list it."""
    target = shard.resolve()
    for directory in shard.absolute().parents:
        if (directory / MANIFEST_FILENAME).is_file():
            manifest = read_manifest(directory)
            for entry in manifest.shards:
                if (directory / entry.path).resolve() == target:
                    return directory, manifest, entry
            raise ShardError(f"{shard}: not listed in {directory / MANIFEST_FILENAME}")
    raise ShardError(f"{shard}: no {MANIFEST_FILENAME} in its directory or above; only shards of a finished set are read")


def read_verified_row(shard: Path, row: int, verifier: ShardVerifier | None = None) -> dict:
    """One row of a shard after its size and sha256 matched its manifest, with its token ids checked
    against the manifest's vocabulary: what `ember corpus inspect` shows is what training reads."""
    directory, manifest, entry = shard_set_of(shard)
    (verifier or ShardVerifier()).check(directory, [entry])
    if not 0 <= row < entry.rows:
        raise ShardError(f"{shard}: row {row} is out of range (the manifest lists {entry.rows} rows)")
    try:
        record = read_row(shard, row)
    except (pa.ArrowException, ValueError, IndexError) as exc:
        raise ShardError(f"{shard}: row {row} cannot be read ({exc})") from None
    if problem := vocab_problem(np.asarray([record["tokens"]], dtype=np.int64), manifest.tokenizer.vocab_size, row):
        raise ShardError(f"{shard} {problem}")
    return record
