"""A rank's shard check, run in a spawned process by the concurrency test (a light module: spawn imports it)."""

from __future__ import annotations

from pathlib import Path

from ember.schemas.shards import ShardEntry
from ember.tokenize.shardset import ShardVerifier


def verify_in_process(directory: str, marker_dir: str, racy_ns: int, entries: list[dict], barrier, results) -> None:
    barrier.wait()  # every rank starts checking at the same moment
    verified = ShardVerifier(Path(marker_dir), racy_ns=racy_ns).check(Path(directory), [ShardEntry(**e) for e in entries])
    results.put(verified.hashed)
