"""`ember export megatron`: a verified shard set -> Megatron `.bin/.idx`, one sequence per packed bin.

Each packed row becomes one Megatron sequence (and one "document") of exactly seq_len tokens,
padding included, in manifest shard order - so `IndexedDataset[i]` is row i of the shard set.
Tokens stream shard by shard, record batch by record batch: memory does not grow with the set.
The `.idx` is written after the `.bin` is complete, both under temporary names renamed at the end.
Every shard's size and sha256 are checked against the manifest before its tokens are read (hashed
once per file version, see `ember.tokenize.shardset`), and every token id against the vocabulary.
Megatron has no uint32 dtype code, so a uint32 vocabulary is exported as int32.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from ember.schemas import Manifest, read_manifest
from ember.tokenize.shards import iter_token_batches
from ember.tokenize.shardset import ShardError, ShardVerifier, vocab_problem

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# megatron.core.datasets.indexed_dataset.DType codes
DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}
EXPORT_DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.int32)}


class ExportError(ValueError):
    """The shard set cannot be exported (not finished, damaged, or ids do not fit)."""


@dataclass(frozen=True)
class ExportResult:
    bin_path: Path
    idx_path: Path
    sequences: int
    tokens: int


def index_bytes(sequences: int, seq_len: int, dtype: np.dtype) -> bytes:
    """The .idx for `sequences` sequences of seq_len tokens, each its own document."""
    lengths = np.full(sequences, seq_len, dtype=np.int32)
    pointers = np.arange(sequences, dtype=np.int64) * (seq_len * dtype.itemsize)
    documents = np.arange(sequences + 1, dtype=np.int64)
    header = INDEX_HEADER + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", DTYPE_CODES[dtype])
    counts = struct.pack("<Q", sequences) + struct.pack("<Q", sequences + 1)
    return header + counts + lengths.tobytes() + pointers.tobytes() + documents.tobytes()


def export_megatron(shards_dir: str | Path, out_prefix: str | Path, verifier: ShardVerifier | None = None) -> ExportResult:
    shards_dir = Path(shards_dir)
    manifest = read_manifest(shards_dir)
    try:
        (verifier or ShardVerifier()).check(shards_dir, manifest.shards)
    except ShardError as exc:
        raise ExportError(f"{shards_dir} does not match its manifest: {exc}") from None
    dtype = EXPORT_DTYPES[manifest.dtype]
    if manifest.tokenizer.vocab_size - 1 > np.iinfo(dtype).max:
        raise ExportError(f"{shards_dir}: vocab_size {manifest.tokenizer.vocab_size} does not fit Megatron's {dtype.name}")
    bin_path, idx_path = Path(f"{out_prefix}.bin"), Path(f"{out_prefix}.idx")
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    bin_tmp, idx_tmp = bin_path.with_name(f".{bin_path.name}.tmp"), idx_path.with_name(f".{idx_path.name}.tmp")
    sequences = 0
    try:
        with open(bin_tmp, "wb") as out:
            for entry in manifest.shards:
                sequences += _write_shard_tokens(out, shards_dir / entry.path, entry.rows, manifest, dtype)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        bin_tmp.unlink(missing_ok=True)
        raise
    idx_tmp.write_bytes(index_bytes(sequences, manifest.seq_len, dtype))
    os.replace(bin_tmp, bin_path)
    os.replace(idx_tmp, idx_path)
    return ExportResult(bin_path, idx_path, sequences, sequences * manifest.seq_len)


def _write_shard_tokens(out: BinaryIO, path: Path, rows: int, manifest: Manifest, dtype: np.dtype) -> int:
    """Appends one verified shard's tokens; refuses rows of another length, ids outside the vocabulary
    and a row count other than the manifest's."""
    written = 0
    try:
        for batch in iter_token_batches(path):
            if batch.shape[1] != manifest.seq_len:
                raise ExportError(f"{path}: rows of {batch.shape[1]} tokens, manifest seq_len {manifest.seq_len}")
            if problem := vocab_problem(batch, manifest.tokenizer.vocab_size, written):
                raise ExportError(f"{path} {problem}")
            out.write(batch.astype(dtype).tobytes())
            written += batch.shape[0]
    except ExportError:
        raise
    except (pa.ArrowException, ValueError) as exc:  # bytes that match a manifest written over a bad file
        raise ExportError(f"{path}: not a readable shard ({exc})") from None
    if written != rows:
        raise ExportError(f"{path}: {written} rows, the manifest says {rows}")
    return written
