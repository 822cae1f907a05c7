"""`ember export megatron`: a verified shard set -> Megatron `.bin/.idx`, by sequence or by document.

Sequences mode (the default): each packed row becomes one Megatron sequence (and one "document") of
exactly seq_len tokens, padding included, in manifest shard order - so `IndexedDataset[i]` is row i.

Documents mode (`--documents`): one Megatron document per source document, padding dropped, as
Megatron's `preprocess_data.py` lays out a corpus, so GPTDataset packs and weights documents itself.
A document is rebuilt from the rows' provenance (segments: document id and its token range): its
pieces after the first (start > 0) are gathered in a first pass into a temporary file beside the
output, and the document is written where its first piece (start 0) is met reading the set in
manifest order (shards, rows, segments). A document whose pieces do not join up - no first piece,
a gap, an overlap, or (when the manifest's framing records the EOS id every document ends with) no
last piece - is left out and reported by id. Without that id a missing last piece cannot be seen:
the rows do not record a document's length (ember's packing never drops a piece).

Tokens stream shard by shard, record batch by record batch: memory grows with the pieces of split
documents (their ids and ranges), never with the tokens. The `.idx` is written after the `.bin` is
complete, both under temporary names renamed at the end. Every shard's size and sha256 are checked
against the manifest before its tokens are read (hashed once per file version, see
`ember.tokenize.shardset`), and every token id against the vocabulary. Megatron has no uint32 dtype
code, so a uint32 vocabulary is exported as int32.
"""

from __future__ import annotations

import os
import struct
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from ember.schemas import Manifest, read_manifest
from ember.tokenize.shards import iter_token_batches
from ember.tokenize.shardset import ShardError, ShardVerifier, vocab_problem

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# megatron.core.datasets.indexed_dataset.DType codes
DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}
EXPORT_DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.int32)}
MAX_LENGTH = np.iinfo(np.int32).max  # the .idx stores each sequence's length as int32


class ExportError(ValueError):
    """The shard set cannot be exported (not finished, damaged, or ids do not fit)."""


@dataclass(frozen=True)
class ExportResult:
    bin_path: Path
    idx_path: Path
    sequences: int  # Megatron sequences written: rows, or documents in documents mode
    tokens: int
    incomplete: dict[str, str] = field(default_factory=dict)  # "source/document_id" -> why it was left out


def index_bytes(lengths: np.ndarray, dtype: np.dtype) -> bytes:
    """The .idx for sequences of these lengths laid end to end in the .bin, each its own document."""
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    documents = np.arange(len(lengths) + 1, dtype=np.int64)
    header = INDEX_HEADER + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", DTYPE_CODES[dtype])
    counts = struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(lengths) + 1)
    return header + counts + lengths.tobytes() + pointers.tobytes() + documents.tobytes()


def verified_set(shards_dir: Path, verifier: ShardVerifier | None = None) -> tuple[Manifest, np.dtype]:
    """The shard set's manifest, every shard checked against it, and the Megatron dtype its token ids are written
    in (refused when the vocabulary does not fit it)."""
    manifest = read_manifest(shards_dir)
    try:
        (verifier or ShardVerifier()).check(shards_dir, manifest.shards)
    except ShardError as exc:
        raise ExportError(f"{shards_dir} does not match its manifest: {exc}") from None
    dtype = EXPORT_DTYPES[manifest.dtype]
    if manifest.tokenizer.vocab_size - 1 > np.iinfo(dtype).max:
        raise ExportError(f"{shards_dir}: vocab_size {manifest.tokenizer.vocab_size} does not fit Megatron's {dtype.name}")
    return manifest, dtype


def export_megatron(
    shards_dir: str | Path, out_prefix: str | Path, verifier: ShardVerifier | None = None, documents: bool = False
) -> ExportResult:
    """Writes OUT_PREFIX.bin/.idx: one sequence per row, or with `documents` one per source document."""
    shards_dir = Path(shards_dir)
    manifest, dtype = verified_set(shards_dir, verifier)
    bin_path, idx_path = Path(f"{out_prefix}.bin"), Path(f"{out_prefix}.idx")
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    bin_tmp, idx_tmp = bin_path.with_name(f".{bin_path.name}.tmp"), idx_path.with_name(f".{idx_path.name}.tmp")
    incomplete: dict[str, str] = {}
    try:
        with open(bin_tmp, "wb") as out:
            if documents:
                lengths, incomplete = _write_documents(out, shards_dir, manifest, dtype, bin_path.with_name(f".{bin_path.name}.pieces.tmp"))
            else:
                rows = sum(_write_shard_tokens(out, shards_dir / e.path, e.rows, manifest, dtype) for e in manifest.shards)
                lengths = np.full(rows, manifest.seq_len, dtype=np.int32)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        bin_tmp.unlink(missing_ok=True)
        raise
    idx_tmp.write_bytes(index_bytes(lengths, dtype))
    os.replace(bin_tmp, bin_path)
    os.replace(idx_tmp, idx_path)
    return ExportResult(bin_path, idx_path, len(lengths), int(np.sum(lengths, dtype=np.int64)), incomplete)


@dataclass(frozen=True)
class _Spans:
    """The document spans of one record batch: per segment its row, its place in the row and in its document."""

    tokens: np.ndarray  # [rows, seq_len]
    row: np.ndarray
    begin: np.ndarray  # token offsets in the row
    end: np.ndarray
    doc_start: np.ndarray  # the span's tokens in its document
    doc_end: np.ndarray
    batch: pa.RecordBatch

    def keys(self, which: np.ndarray) -> list[str]:
        """"source/document_id" of the segments `which` selects (a document id is unique within its source)."""
        ids = pc.list_flatten(self.batch.column("segments")).field("document_id").take(pa.array(which)).to_pylist()
        sources = self.batch.column("source").take(pa.array(self.row[which])).to_pylist()
        return [f"{source}/{doc}" for source, doc in zip(sources, ids)]


def verified_batches(path: Path, rows: int, manifest: Manifest) -> Iterator[tuple[pa.RecordBatch, np.ndarray, int]]:
    """Each record batch of a verified shard with its tokens [rows, seq_len] and the index of its first row; refuses
    rows of another length, ids outside the vocabulary, bytes that do not read as a shard and a row count other
    than the manifest's."""
    seen = 0
    try:
        with pa.memory_map(str(path)) as source, ipc.open_file(source) as reader:
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                tokens = pc.list_flatten(batch.column("tokens")).to_numpy().reshape(batch.num_rows, -1)
                if tokens.shape[1] != manifest.seq_len:
                    raise ExportError(f"{path}: rows of {tokens.shape[1]} tokens, manifest seq_len {manifest.seq_len}")
                if problem := vocab_problem(tokens, manifest.tokenizer.vocab_size, seen):
                    raise ExportError(f"{path} {problem}")
                yield batch, tokens, seen
                seen += batch.num_rows
    except ExportError:
        raise
    except (pa.ArrowException, ValueError, IndexError) as exc:  # bytes that match a manifest written over a bad file
        raise ExportError(f"{path}: not a readable shard ({exc})") from None
    if seen != rows:
        raise ExportError(f"{path}: {seen} rows, the manifest says {rows}")


def _spans(path: Path, rows: int, manifest: Manifest) -> Iterator[_Spans]:
    """Each record batch of a verified shard (`verified_batches`) as document spans, in row and segment order."""
    try:
        for batch, tokens, first in verified_batches(path, rows, manifest):
            segments = batch.column("segments")
            row = pc.list_parent_indices(segments).to_numpy()
            flat = pc.list_flatten(segments)
            seg_first = np.asarray(segments.offsets)[:-1] - segments.offsets[0].as_py()
            cu = batch.column("cu_seqlens")
            cu_flat = pc.list_flatten(cu).to_numpy()
            cu_first = np.asarray(cu.offsets)[:-1] - cu.offsets[0].as_py()
            at = cu_first[row] + (np.arange(len(row)) - seg_first[row])
            spans = _Spans(
                tokens, row, cu_flat[at], cu_flat[at + 1],
                flat.field("doc_token_start").to_numpy(), flat.field("doc_token_end").to_numpy(), batch,
            )
            wrong = np.flatnonzero(spans.end - spans.begin != spans.doc_end - spans.doc_start)
            if len(wrong):
                raise ExportError(
                    f"{path} row {first + int(row[wrong[0]])}: a segment's token range does not match its "
                    "span in cu_seqlens (the provenance cannot place its tokens)"
                )
            yield spans
    except ExportError:
        raise
    except (pa.ArrowException, ValueError, IndexError) as exc:
        raise ExportError(f"{path}: not a readable shard ({exc})") from None


def _write_documents(
    out: BinaryIO, shards_dir: Path, manifest: Manifest, dtype: np.dtype, pieces_path: Path
) -> tuple[np.ndarray, dict[str, str]]:
    """Pass 1 keeps every later piece (start > 0) in `pieces_path`; pass 2 writes each document at its
    first piece, joined with its later ones. Returns the documents' lengths and the ones left out."""
    later: dict[str, list[tuple[int, int, int]]] = {}  # key -> [(doc_start, doc_end, offset in pieces_path)]
    try:
        with open(pieces_path, "wb") as pieces:
            offset = 0
            for entry in manifest.shards:
                for spans in _spans(shards_dir / entry.path, entry.rows, manifest):
                    which = np.flatnonzero(spans.doc_start > 0)
                    for key, s in zip(spans.keys(which), which):
                        data = spans.tokens[spans.row[s], spans.begin[s]:spans.end[s]].astype(dtype).tobytes()
                        pieces.write(data)
                        later.setdefault(key, []).append((int(spans.doc_start[s]), int(spans.doc_end[s]), offset))
                        offset += len(data)
        stored = np.memmap(pieces_path, dtype=dtype, mode="r") if offset else np.zeros(0, dtype=dtype)
        return _join(out, shards_dir, manifest, dtype, later, stored)
    finally:
        pieces_path.unlink(missing_ok=True)


def _join(out: BinaryIO, shards_dir: Path, manifest: Manifest, dtype: np.dtype,
          later: dict[str, list[tuple[int, int, int]]], stored: np.ndarray) -> tuple[np.ndarray, dict[str, str]]:
    lengths = array("i")
    incomplete: dict[str, str] = {}
    joined: set[str] = set()
    eos = (manifest.model_extra.get("framing") or {}).get("eos_token_id")
    for entry in manifest.shards:
        for spans in _spans(shards_dir / entry.path, entry.rows, manifest):
            heads = np.flatnonzero(spans.doc_start == 0)
            ends = spans.tokens[spans.row[heads], spans.end[heads] - 1]  # a document's last token if it is whole
            unended = eos is not None and bool(np.any(ends != eos))
            keys = spans.keys(heads) if later or unended else [""] * len(heads)
            parts = []
            for key, s in zip(keys, heads):
                head = spans.tokens[spans.row[s], spans.begin[s]:spans.end[s]]
                if key in joined:
                    incomplete[key] = "its first piece is in more than one row; the later copies were left out"
                    continue
                if key in later:
                    joined.add(key)
                    document, why = _joined(head, int(spans.doc_end[s]), later[key], stored)
                else:
                    document, why = head, ""
                if not why and eos is not None and document[-1] != eos:
                    why = f"its last piece is in no row (it ends at token {len(document)} without the EOS id {eos})"
                if why:
                    incomplete[key] = why
                    continue
                if len(document) > MAX_LENGTH:
                    raise ExportError(f"document {key}: {len(document):,} tokens, more than Megatron's int32 length holds")
                parts.append(document)
                lengths.append(len(document))
            if parts:
                out.write(np.concatenate(parts).astype(dtype, copy=False).tobytes())
    incomplete.update((key, "its first piece (token 0) is in no row") for key in later if key not in joined)
    if not lengths:
        raise ExportError(f"{shards_dir}: no complete document to export ({len(incomplete)} left out)")
    return np.frombuffer(lengths, dtype=np.int32), incomplete


def _joined(head: np.ndarray, head_end: int, pieces: list[tuple[int, int, int]], stored: np.ndarray) -> tuple[np.ndarray, str]:
    """The document's tokens in order, or why its pieces do not join up (a gap or an overlap)."""
    parts, expected = [head], head_end
    for start, end, offset in sorted(pieces):
        if start != expected:
            gap = f"tokens {expected}-{start} are in no row" if start > expected else f"tokens {start}-{expected} appear twice"
            return head, gap
        item = offset // stored.itemsize
        parts.append(stored[item:item + end - start])
        expected = end
    return np.concatenate(parts), ""


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
