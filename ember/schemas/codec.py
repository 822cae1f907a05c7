"""Kafka wire codec: one message = one Rollout, Reward or TrainBatch as an Arrow IPC stream.

These are the records of the rollouts, rewards and train-batches topics. The control records on the
other topics (policy versions, the ETL's ledger and state snapshots) are JSON: `ember.rollouts.records`.

A message is an Arrow IPC stream (the standard streaming format, readable by every Arrow library):
the schema, one record batch of one row, the end-of-stream marker. The schema metadata names the
record and its version (`ember.schema`, `ember.schema_version`, as on ember's Arrow tables), so an
inference worker or grader in any language writes rollouts and rewards with its Arrow library.

Every field is a typed column, declared once per record in `_LAYOUTS`. Per-token arrays are list
columns (`large_list<uint32>` ...) whose values decode as zero-copy, read-only numpy views of the
message; routed experts are `large_list<fixed_size_list<fixed_size_list<uint8|uint16, top_k>,
layers>>`, so the tensor's shape travels in the type.

Additive evolution: readers ignore columns and metadata keys they do not know and default optional
columns that are absent or null; the version changes only for a change old readers cannot follow,
and readers refuse versions newer than theirs.

Decoding is total: any bytes give a record or a DecodeError. The reader slices the message without
copying, so a lying length fails Arrow's bounds checks instead of allocating; a record is exactly one
row; only the declared columns are read (an unknown column's buffers are never touched), each
type-checked, fully validated (offsets in bounds, UTF-8 that Python can decode, no nulls where a
value is required) before its values are read. Integers are int64 columns, so out-of-range values
cannot be written at all.

Decoding is bounded: every buffer is a slice of the message, so what decode allocates is a fixed
multiple of the message's size. Arrow IPC may compress a batch's body (zstd, lz4), and a compressed
body expands to whatever size its header claims (64 KB of zstd held 2 GB of zeros): `encode` never
compresses (Kafka compresses the topic), and a message whose body is compressed is refused from its
headers, before any body is read.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from ember.schemas.errors import DecodeError, InvalidRecord
from ember.schemas.rollouts import (
    REWARD_SCHEMA_VERSION,
    ROLLOUT_SCHEMA_VERSION,
    TRAIN_BATCH_SCHEMA_VERSION,
    Reward,
    ROLLOUT_DIGEST_BYTES,
    Rollout,
    RolloutRef,
    SourceOffset,
    TrainBatch,
    Turn,
)
from ember.schemas.versioning import SCHEMA_NAME_KEY, SCHEMA_VERSION_KEY

CONTINUATION = b"\xff\xff\xff\xff"  # every encapsulated IPC message starts with it
END_OF_STREAM = CONTINUATION + b"\x00\x00\x00\x00"
MAX_COLUMNS = 256  # a schema wider than this is not an ember record, whatever a future writer adds
_OLD_MAGIC = b"EMBR"  # the hand-written layout ember wrote before the Arrow wire format
_REQUIRED = object()


def _no_nulls(array: pa.Array, what: str) -> None:
    if array.null_count:
        raise DecodeError(f"{what} may not be null")


def _one_row_list(values: pa.Array) -> pa.LargeListArray:
    return pa.LargeListArray.from_arrays(pa.array([0, len(values)], pa.int64()), values)


def _row_values(array: pa.Array) -> pa.Array:
    """The values of a validated one-row list array, sliced without copying (`flatten()` goes through
    pyarrow.compute, several times slower for one row; the row's scalar holds exactly its slice)."""
    return array[0].values


def _fixed_values(array: pa.FixedSizeListArray) -> pa.Array:
    """The values of a validated fixed-size list array's rows, sliced without copying."""
    size = array.type.list_size
    return array.values.slice(array.offset * size, len(array) * size)


def _checked(value: Any, dtype: np.dtype, ndim: int) -> np.ndarray:
    """`value` as a contiguous little-endian array of `dtype`; refuses other dtypes rather than casting
    (a silent cast would wrap token ids or round log-probs)."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"must be a numpy array, got {type(value).__name__}")
    if value.dtype.newbyteorder("<") != dtype or value.ndim != ndim:
        raise TypeError(f"is {value.dtype}{list(value.shape)}, the wire carries {ndim}-D {dtype}")
    return np.ascontiguousarray(value, dtype=dtype)


@dataclass(frozen=True)
class _Scalar:
    type: pa.DataType

    @property
    def expected(self) -> str:
        return str(self.type)

    def accepts(self, arrow_type: pa.DataType) -> bool:
        return arrow_type == self.type

    def to_arrow(self, value: Any) -> pa.Array:
        return pa.array([value], self.type)

    def from_arrow(self, array: pa.Array) -> Any:
        return array[0].as_py()


@dataclass(frozen=True)
class _Numbers:
    """A 1-D numpy array of one dtype."""

    dtype: np.dtype

    @functools.cached_property
    def value_type(self) -> pa.DataType:
        return pa.from_numpy_dtype(self.dtype)

    @property
    def expected(self) -> str:
        return f"large_list<{self.value_type}>"

    def accepts(self, arrow_type: pa.DataType) -> bool:
        return pa.types.is_large_list(arrow_type) and arrow_type.value_type == self.value_type

    def to_arrow(self, value: Any) -> pa.Array:
        return _one_row_list(pa.array(_checked(value, self.dtype, 1)))

    def from_arrow(self, array: pa.Array) -> np.ndarray:
        values = _row_values(array)
        _no_nulls(values, "its values")
        return values.to_numpy(zero_copy_only=True)


_EXPERT_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))


class _Experts:
    """Routed expert ids [tokens, layers, top_k], uint8 or uint16."""

    expected = "large_list<fixed_size_list<fixed_size_list<uint8 or uint16, top_k>, layers>>"

    def accepts(self, arrow_type: pa.DataType) -> bool:
        layers = arrow_type.value_type if pa.types.is_large_list(arrow_type) else None
        top_k = layers.value_type if layers is not None and pa.types.is_fixed_size_list(layers) else None
        return (
            top_k is not None
            and pa.types.is_fixed_size_list(top_k)
            and top_k.value_type in (pa.uint8(), pa.uint16())
        )

    def to_arrow(self, value: Any) -> pa.Array:
        if not isinstance(value, np.ndarray) or value.dtype.newbyteorder("<") not in _EXPERT_DTYPES:
            raise TypeError(f"must be a uint8 or uint16 numpy array, got {getattr(value, 'dtype', type(value).__name__)}")
        experts = _checked(value, value.dtype.newbyteorder("<"), 3)
        tokens, layers, top_k = experts.shape
        if not layers or not top_k:
            raise ValueError(f"shape {experts.shape} needs at least one layer and one expert per token")
        per_layer = pa.FixedSizeListArray.from_arrays(pa.array(experts.reshape(-1)), top_k)
        return _one_row_list(pa.FixedSizeListArray.from_arrays(per_layer, layers))

    def from_arrow(self, array: pa.Array) -> np.ndarray:
        per_token = _row_values(array)
        per_layer = _fixed_values(per_token)
        ids = _fixed_values(per_layer)
        for level, what in ((per_token, "its tokens"), (per_layer, "its layers"), (ids, "its expert ids")):
            _no_nulls(level, what)
        shape = (len(per_token), per_token.type.list_size, per_layer.type.list_size)
        return ids.to_numpy(zero_copy_only=True).reshape(shape)


class _Strings:
    expected = "list<string>"

    def accepts(self, arrow_type: pa.DataType) -> bool:
        return pa.types.is_list(arrow_type) and arrow_type.value_type == pa.string()

    def to_arrow(self, value: Any) -> pa.Array:
        return pa.array([list(value)], pa.list_(pa.string()))

    def from_arrow(self, array: pa.Array) -> list[str]:
        values = _row_values(array)
        _no_nulls(values, "its strings")
        return values.to_pylist()


@dataclass(frozen=True)
class _Records:
    """A list of small dataclass records, one struct per record whose fields are the struct's fields in order
    (a TrainBatch's input ranges, a by-reference batch's rollout references)."""

    struct: pa.StructType
    record: type

    @property
    def expected(self) -> str:
        return f"list<{self.struct}>"

    def accepts(self, arrow_type: pa.DataType) -> bool:
        return pa.types.is_list(arrow_type) and arrow_type.value_type == self.struct

    def to_arrow(self, value: Any) -> pa.Array:
        rows = [{name: getattr(r, name) for name in self.struct.names} for r in value]
        return pa.array([rows], pa.list_(self.struct))

    def from_arrow(self, array: pa.Array) -> list[Any]:
        structs = _row_values(array)
        _no_nulls(structs, "its entries")
        children = structs.flatten()
        for child, name in zip(children, self.struct.names):
            _no_nulls(child, f"its {name}s")
        return [self.record(*row) for row in zip(*(child.to_pylist() for child in children))]


_OFFSETS = _Records(
    pa.struct([("topic", pa.string()), ("partition", pa.int32()), ("start", pa.int64()), ("end", pa.int64())]), SourceOffset
)
_REFS = _Records(
    pa.struct([("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()), ("sha256", pa.binary(ROLLOUT_DIGEST_BYTES))]),
    RolloutRef,
)


# How one field travels: `accepts` its Arrow type, `to_arrow` makes a one-row array, `from_arrow` reads it back.
_Kind = _Scalar | _Numbers | _Experts | _Strings | _Records
_STRING, _INT64 = _Scalar(pa.string()), _Scalar(pa.int64())


@dataclass(frozen=True)
class Column:
    """One field of a record on the wire. `default` makes it optional: absent or null, it decodes as
    `default`; a record holding None for it writes no column. `get` reads it from the record when the
    column is not simply the attribute of that name."""

    name: str
    kind: _Kind
    default: Any = _REQUIRED
    get: Callable[[Any], Any] | None = None

    @property
    def optional(self) -> bool:
        return self.default is not _REQUIRED

    def value(self, record: Any) -> Any:
        return (self.get or attrgetter(self.name))(record)


@dataclass(frozen=True)
class _Layout:
    record: type
    version: int
    columns: tuple[Column, ...]
    # Builds the record from {column name: decoded value}.
    build: Callable[[dict[str, Any]], Any]

    @property
    def name(self) -> str:
        return self.record.__name__

    @property
    def names(self) -> frozenset[str]:
        return frozenset(c.name for c in self.columns)

    @property
    def metadata(self) -> dict[bytes, bytes]:
        return {SCHEMA_NAME_KEY: self.name.encode(), SCHEMA_VERSION_KEY: str(self.version).encode()}


def _rollout(values: dict[str, Any]) -> Rollout:
    roles, ends = values.pop("turn_roles"), values.pop("turn_ends").tolist()
    if len(roles) != len(ends):
        raise DecodeError(f"turn_roles has {len(roles)} entries but turn_ends has {len(ends)}")
    turns = [Turn(role, start, end) for role, start, end in zip(roles, [0, *ends[:-1]], ends)]
    return Rollout(**values, turns=turns)


def _reward(values: dict[str, Any]) -> Reward:
    names, scores = values.pop("component_names"), values.pop("component_values").tolist()
    if len(names) != len(scores) or len(set(names)) != len(names):
        raise DecodeError(f"{len(names)} component names ({len(set(names))} distinct) for {len(scores)} component values")
    return Reward(**values, components=dict(zip(names, scores)))


_LAYOUTS: dict[str, _Layout] = {
    layout.name: layout
    for layout in (
        _Layout(
            Rollout,
            ROLLOUT_SCHEMA_VERSION,
            (
                Column("rollout_id", _STRING),
                Column("group_id", _STRING),
                Column("prompt_id", _STRING),
                Column("policy_version", _INT64),
                Column("sampler", _STRING),
                Column("region", _STRING),
                Column("created_at_us", _INT64),
                Column("finish_reason", _STRING),
                Column("truncated", _Scalar(pa.bool_())),
                Column("prompt_tokens", _INT64, default=0),
                Column("tokens", _Numbers(np.dtype("<u4"))),
                Column("loss_mask", _Numbers(np.dtype("<u1"))),
                Column("sampler_logprobs", _Numbers(np.dtype("<f4"))),
                Column("turn_roles", _Strings(), get=lambda r: [t.role for t in r.turns]),
                Column("turn_ends", _Numbers(np.dtype("<i4")), get=lambda r: np.array([t.end for t in r.turns], np.int32)),
                Column("routed_experts", _Experts(), default=None),
                Column("policy_version_end", _INT64, default=None),
                # Episode segments (Rollout schema 2); absent in version 1: a one-segment episode.
                Column("episode_id", _STRING, default=None),
                Column("segment_index", _INT64, default=0, get=lambda r: r.segment_index if r.episode_id is not None else None),
                Column("segments_total", _INT64, default=None),
                Column("summarises", _STRING, default=None),
                Column("summary_start", _INT64, default=None),
                Column("summary_end", _INT64, default=None),
            ),
            _rollout,
        ),
        _Layout(
            Reward,
            REWARD_SCHEMA_VERSION,
            (
                Column("rollout_id", _STRING),
                Column("group_id", _STRING),
                Column("grader", _STRING),
                Column("score", _Scalar(pa.float64())),
                Column("created_at_us", _INT64),
                Column("component_names", _Strings(), default=[], get=lambda r: list(r.components)),
                Column(
                    "component_values",
                    _Numbers(np.dtype("<f8")),
                    default=np.zeros(0),
                    get=lambda r: np.array(list(r.components.values()), np.float64),
                ),
                Column("grader_version", _STRING, default=None),
                Column("verdict", _STRING, default=None),
            ),
            _reward,
        ),
        _Layout(
            TrainBatch,
            TRAIN_BATCH_SCHEMA_VERSION,
            (
                Column("batch_id", _STRING),
                Column("step", _INT64),
                Column("created_at_us", _INT64, default=0),
                # Inline batches carry the per-token arrays; by-reference ones (TrainBatch.by_reference)
                # carry rollout_refs and sequence_advantages instead.
                Column("tokens", _Numbers(np.dtype("<u4")), default=None),
                Column("loss_mask", _Numbers(np.dtype("<u1")), default=None),
                Column("advantages", _Numbers(np.dtype("<f4")), default=None),
                Column("sampler_logprobs", _Numbers(np.dtype("<f4")), default=None),
                Column("cu_seqlens", _Numbers(np.dtype("<i4"))),
                Column("policy_versions", _Numbers(np.dtype("<i8"))),
                Column("rollout_ids", _Strings()),
                Column("source_offsets", _OFFSETS),
                Column("routed_experts", _Experts(), default=None),
                Column("advantage_estimator", _STRING, default=None),
                Column("rollout_refs", _REFS, default=None, get=lambda b: b.rollout_refs or None),
                Column("sequence_advantages", _Numbers(np.dtype("<f4")), default=None),
                Column("episode_ids", _Strings(), default=[], get=lambda b: b.episode_ids or None),
                Column("advantage_estimators", _Strings(), default=[], get=lambda b: b.advantage_estimators or None),
            ),
            lambda values: TrainBatch(**{**values, "rollout_refs": values["rollout_refs"] or []}),
        ),
    )
}
_BY_TYPE = {layout.record: layout for layout in _LAYOUTS.values()}


@functools.lru_cache(maxsize=256)
def _schema(layout_name: str, columns: tuple[tuple[str, pa.DataType, bool], ...]) -> tuple[pa.Schema, bytes]:
    """The schema and its serialised message for one set of column types (records of one shape share
    them: only the routed experts' layers, top-k and dtype, and which optional columns are present, vary)."""
    fields = [pa.field(name, arrow_type, nullable=nullable) for name, arrow_type, nullable in columns]
    schema = pa.schema(fields, metadata=_LAYOUTS[layout_name].metadata)
    return schema, schema.serialize().to_pybytes()


def _encode(layout: _Layout, record: Any) -> bytes:
    columns, arrays = [], []
    for column in layout.columns:
        value = column.value(record)
        if value is None and column.optional:
            continue
        try:
            array = column.kind.to_arrow(value)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"cannot encode {layout.name} field '{column.name}': {exc}") from None
        columns.append((column.name, array.type, column.optional))
        arrays.append(array)
    schema, schema_message = _schema(layout.name, tuple(columns))
    batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
    return b"".join((schema_message, batch.serialize(), END_OF_STREAM))


def encode(record: Rollout | Reward | TrainBatch) -> bytes:
    """One Kafka message; raises ValueError for a value the wire types cannot hold (an id that is not
    valid Unicode, an integer outside int64, an array of another dtype)."""
    layout = _BY_TYPE.get(type(record))
    if layout is None:
        raise TypeError(f"cannot encode {type(record).__name__}")
    return _encode(layout, record)


encode_rollout = encode_reward = encode_train_batch = encode


def _layout_of(schema: pa.Schema) -> tuple[_Layout, dict[str, int]]:
    """The record a schema declares, and where its declared columns are (unknown ones are skipped)."""
    if len(schema) > MAX_COLUMNS:
        raise DecodeError(f"the schema has {len(schema)} columns (at most {MAX_COLUMNS})")
    metadata = schema.metadata or {}
    name, version = metadata.get(SCHEMA_NAME_KEY), metadata.get(SCHEMA_VERSION_KEY)
    layout = _LAYOUTS.get(name.decode("ascii", "replace")) if name else None
    if layout is None:
        raise DecodeError(f"schema metadata names no ember record: {SCHEMA_NAME_KEY!r} is {name[:40] if name else None!r}")
    if version is None or not version.isdigit() or len(version) > 9:
        raise DecodeError(f"{layout.name} schema version {version[:40] if version else None!r} is not a number")
    if int(version) > layout.version:
        raise DecodeError(
            f"{layout.name} schema version {int(version)} is newer than this ember reads ({layout.version}); upgrade ember"
        )
    where: dict[str, int] = {}
    declared = layout.names
    for index, name in enumerate(schema.names):
        if name in declared:
            if name in where:
                raise DecodeError(f"column '{name}' appears more than once")
            where[name] = index
    return layout, where


# Arrow's Message.fbs: where a batch header says its body is compressed (RecordBatch.compression, also
# inside DictionaryBatch.data), and the codecs BodyCompression.codec names.
_DICTIONARY_DATA, _BATCH_COMPRESSION, _COMPRESSION_CODEC = 1, 3, 0
_HEADER = 2  # Message.header
_CODECS = ("lz4", "zstd")


def _field(metadata: pa.Buffer, table: int, slot: int) -> int | None:
    """Where field `slot` of the flatbuffer table at `table` is, or None if absent. pyarrow offers no
    accessor for a batch's compression; Arrow has verified the flatbuffer when it read the message."""
    vtable = table - struct.unpack_from("<i", metadata, table)[0]
    entry = 4 + 2 * slot
    if entry >= struct.unpack_from("<H", metadata, vtable)[0]:
        return None
    offset = struct.unpack_from("<H", metadata, vtable + entry)[0]
    return table + offset if offset else None


def _table(metadata: pa.Buffer, table: int, slot: int) -> int | None:
    """The table field `slot` of the table at `table` points to, or None if absent."""
    at = _field(metadata, table, slot)
    return None if at is None else at + struct.unpack_from("<I", metadata, at)[0]


def _body_codec(message: pa.ipc.Message) -> str | None:
    """The codec a record or dictionary batch's body is compressed with (None: not compressed), read
    from its header alone."""
    if message.type not in ("record batch", "dictionary"):
        return None
    metadata = message.metadata
    batch = _table(metadata, struct.unpack_from("<I", metadata, 0)[0], _HEADER)
    if batch is not None and message.type == "dictionary":
        batch = _table(metadata, batch, _DICTIONARY_DATA)
    compression = None if batch is None else _table(metadata, batch, _BATCH_COMPRESSION)
    if compression is None:
        return None
    codec = _field(metadata, compression, _COMPRESSION_CODEC)
    number = 0 if codec is None else metadata[codec]  # the flatbuffer default is LZ4_FRAME
    return _CODECS[number] if number < len(_CODECS) else f"codec {number}"


_CACHED_SCHEMA_BYTES = 16 * 1024  # ember's schemas are ~1 KB; a larger one is read without the cache


@dataclass(frozen=True)
class _Plan:
    """How to read the batch of one schema: the record it declares, the read options that take only its declared
    columns, and per declared column where it is in that batch (None: absent) and whether its type is the one
    expected. All of it follows from the schema alone, so messages of one shape pay for it once."""

    layout: _Layout
    options: pa.ipc.IpcReadOptions
    reads: tuple[tuple[Column, int | None, bool], ...]


@functools.lru_cache(maxsize=256)
def _plan(schema_message: bytes) -> _Plan:
    """The `_Plan` of a stream whose schema message is `schema_message`."""
    schema = pa.ipc.read_schema(pa.py_buffer(schema_message))
    layout, where = _layout_of(schema)
    if not where:  # Arrow reads every column when none is named
        raise DecodeError(f"{layout.name} has none of its columns")
    ranks = {name: rank for rank, name in enumerate(sorted(where, key=where.get))}
    reads = tuple(
        (column, ranks.get(column.name), column.name in where and column.kind.accepts(schema.field(where[column.name]).type))
        for column in layout.columns
    )
    return _Plan(layout, pa.ipc.IpcReadOptions(included_fields=sorted(where.values())), reads)


def _scan(buffer: pa.Buffer) -> tuple[_Plan, int]:
    """The stream's `_plan` and where its last message ends, from the headers alone: Arrow's own message
    reader frames the messages as slices of `buffer`, and no body is read."""
    source = pa.BufferReader(buffer)
    messages = pa.ipc.MessageReader.open_stream(source)
    if next(messages, None) is None:
        raise DecodeError("the stream holds no schema")
    schema = buffer.slice(0, source.tell()).to_pybytes()
    plan = _plan(schema) if len(schema) <= _CACHED_SCHEMA_BYTES else _plan.__wrapped__(schema)
    batches = 0
    for message in messages:
        codec = _body_codec(message)
        if codec is not None:
            raise DecodeError(
                f"the {message.type} message's body is {codec}-compressed: ember refuses compressed bodies, which "
                "can expand far beyond the message's size (ember's encoder never compresses them: Kafka compresses "
                "the topic)"
            )
        batches += message.type == "record batch"
    if batches != 1:
        raise DecodeError(f"the stream holds {'no' if not batches else 'more than one'} record batch")
    return plan, source.tell()


def _read(message: bytes | bytearray | memoryview) -> tuple[_Plan, pa.RecordBatch]:
    """The one record batch of a message, read without copying its buffers, and the plan that says where its
    columns (only the declared ones) are."""
    buffer = pa.py_buffer(message)
    view = memoryview(buffer).cast("B")
    if len(view) < len(END_OF_STREAM) or view[:4] != CONTINUATION:
        head = bytes(view[:8])
        if head.startswith(_OLD_MAGIC):
            raise DecodeError("bad magic b'EMBR': a message in ember's old hand-written layout; this ember reads Arrow IPC")
        raise DecodeError(f"bad magic {head!r}: not an Arrow IPC stream (expected {CONTINUATION!r})")
    try:
        plan, end = _scan(buffer)
        batch = pa.ipc.open_stream(pa.BufferReader(buffer), options=plan.options).read_next_batch()
    except (pa.ArrowException, OSError) as exc:  # Arrow reports a short read as OSError
        raise DecodeError(f"not a well-formed Arrow IPC stream: {exc}") from None
    except UnicodeDecodeError:  # Arrow does not check that column names are UTF-8; pyarrow decodes them
        raise DecodeError("a column name is not valid UTF-8") from None
    if end != len(view) or view[-len(END_OF_STREAM) :] != END_OF_STREAM:
        raise DecodeError(f"truncated: the stream ends at byte {end} of {len(view)} without its end-of-stream marker")
    if batch.num_rows != 1:
        raise DecodeError(f"a {plan.layout.name} message holds one row, this one {batch.num_rows}")
    return plan, batch


def _describe(arrow_type: pa.DataType) -> str:
    try:
        return str(arrow_type)
    except UnicodeDecodeError:  # a nested field name that is not UTF-8
        return f"a {arrow_type.id}-type with a field name that is not valid UTF-8"


def _values(plan: _Plan, batch: pa.RecordBatch) -> dict[str, Any]:
    layout, columns = plan.layout, batch.columns
    try:
        batch.validate(full=True)  # one call for every column; only a failure pays for naming the column
        valid = True
    except pa.ArrowException:
        valid = False
    values: dict[str, Any] = {}
    for column, rank, accepted in plan.reads:
        array = None if rank is None else columns[rank]
        if array is None or (column.optional and array.null_count):
            if not column.optional:
                raise DecodeError(f"{layout.name} has no column '{column.name}'")
            values[column.name] = column.default
            continue
        if not accepted:
            raise DecodeError(f"{layout.name} column '{column.name}' is {_describe(array.type)}, expected {column.kind.expected}")
        try:
            if not valid:
                array.validate(full=True)
            _no_nulls(array, "the value")
            values[column.name] = column.kind.from_arrow(array)
        except (pa.ArrowException, DecodeError) as exc:
            raise DecodeError(f"{layout.name} column '{column.name}': {exc}") from None
    return values


def decode(message: bytes | bytearray | memoryview, *, validate: bool = True) -> Rollout | Reward | TrainBatch:
    """Decode any ember message; raises only DecodeError, for any bytes at all.

    Structure, types and UTF-8 are always checked; InvalidRecord (a DecodeError) names the schema
    issues of a well-formed record. `validate=False` skips the schema checks: for re-reading data this
    process already validated, or for reading one rank's share of a batch (`rl_batch_share`).
    """
    plan, batch = _read(message)
    record = plan.layout.build(_values(plan, batch))
    issues = record.issues() if validate else []
    if issues:
        raise InvalidRecord(f"invalid {plan.layout.name}: " + "; ".join(str(i) for i in issues))
    return record


def _decode_as(message: bytes | bytearray | memoryview, record_type: type) -> Any:
    record = decode(message)
    if not isinstance(record, record_type):
        raise DecodeError(f"expected a {record_type.__name__} message, got a {type(record).__name__}")
    return record


def decode_rollout(message: bytes | bytearray | memoryview) -> Rollout:
    return _decode_as(message, Rollout)


def decode_reward(message: bytes | bytearray | memoryview) -> Reward:
    return _decode_as(message, Reward)


def decode_train_batch(message: bytes | bytearray | memoryview) -> TrainBatch:
    return _decode_as(message, TrainBatch)
