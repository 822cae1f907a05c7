"""Writes small real shard sets (zstd Arrow IPC files + manifest) for the midtrain tests.

Documents are counting sequences (next = previous + stride mod vocab, stride fixed per document),
so a tiny model's loss falls within a few steps; every row is deterministic in (seed, index).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ember.schemas import PACKED_SEQUENCE_SCHEMA, Manifest, write_manifest
from ember.tokenize.shards import ROWS_PER_BATCH_KEY
from ember.tokenize.shardset import file_sha256

TOKENIZER = {"name": "test-counting", "hash": "c0ffee00c0ffee00", "vocab_size": 128}


def packed_rows(n: int, seq_len: int, seed: int, source: str, vocab: int = 128, with_loss_mask: bool = False) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        lengths, used = [], 0
        while used < seq_len - 4:
            length = int(rng.integers(4, seq_len // 2 + 1))
            length = min(length, seq_len - used)
            lengths.append(length)
            used += length
        if rng.random() < 0.5 and used == seq_len:  # leave some rows with a padding tail
            lengths[-1] -= 3
            used -= 3
        tokens = np.zeros(seq_len, dtype=np.uint32)
        cu = [0]
        segments = []
        for d, length in enumerate(lengths):
            stride = int(rng.integers(1, 4))
            start = int(rng.integers(1, vocab))
            tokens[cu[-1] : cu[-1] + length] = (start + stride * np.arange(length)) % (vocab - 1) + 1
            segments.append({"document_id": f"{source}-{seed}-{i}-{d}", "doc_token_start": 0, "doc_token_end": length})
            cu.append(cu[-1] + length)
        mask = None
        if with_loss_mask and i % 2:
            mask = [int(x) for x in (rng.random(seq_len) < 0.7)]
        rows.append({"tokens": tokens.tolist(), "cu_seqlens": cu, "segments": segments, "source": source, "loss_mask": mask})
    return rows


def write_shard_set(
    directory: Path,
    rows: list[dict],
    *,
    seq_len: int,
    rows_per_shard: int,
    rows_per_batch: int,
    tokenizer: dict = TOKENIZER,
    batch_metadata: bool = True,
) -> Path:
    """A finished shard set: shard files of `rows_per_shard` rows in `rows_per_batch` record
    batches (the writer's metadata key is recorded unless batch_metadata=False), then the manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    schema = PACKED_SEQUENCE_SCHEMA
    if batch_metadata:
        schema = schema.with_metadata({**schema.metadata, ROWS_PER_BATCH_KEY: str(rows_per_batch).encode()})
    entries = []
    for index, start in enumerate(range(0, len(rows), rows_per_shard)):
        path = directory / f"shard-{index:06d}.arrow"
        shard_rows = rows[start : start + rows_per_shard]
        with ipc.new_file(path, schema, options=ipc.IpcWriteOptions(compression="zstd")) as writer:
            for b in range(0, len(shard_rows), rows_per_batch):
                writer.write_batch(pa.RecordBatch.from_pylist(shard_rows[b : b + rows_per_batch], schema=schema))
        entries.append({"path": path.name, "rows": len(shard_rows), "bytes": path.stat().st_size, "sha256": file_sha256(path)})
    sources: dict[str, dict] = {}
    for row in rows:
        stats = sources.setdefault(row["source"], {"documents": 0, "tokens": 0, "sequences": 0, "padding_tokens": 0})
        stats["documents"] += len(row["segments"])
        stats["tokens"] += row["cu_seqlens"][-1]
        stats["sequences"] += 1
        stats["padding_tokens"] += seq_len - row["cu_seqlens"][-1]
    manifest = Manifest(
        tokenizer=tokenizer,
        seq_len=seq_len,
        dtype="uint16" if tokenizer["vocab_size"] <= 65536 else "uint32",
        sources=sources,
        padding_tokens=sum(s["padding_tokens"] for s in sources.values()),
        pad_token_id=0,
        shards=entries,
        config_hash="midtrain-test-" + directory.name,
        created_at="2026-12-02T00:00:00Z",
    )
    write_manifest(directory, manifest)
    return directory
