"""Shard sets on object stores (gs://, s3://) for the readers written for local sets.

A reader (`ember corpus verify | inspect`, `ember export megatron`, the mid-training loader) starts from the set's
`manifest.json`, as on disk: a set whose manifest is not there yet is not a set. The files the manifest lists are
copied into a local cache (`ember.storage.fetch_set`), the manifest last, and the reader then checks the copy's sizes
and sha256 against the manifest exactly as for a local set - so what is verified is what is read.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from ember import storage
from ember.schemas.shards import MANIFEST_FILENAME, parse_manifest


class RemoteSetError(ValueError):
    """A remote location is not a finished shard set (or cannot be read); the message names the URL."""


def local_shard_set(location: str | Path, *, refresh: bool = False) -> Path:
    """`location` itself when local; for a URL, a local copy of its finished set (`refresh`: download every file
    again, for an audit of what the store holds now)."""
    if not storage.is_url(location):
        return Path(location)
    location = str(location).rstrip("/")
    storage.preflight(location)
    manifest_url = storage.join(location, MANIFEST_FILENAME)
    try:
        raw = storage.read_bytes(manifest_url)
    except FileNotFoundError:
        state = storage.output_state(location)
        found = f"; {state.describe()}" if state.files else ""
        raise RemoteSetError(f"{manifest_url} does not exist: {location} is not a finished shard set{found}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RemoteSetError(f"{manifest_url}: not valid JSON ({exc})") from None
    manifest = parse_manifest(data, manifest_url)
    return storage.fetch_set(location, {e.path: e.bytes for e in manifest.shards}, raw, refresh=refresh)


def local_shard(shard: str | Path) -> Path:
    """A shard file given as a path or URL, as a local path inside its set (for a URL: the nearest prefix above it
    holding a manifest, copied locally)."""
    if not storage.is_url(shard):
        return Path(shard)
    shard = str(shard)
    storage.parse(shard)
    scheme, rest = shard.split("://", 1)
    parts = PurePosixPath(rest).parts
    for depth in range(len(parts) - 1, 0, -1):
        directory = f"{scheme}://{'/'.join(parts[:depth])}"
        if storage.exists(storage.join(directory, MANIFEST_FILENAME)):
            return local_shard_set(directory) / "/".join(parts[depth:])
    raise RemoteSetError(f"{shard}: no {MANIFEST_FILENAME} in its directory or above; only shards of a finished set are read")
