"""Training shards on disk: Arrow IPC files of `PACKED_SEQUENCE_SCHEMA` rows in zstd record batches.

Every record batch but the last holds `rows_per_batch` rows (recorded in the schema metadata), so
reading row r decompresses one small batch, never the whole file. A shard is written to a hidden
temporary name and renamed into place, and its sha256 is taken from the exact bytes written.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ember.files import write_atomically
from ember.schemas import PACKED_SEQUENCE_SCHEMA
from ember.schemas.shards import ShardEntry
from ember.tokenize.packing import PackedRow

ROWS_PER_BATCH_KEY = b"ember.rows_per_batch"


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.arrow"


@dataclass(frozen=True)
class ShardRow:
    row: PackedRow
    source: str


def _record_batch(rows: Sequence[ShardRow], schema: pa.Schema) -> pa.RecordBatch:
    seq_lens = [len(r.row.tokens) for r in rows]
    token_offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(seq_lens, out=token_offsets[1:])
    cu_offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(r.row.cu_seqlens) for r in rows], out=cu_offsets[1:])
    return pa.RecordBatch.from_arrays(
        [
            pa.ListArray.from_arrays(pa.array(token_offsets), pa.array(np.concatenate([r.row.tokens for r in rows]))),
            pa.ListArray.from_arrays(pa.array(cu_offsets), pa.array(np.concatenate([r.row.cu_seqlens for r in rows]))),
            pa.array([r.row.segments for r in rows], type=schema.field("segments").type),
            pa.array([r.source for r in rows], type=pa.string()),
            pa.nulls(len(rows), type=schema.field("loss_mask").type),
        ],
        schema=schema,
    )


def encode_shard(rows: Sequence[ShardRow], rows_per_batch: int) -> bytes:
    """The complete bytes of one shard file (deterministic for the same rows)."""
    if not rows:
        raise ValueError("a shard holds at least one row")
    schema = PACKED_SEQUENCE_SCHEMA.with_metadata(
        {**PACKED_SEQUENCE_SCHEMA.metadata, ROWS_PER_BATCH_KEY: str(rows_per_batch).encode()}
    )
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, schema, options=ipc.IpcWriteOptions(compression="zstd")) as writer:
        for start in range(0, len(rows), rows_per_batch):
            writer.write_batch(_record_batch(rows[start : start + rows_per_batch], schema))
    return sink.getvalue().to_pybytes()


def write_shard(directory: Path, index: int, rows: Sequence[ShardRow], rows_per_batch: int) -> ShardEntry:
    """Atomic: a reader sees the old file, no file, or the complete new one. A failed write (a full
    disk) removes its temporary, so nothing of it is left under either name."""
    data = encode_shard(rows, rows_per_batch)
    name = shard_name(index)
    write_atomically(directory / name, data)
    return ShardEntry(path=name, rows=len(rows), bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def read_row(path: str | Path, row: int) -> dict:
    """One row of a shard as Python values, decompressing only the record batch that holds it."""
    with pa.memory_map(str(path)) as source, ipc.open_file(source) as reader:
        per_batch = int((reader.schema.metadata or {}).get(ROWS_PER_BATCH_KEY, b"0"))
        if per_batch <= 0:
            raise ValueError(f"not an ember shard (no {ROWS_PER_BATCH_KEY.decode()} in its schema)")
        batch_index, offset = divmod(row, per_batch)
        if row < 0 or batch_index >= reader.num_record_batches:
            raise IndexError(f"row {row} is out of range")
        batch = reader.get_batch(batch_index)
        if offset >= batch.num_rows:
            raise IndexError(f"row {row} is out of range ({batch_index * per_batch + batch.num_rows} rows)")
        return batch.slice(offset, 1).to_pylist()[0]


def iter_token_batches(path: str | Path) -> Iterator[np.ndarray]:
    """The tokens of a shard, one [rows, seq_len] array per record batch, in row order."""
    with pa.memory_map(str(path)) as source, ipc.open_file(source) as reader:
        for i in range(reader.num_record_batches):
            column = reader.get_batch(i).column("tokens")
            yield column.flatten().to_numpy().reshape(len(column), -1)
