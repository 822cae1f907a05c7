"""Checks that a shard set on disk is complete and unchanged since its manifest was written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow.ipc as ipc

from ember.schemas import PACKED_SEQUENCE_SCHEMA, read_manifest


def file_sha256(path: Path, chunk: int = 8 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_shard_set(directory: str | Path) -> list[str]:
    """Returns one line per problem (empty when the set is intact)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    problems: list[str] = []
    for entry in manifest.shards:
        path = directory / entry.path
        if not path.exists():
            problems.append(f"{entry.path}: missing")
            continue
        if path.stat().st_size != entry.bytes:
            problems.append(f"{entry.path}: {path.stat().st_size} bytes, manifest says {entry.bytes}")
            continue
        if file_sha256(path) != entry.sha256:
            problems.append(f"{entry.path}: sha256 mismatch (file changed after the manifest was written)")
            continue
        with ipc.open_file(path) as reader:
            missing = [f.name for f in PACKED_SEQUENCE_SCHEMA if not f.nullable and f.name not in reader.schema.names]
            rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        if missing:
            problems.append(f"{entry.path}: missing required columns {missing}")
        if rows != entry.rows:
            problems.append(f"{entry.path}: {rows} rows, manifest says {entry.rows}")
    return problems
