"""Mid-training data path: a Megatron-style dataset over ember's packed Arrow shard sets.

Startup checks every shard's size and sha256 against its manifest before any of its data is used
(`ShardVerifier`: hashed once per file version, then a verified-once marker; see
`ember.tokenize.shardset`), then reads each shard's footer - no pass over rows. A global
sample position is blended, shuffled and located by `ember.midtrain.sampling`; the row is read
from a memory-mapped Arrow IPC file, decompressing only the record batch that holds it (an LRU
keeps recent batches, and the shuffle keeps reads inside a window of batches; given its sampler,
the dataset reads ahead in the sampler's order, which a global shuffle needs). Each sample is the
dict megatron-core's GPT step consumes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import torch

from ember.midtrain.sampling import Blend, EpochShuffle, chunk_bounds, microbatch_positions, upcoming_positions
from ember.schemas import PACKED_SEQUENCE_SCHEMA, Manifest, SchemaValidationError, read_manifest
from ember.storage import StorageError
from ember.tokenize.remote_sets import RemoteSetError, local_shard_set
from ember.tokenize.shards import ROWS_PER_BATCH_KEY
from ember.tokenize.shardset import FileState, ShardError, ShardVerifier, vocab_problem_at

# Columns a sample needs; `segments` (document ids) is never decompressed on the training path.
_READ_COLUMNS = ("tokens", "cu_seqlens", "source", "loss_mask")


class DataError(ValueError):
    """A shard set cannot feed this model; the message names the shard set and the mismatch."""


@dataclass(frozen=True)
class ShardSetSpec:
    path: Path
    weight: float


@dataclass
class _Chunk:
    """One decoded record batch: views of Arrow's buffers, shaped. Its rows' content is checked where
    they are used (`_rows_problem`): all of them at once the first time a read off the read-ahead
    plan takes one (`checked`), else in the block that copies them."""

    tokens: np.ndarray  # [rows, seq_len] uint32
    cu_offsets: np.ndarray
    cu_values: np.ndarray
    source_ids: np.ndarray  # [rows] global source index
    mask_valid: np.ndarray | None  # [rows] bool, None when the column is all null
    mask_values: np.ndarray | None  # [rows, seq_len] uint8
    checked: bool = False

    @property
    def nbytes(self) -> int:
        arrays = (self.tokens, self.cu_offsets, self.cu_values, self.source_ids, self.mask_valid, self.mask_values)
        return sum(a.nbytes for a in arrays if a is not None)


@dataclass
class _Row:
    """What a sample is built from: one row's arrays (views) and where it came from."""

    tokens: np.ndarray
    cu_seqlens: np.ndarray
    loss_mask: np.ndarray | None
    source_id: np.int64
    shard_set: int
    epoch: int
    row: int


class _Block:
    """Rows read ahead for a block of positions, as columns (no Python object per row, so the bytes
    counted are the bytes held). Filled one record batch at a time: `put` copies the rows a batch
    serves, `seal` lays out the document boundaries; the dataset then checks every row at once."""

    def __init__(self, positions: np.ndarray, seq_len: int):
        self.positions = np.sort(positions)
        n = len(positions)
        self.tokens = np.empty((n, seq_len), dtype=np.uint32)
        self.mask: np.ndarray | None = None
        self.has_mask = np.zeros(n, dtype=bool)
        self.meta = np.empty((n, 4), dtype=np.int64)  # source id, shard set, epoch, row
        self.cu_offsets = np.zeros(n + 1, dtype=np.int64)
        self.cu_values = np.empty(0, dtype=np.int32)
        self._cu_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def slots(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.positions, positions)

    def origin(self, slots: np.ndarray, set_index: int, epochs: np.ndarray, rows: np.ndarray) -> None:
        self.meta[slots, 1] = set_index
        self.meta[slots, 2] = epochs
        self.meta[slots, 3] = rows

    def put(self, slots: np.ndarray, chunk: _Chunk, offsets: np.ndarray) -> None:
        self.tokens[slots] = chunk.tokens[offsets]
        self.meta[slots, 0] = chunk.source_ids[offsets]
        if chunk.mask_valid is not None:
            valid = chunk.mask_valid[offsets]
            if valid.any():
                if self.mask is None:
                    self.mask = np.zeros(self.tokens.shape, dtype=np.uint8)
                self.mask[slots[valid]] = chunk.mask_values[offsets[valid]]
                self.has_mask[slots] = valid
        starts, ends = chunk.cu_offsets[offsets], chunk.cu_offsets[offsets + 1]
        values = chunk.cu_values  # copied out row by row: a batch gives a block a few rows in a global shuffle
        self._cu_parts.append(
            (slots, ends - starts, np.concatenate([values[a:b] for a, b in zip(starts.tolist(), ends.tolist())]))
        )

    def seal(self) -> None:
        """Every row's boundaries into one array, in slot order, in a single pass over all the parts."""
        slots, lengths, values = (np.concatenate(part) for part in zip(*self._cu_parts))
        self._cu_parts = []
        per_slot = np.zeros(len(self.positions), dtype=np.int64)
        per_slot[slots] = lengths
        np.cumsum(per_slot, out=self.cu_offsets[1:])
        self.cu_values = np.empty(int(self.cu_offsets[-1]), dtype=np.int32)
        self.cu_values[np.repeat(self.cu_offsets[slots] - np.cumsum(lengths) + lengths, lengths) + np.arange(len(values))] = values

    def row(self, position: int) -> _Row | None:
        slot = int(np.searchsorted(self.positions, position))
        if slot == len(self.positions) or self.positions[slot] != position:
            return None
        source_id, shard_set, epoch, row = self.meta[slot].tolist()
        return _Row(
            self.tokens[slot], self.cu_values[self.cu_offsets[slot] : self.cu_offsets[slot + 1]],
            self.mask[slot] if self.has_mask[slot] else None, np.int64(source_id), shard_set, epoch, row,
        )

    @property
    def nbytes(self) -> int:
        arrays = (self.positions, self.tokens, self.mask, self.has_mask, self.meta, self.cu_offsets, self.cu_values)
        return sum(a.nbytes for a in arrays if a is not None)


class _Shard:
    """One Arrow IPC shard, opened lazily per process (memory maps do not survive fork/pickle).

    `verified` is the file version whose bytes matched the manifest; each process re-stats the file
    when it maps it (once), so a shard replaced or rewritten after the check is refused, not read
    (ctime is left out here: a chmod or a backup tool's xattr must not stop a running job)."""

    def __init__(self, path: Path, rows: int, verified: FileState):
        self.path = path
        self.rows = rows
        self.verified = verified
        self.batch_starts: np.ndarray = np.zeros(1, dtype=np.int64)
        self._pid: int | None = None
        self._reader: ipc.RecordBatchFileReader | None = None
        self.columns: tuple[int, ...] = ()  # where each of _READ_COLUMNS is in a batch this reader returns

    def reader(self) -> ipc.RecordBatchFileReader:
        if self._pid != os.getpid():
            try:
                now, then = FileState.of(self.path), self.verified
                if (now.size, now.mtime_ns, now.ino) != (then.size, then.mtime_ns, then.ino):
                    raise DataError(f"{self.path}: changed after it was verified against the manifest")
                source = pa.memory_map(str(self.path))
                schema = ipc.open_file(source).schema
                missing = [c for c in _READ_COLUMNS if c not in schema.names]
                if missing:
                    raise DataError(f"{self.path}: not a PACKED_SEQUENCE_SCHEMA shard, missing columns {missing}")
                for name in _READ_COLUMNS:  # once per file: every record batch's buffers are laid out as these say
                    found, expected = schema.field(name).type, PACKED_SEQUENCE_SCHEMA.field(name).type
                    if not found.equals(expected):
                        raise DataError(f"{self.path}: column {name} is {found}, a PACKED_SEQUENCE_SCHEMA shard has {expected}")
                fields = [schema.get_field_index(c) for c in _READ_COLUMNS]
                # One thread per read: a loader runs as several worker processes per rank already, and
                # Arrow's decompression pool on top of them made each record batch ~1.5x slower on 2 cores.
                options = ipc.IpcReadOptions(included_fields=fields, use_threads=False)
                self._reader = ipc.open_file(source, options=options)
                self.columns = tuple(self._reader.schema.get_field_index(c) for c in _READ_COLUMNS)
            except (OSError, pa.ArrowException) as exc:
                raise DataError(f"{self.path}: not a readable Arrow IPC shard ({exc})") from None
            self._pid = os.getpid()
        return self._reader

    def batch_rows(self) -> list[int]:
        """Rows per record batch: from the writer's metadata when present, else batch headers."""
        reader = self.reader()
        per_batch = int((reader.schema.metadata or {}).get(ROWS_PER_BATCH_KEY, b"0"))
        n = reader.num_record_batches
        if per_batch > 0:
            sizes = [per_batch] * n
            sizes[-1] = self.rows - per_batch * (n - 1)
        else:  # another writer: read the batch lengths, decompressing only the small `source` column
            with ipc.open_file(
                pa.memory_map(str(self.path)),
                options=ipc.IpcReadOptions(included_fields=[reader.schema.get_field_index("source")]),
            ) as light:
                sizes = [light.get_batch(i).num_rows for i in range(n)]
        if sum(sizes) != self.rows or min(sizes) <= 0:
            raise DataError(f"{self.path}: record batches hold {sum(sizes)} rows, manifest says {self.rows}")
        self.batch_starts = np.concatenate([[0], np.cumsum(sizes)])
        return sizes


def _rows_problem(
    tokens: np.ndarray, cu_offsets: np.ndarray, cu_values: np.ndarray, vocab_size: int | np.ndarray, seq_len: int
) -> tuple[int, str] | None:
    """The first of many rows that no ember writer produces, as (row, what is wrong): a token id
    outside the vocabulary (`vocab_size`: one for all rows, or one per row), or document boundaries
    `gpt_sample` cannot index with (they must start at 0, increase strictly and end <= seq_len).

    Why over many rows at once: the check costs per call far more than per row. A read-ahead block
    checks all its rows in one call; in a global shuffle they come from thousands of record batches,
    a few rows each, and checking each batch whole cost more than Arrow's read of it."""
    if problem := vocab_problem_at(tokens, vocab_size):
        return problem
    offsets = cu_offsets.astype(np.int64) - cu_offsets[0]
    values = cu_values[cu_offsets[0] : cu_offsets[-1]].astype(np.int64)
    counts = np.diff(offsets)
    if np.any(counts < 2):
        return int(np.flatnonzero(counts < 2)[0]), ": cu_seqlens holds fewer than 2 boundaries"
    row_of = np.repeat(np.arange(len(counts)), counts)
    bad = (values[offsets[:-1]] != 0) | (values[offsets[1:] - 1] > seq_len)
    not_increasing = (np.diff(values) <= 0) & (row_of[1:] == row_of[:-1])
    bad[row_of[1:][not_increasing]] = True
    if np.any(bad):
        return int(np.flatnonzero(bad)[0]), f": cu_seqlens must start at 0, increase strictly and end <= {seq_len}"
    return None


class _Decoder:
    """Record batch -> `_Chunk`, refusing what cannot be shaped or named (the bytes already matched
    the manifest, so this guards against a writer's bug): a row or a loss mask of another length, a
    source the manifests do not name. The rows' content is checked where they are used
    (`_rows_problem`). Errors name the shard and its row.

    Why a class: in a global shuffle each decoded batch serves a few rows, so what a decode costs
    per call matters more than per row. It reads the columns' buffers directly (arrays read from an
    IPC file start at offset 0; `_Shard` checked their types, Arrow's validation that their offsets
    stay inside them) and keeps what batches repeat: the offsets of n full rows, and the source ids
    of each distinct `source` column (nearly always one name repeated; Arrow's lookup of it cost
    more than the rest of the decode)."""

    _MEMO = 256  # distinct source columns remembered

    def __init__(self, seq_len: int, source_names: list[str]):
        self.seq_len = seq_len
        self._lookup = pc.SetLookupOptions(pa.array(source_names, pa.string()))
        self._full_rows: dict[int, np.ndarray] = {}
        self._source_ids: dict[tuple[int, bytes, bytes], np.ndarray] = {}

    def decode(self, batch: pa.RecordBatch, columns: tuple[int, ...], shard: Path, first_row: int) -> _Chunk:
        try:  # Arrow's reader does not check that offsets stay inside their buffers; the views below rely on it
            batch.validate(full=True)
        except pa.ArrowInvalid as exc:
            raise DataError(f"{shard} rows from {first_row}: not a valid record batch ({exc})") from None
        n, seq_len = len(batch), self.seq_len
        tokens, cu, source, mask = (batch.column(i) for i in columns)
        _, offsets_buffer, _, values_buffer = tokens.buffers()
        offsets = np.frombuffer(offsets_buffer, np.int32, n + 1)
        full = self._full_rows.get(n)
        if full is None:
            full = self._full_rows[n] = np.arange(n + 1, dtype=np.int32) * seq_len
        if not np.array_equal(offsets, full):
            lengths = np.diff(offsets)
            if (lengths != seq_len).any():
                row = int(np.flatnonzero(lengths != seq_len)[0])
                raise DataError(f"{shard} row {first_row + row}: a row holds {int(lengths[row])} tokens, seq_len is {seq_len}")
        values = np.frombuffer(values_buffer, np.uint32, n * seq_len, offset=4 * int(offsets[0]))
        _, cu_offsets, _, cu_values = cu.buffers()
        mask_valid = mask_values = None
        if mask.null_count < n:
            mask_valid = mask.is_valid().to_numpy(zero_copy_only=False)
            filled = mask.fill_null(pa.scalar([0] * seq_len, type=mask.type))
            mask_lengths = np.diff(filled.offsets.to_numpy())
            if np.any(mask_lengths != seq_len):
                row = int(np.flatnonzero(mask_lengths != seq_len)[0])
                raise DataError(
                    f"{shard} row {first_row + row}: loss_mask holds {int(mask_lengths[row])} values, seq_len is {seq_len}"
                )
            mask_values = filled.flatten().to_numpy().reshape(n, seq_len)
        return _Chunk(
            tokens=values.reshape(n, seq_len),
            cu_offsets=np.frombuffer(cu_offsets, np.int32, n + 1),
            cu_values=np.frombuffer(cu_values, np.int32) if cu_values is not None else np.empty(0, np.int32),
            source_ids=self._sources(source, shard, first_row),
            mask_valid=mask_valid,
            mask_values=mask_values,
        )

    def _sources(self, source: pa.StringArray, shard: Path, first_row: int) -> np.ndarray:
        """Each row's index in the dataset's sorted source names; the same column bytes, the same ids."""
        key = None
        if source.null_count == 0:
            _, offsets, data = source.buffers()
            key = (len(source), offsets.to_pybytes(), data.to_pybytes() if data is not None else b"")
            if (ids := self._source_ids.get(key)) is not None:
                return ids
        found = pc.index_in(source, options=self._lookup)
        if found.null_count:
            unknown = source[int(np.flatnonzero(found.is_null().to_numpy(zero_copy_only=False))[0])].as_py()
            raise DataError(f"{shard} rows from {first_row}: source {unknown!r} is not among the manifest's sources")
        ids = found.to_numpy()
        if len(self._source_ids) >= self._MEMO:
            self._source_ids.clear()
        self._source_ids[key] = ids
        return ids


@lru_cache(maxsize=4)
def _causal_mask(seq_len: int) -> np.ndarray:
    """[s, s] bool, True above the diagonal (future positions are masked)."""
    mask = np.triu(np.ones((seq_len, seq_len), dtype=bool), k=1)
    mask.flags.writeable = False
    return mask


def gpt_sample(
    tokens: np.ndarray, cu_seqlens: np.ndarray, row_loss_mask: np.ndarray | None, pad_token_id: int, dense_mask: bool
) -> dict[str, np.ndarray]:
    """One packed row -> megatron-core's GPT inputs.

    labels[t] = tokens[t+1]. A position is trained only when its target is a real next token of
    the same document: not the last token of a document (its target would be the next document),
    not padding, and not where the row's own loss mask excludes the target token.  Position ids
    restart at 0 per document; the padding tail is one more segment so no attention row is empty.
    """
    seq_len = len(tokens)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    bounds = cu if cu[-1] == seq_len else np.append(cu, seq_len)
    segment = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
    position_ids = np.arange(seq_len) - bounds[segment]
    tokens = tokens.astype(np.int64)
    labels = np.empty_like(tokens)
    labels[:-1] = tokens[1:]
    labels[-1] = pad_token_id
    loss_mask = np.zeros(seq_len, dtype=np.float32)
    loss_mask[: cu[-1]] = 1.0
    loss_mask[cu[1:] - 1] = 0.0
    if row_loss_mask is not None:
        loss_mask[:-1] *= row_loss_mask[1:].astype(np.float32)
    padded_cu = np.full(seq_len + 1, -1, dtype=np.int32)
    padded_cu[: len(bounds)] = bounds
    sample = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "cu_seqlens": padded_cu,
        "max_seqlen": np.int32(np.diff(bounds).max()),
    }
    if dense_mask:
        sample["attention_mask"] = (_causal_mask(seq_len) | (segment[:, None] != segment[None, :]))[None]
    return sample


def thd_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A micro-batch's -1-padded per-sample cu_seqlens -> one cu_seqlens over the flattened batch.

    Why: Transformer Engine's THD attention takes the batch as one token stream [b*s] with every
    document boundary in it; sample j's boundaries shift by j*seq_len.
    """
    pieces = [torch.zeros(1, dtype=torch.int32)]
    for j, row in enumerate(cu_seqlens):
        valid = row[row >= 0]
        pieces.append(valid[1:] + j * seq_len)
    return torch.cat(pieces).to(torch.int32)


class _ShardSet:
    def __init__(
        self, index: int, spec: ShardSetSpec, manifest: Manifest, window_chunks: int, seed: int, verifier: ShardVerifier
    ):
        self.spec = spec
        self.manifest = manifest
        try:  # before any shard's footer or rows are read
            verified = verifier.check(spec.path, manifest.shards).states
        except ShardError as exc:
            raise DataError(f"shard set {spec.path} does not match its manifest: {exc}") from None
        self.shards = [_Shard(spec.path / e.path, e.rows, verified[e.path]) for e in manifest.shards]
        chunk_shard, chunk_batch, chunk_rows = [], [], []
        for s, shard in enumerate(self.shards):
            for b, rows in enumerate(shard.batch_rows()):
                chunk_shard.append(s)
                chunk_batch.append(b)
                chunk_rows.append(rows)
        self.chunk_shard = np.asarray(chunk_shard, dtype=np.int64)
        self.chunk_batch = np.asarray(chunk_batch, dtype=np.int64)
        self.chunk_start = chunk_bounds(chunk_rows)
        self.shuffle = EpochShuffle(chunk_rows, seed=seed, source=index, window_chunks=window_chunks)

    def locate(self, row: int) -> tuple[int, int, int]:
        """(shard, record batch, row within batch) of a row of this set, in manifest order."""
        chunk = int(np.searchsorted(self.chunk_start, row, side="right")) - 1
        return int(self.chunk_shard[chunk]), int(self.chunk_batch[chunk]), row - int(self.chunk_start[chunk])

    def where(self, shard: int, batch: int, offset: int) -> str:
        """A row named as errors name it: the shard file and the row's index in it."""
        shard_obj = self.shards[shard]
        return f"{shard_obj.path} row {int(shard_obj.batch_starts[batch]) + offset}"

    def chunks_of(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(chunk index, row within chunk) of many rows; chunk c is (chunk_shard[c], chunk_batch[c])."""
        chunks = np.searchsorted(self.chunk_start, rows, side="right") - 1
        return chunks, rows - self.chunk_start[chunks]


def local_specs(shard_sets: Iterable[tuple[str | Path, float]]) -> list[ShardSetSpec]:
    """(path or URL, weight) -> specs on local directories: a set on gs:// or s3:// is read from its manifest and
    copied into the local cache (ember.tokenize.remote_sets), then checked like any local set."""
    specs = []
    for location, weight in shard_sets:
        try:
            specs.append(ShardSetSpec(local_shard_set(location), weight))
        except (StorageError, RemoteSetError, SchemaValidationError, OSError) as exc:
            raise DataError(f"shard set {location}: {exc}") from None
    return specs


def open_manifests(specs: list[ShardSetSpec]) -> list[Manifest]:
    """Each set's manifest, with a missing/unfinished/damaged set reported by path."""
    manifests = []
    for spec in specs:
        if not spec.path.is_dir():
            raise DataError(f"shard set {spec.path} does not exist")
        try:
            manifest = read_manifest(spec.path)
        except (FileNotFoundError, SchemaValidationError) as exc:
            raise DataError(str(exc)) from None
        missing = [e.path for e in manifest.shards if not (spec.path / e.path).is_file()]
        wrong_size = [
            e.path for e in manifest.shards if e.path not in missing and (spec.path / e.path).stat().st_size != e.bytes
        ]
        if missing or wrong_size:
            raise DataError(
                f"shard set {spec.path} is incomplete: missing {missing[:5]}, size differs from manifest {wrong_size[:5]}"
            )
        manifests.append(manifest)
    return manifests


def check_model_compatible(
    specs: list[ShardSetSpec], manifests: list[Manifest], *, vocab_size: int, seq_len: int, tokenizer_name: str
) -> None:
    """Refuses shard sets tokenized for another model: tokenizer identity, vocab size, seq_len."""
    problems = []
    hashes = {m.tokenizer.hash for m in manifests}
    if len(hashes) > 1:
        problems.append(f"shard sets were tokenized with different tokenizers (hashes {sorted(hashes)})")
    for spec, m in zip(specs, manifests):
        if m.tokenizer.name != tokenizer_name:
            problems.append(f"{spec.path}: tokenizer {m.tokenizer.name!r}, model.tokenizer is {tokenizer_name!r}")
        if m.tokenizer.vocab_size != vocab_size:
            problems.append(f"{spec.path}: tokenizer vocab_size {m.tokenizer.vocab_size}, model.vocab_size is {vocab_size}")
        if m.seq_len != seq_len:
            problems.append(f"{spec.path}: seq_len {m.seq_len}, model.seq_len is {seq_len}")
    if problems:
        raise DataError("; ".join(problems))


DEFAULT_CACHE_BYTES = 512 * 2**20


def row_bytes_bound(seq_len: int) -> int:
    """The most bytes one read-ahead row holds: uint32 tokens, int32 boundaries, a uint8 mask, and
    its position, offset, flag and four int64 facts (`_Block`)."""
    return 4 * seq_len + 4 * (seq_len + 1) + seq_len + 8 + 8 + 1 + 32


@dataclass
class CacheStats:
    """What one loader process decoded and held: record batches decoded, and the peak bytes of
    decoded arrays it kept (record batches in the LRUs plus rows read ahead)."""

    decoded_batches: int = 0
    peak_bytes: int = 0


class MidtrainDataset(torch.utils.data.Dataset):
    """Global position -> GPT sample, blended over shard sets by weight (megatron-style dataset:
    `__len__` is the number of samples training will draw, `__getitem__` returns tensors).

    Decoded data one process holds stays under `cache_bytes` (plus one record batch per set when a
    single batch is larger than its share). Each set's LRU of decoded record batches gets what one
    shuffle window needs when that fits in its share of three quarters (every batch is then decoded
    once per epoch), else room for two batches (a window that large, a global shuffle, cannot be
    held; read-ahead serves it instead); rows read ahead get the rest.

    Read-ahead starts once `read_ahead` names the sampler that
    drives this dataset: the order is a deterministic function of it, so a process knows the
    positions it will be asked for and reads them in blocks, decoding each record batch a block
    needs once and keeping only copies of the rows it needs. That is what makes a global shuffle
    (`window_chunks` >= the set's record batches, where almost no two consecutive samples share a
    batch) cost about one decode per block per batch instead of one per sample. A sample is always
    a function of its position alone, so the cache changes speed, never what is read: resume stays
    exact whatever was cached.
    """

    def __init__(
        self,
        specs: list[ShardSetSpec],
        *,
        num_samples: int,
        seed: int,
        blend_period: int,
        window_chunks: int,
        dense_attention_mask: bool,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        manifests: list[Manifest] | None = None,
        verifier: ShardVerifier | None = None,
    ):
        if cache_bytes < 1:
            raise DataError(f"cache_bytes must be positive, got {cache_bytes}")
        manifests = manifests if manifests is not None else open_manifests(specs)
        verifier = verifier or ShardVerifier()
        seq_lens = {m.seq_len for m in manifests}
        if len(seq_lens) != 1:
            raise DataError(f"shard sets disagree on seq_len: {sorted(seq_lens)}")
        self.seq_len = seq_lens.pop()
        self.num_samples = num_samples
        self.dense_attention_mask = dense_attention_mask
        self.source_names = sorted({name for m in manifests for name in m.sources})
        self._decoder = _Decoder(self.seq_len, self.source_names)
        self.sets = [
            _ShardSet(i, spec, m, window_chunks, seed, verifier) for i, (spec, m) in enumerate(zip(specs, manifests))
        ]
        self._vocab_sizes = np.array([m.tokenizer.vocab_size for m in manifests], dtype=np.int64)
        self.blend = Blend.build([s.weight for s in specs], blend_period)
        self.fingerprint = hashlib.sha256(
            json.dumps(
                {
                    "sets": [[m.config_hash, m.num_sequences, m.seq_len] for m in manifests],
                    "counts": self.blend.counts.tolist(),
                    "seed": seed,
                    "window_chunks": window_chunks,
                }
            ).encode()
        ).hexdigest()[:16]
        # One LRU of decoded record batches per shard set, as large as a shuffle window when the bytes
        # allow: every batch is then decoded once per epoch (the blend interleaves sets, so they must not share).
        self._caches: list[OrderedDict[tuple[int, int], _Chunk]] = [OrderedDict() for _ in self.sets]
        self._cached_bytes = [0] * len(self.sets)
        self._cache_chunks = window_chunks
        row_bound = row_bytes_bound(self.seq_len)
        share = cache_bytes * 3 // 4 // len(self.sets)
        self._set_budgets = []
        for shard_set in self.sets:
            batch_bound = int(np.diff(shard_set.chunk_start).max()) * row_bound
            window = min(window_chunks, len(shard_set.chunk_shard)) * batch_bound
            self._set_budgets.append(window if window <= share else min(share, 2 * batch_bound))
        self.ahead_rows = max(1, (cache_bytes - sum(self._set_budgets)) // row_bound)
        self._plan: GlobalOrderSampler | None = None
        self._block: _Block | None = None
        self.stats = CacheStats()

    def __len__(self) -> int:
        return self.num_samples

    def read_ahead(self, sampler: "GlobalOrderSampler") -> None:
        """Read ahead in `sampler`'s order from now on (set it before the DataLoader starts its workers)."""
        self._plan = sampler
        self._block = None

    @property
    def held_bytes(self) -> int:
        return sum(self._cached_bytes) + (self._block.nbytes if self._block is not None else 0)

    def locate(self, position: int) -> tuple[int, int, int]:
        """(shard set, epoch of that set, row of that set) for a global position."""
        set_index, draw = self.blend.locate(position)
        epoch, row = self.sets[int(set_index)].shuffle.row(int(draw))
        return int(set_index), epoch, row

    def _chunk(self, set_index: int, shard: int, batch: int) -> _Chunk:
        cache = self._caches[set_index]
        chunk = cache.get((shard, batch))
        if chunk is None:
            shard_set = self.sets[set_index]
            shard_obj = shard_set.shards[shard]
            chunk = self._decoder.decode(
                shard_obj.reader().get_batch(batch), shard_obj.columns, shard_obj.path, int(shard_obj.batch_starts[batch])
            )
            self.stats.decoded_batches += 1
            cache[(shard, batch)] = chunk
            self._cached_bytes[set_index] += chunk.nbytes
            while len(cache) > 1 and (len(cache) > self._cache_chunks or self._cached_bytes[set_index] > self._set_budgets[set_index]):
                self._cached_bytes[set_index] -= cache.popitem(last=False)[1].nbytes
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.held_bytes)
        else:
            cache.move_to_end((shard, batch))
        return chunk

    def _read_ahead_from(self, position: int) -> _Block:
        """Rows of the next `ahead_rows` positions this process reads, each record batch decoded once.

        The previous block goes first (its unread rows were planned for reads that did not come), so
        the rows held never exceed one block."""
        plan = self._plan
        worker = torch.utils.data.get_worker_info()
        positions = np.asarray(
            upcoming_positions(
                plan.consumed, plan.total, plan.micro_batch_size, plan.dp_size, plan.dp_rank,
                position=position, count=self.ahead_rows, num_workers=worker.num_workers if worker else 1,
            ),
            dtype=np.int64,
        )
        self._block = None
        block = _Block(positions, self.seq_len)
        set_of, draws = self.blend.locate(positions)
        for set_index in np.unique(set_of).tolist():
            at = np.flatnonzero(set_of == set_index)
            shard_set = self.sets[set_index]
            epochs, rows = shard_set.shuffle.rows_of(draws[at])
            chunks, offsets = shard_set.chunks_of(rows)
            slots = block.slots(positions[at])
            block.origin(slots, set_index, epochs, rows)
            order = np.argsort(chunks, kind="stable")  # record batches in file order, each once
            chunks, slots, offsets = chunks[order], slots[order], offsets[order]
            starts = np.flatnonzero(np.diff(chunks, prepend=-1)).tolist()
            for c, lo, hi in zip(chunks[starts].tolist(), starts, starts[1:] + [len(chunks)]):
                chunk = self._chunk(set_index, int(shard_set.chunk_shard[c]), int(shard_set.chunk_batch[c]))
                block.put(slots[lo:hi], chunk, offsets[lo:hi])
        block.seal()
        vocab_sizes = self._vocab_sizes[block.meta[:, 1]]
        if problem := _rows_problem(block.tokens, block.cu_offsets, block.cu_values, vocab_sizes, self.seq_len):
            set_index, row = block.meta[problem[0], [1, 3]].tolist()
            shard, batch, offset = self.sets[set_index].locate(row)
            raise DataError(f"{self.sets[set_index].where(shard, batch, offset)}{problem[1]}")
        self._block = block
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.held_bytes)
        return block

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        position = int(position)
        row = self._block.row(position) if self._block is not None else None
        if row is None and self._plan is not None:
            row = self._read_ahead_from(position).row(position)
        if row is None:
            set_index, epoch, set_row = self.locate(position)
            shard, batch, offset = self.sets[set_index].locate(set_row)
            chunk = self._chunk(set_index, shard, batch)
            if not chunk.checked:  # every row of the batch at once, the first time a read off the plan uses it
                vocab_size = self._vocab_sizes[set_index]
                if problem := _rows_problem(chunk.tokens, chunk.cu_offsets, chunk.cu_values, vocab_size, self.seq_len):
                    raise DataError(f"{self.sets[set_index].where(shard, batch, problem[0])}{problem[1]}")
                chunk.checked = True
            mask = chunk.mask_values[offset] if chunk.mask_valid is not None and chunk.mask_valid[offset] else None
            row = _Row(
                chunk.tokens[offset], chunk.cu_values[chunk.cu_offsets[offset] : chunk.cu_offsets[offset + 1]], mask,
                chunk.source_ids[offset], set_index, epoch, set_row,
            )
        pad = self.sets[row.shard_set].manifest.pad_token_id
        sample = gpt_sample(row.tokens, row.cu_seqlens, row.loss_mask, pad, self.dense_attention_mask)
        sample["source_id"] = row.source_id
        sample["sample_id"] = np.int64(position)
        sample["shard_set"] = np.int64(row.shard_set)
        sample["row"] = np.int64(row.row)
        sample["epoch"] = np.int64(row.epoch)
        return {k: torch.from_numpy(np.asarray(v)) for k, v in sample.items()}


class GlobalOrderSampler(torch.utils.data.Sampler):
    """Batch sampler for one DP rank: its slice of each global micro-batch from `consumed` on.

    Why: the only resume state is the global position, so a restart with any DP size (same global
    micro-batch stepping) continues the global order exactly: nothing repeated, nothing skipped.
    """

    def __init__(self, consumed: int, total: int, micro_batch_size: int, dp_size: int, dp_rank: int):
        self.consumed = consumed
        self.total = total
        self.micro_batch_size = micro_batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank

    def __iter__(self):
        step = self.micro_batch_size * self.dp_size
        for start in range(self.consumed, self.total - step + 1, step):
            yield list(microbatch_positions(start, self.micro_batch_size, self.dp_size, self.dp_rank))

    def __len__(self) -> int:
        return max(0, (self.total - self.consumed) // (self.micro_batch_size * self.dp_size))
