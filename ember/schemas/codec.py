"""Kafka wire codec: one message = one Rollout, Reward or TrainBatch.

Layout (little-endian)::

    header  4s magic b"EMBR" | u8 wire version | u8 kind | u16 flags (0) | u32 body length
    body    u32 meta length | meta (UTF-8 JSON object of scalars and strings)
            u16 array count | per array: u8 name length, name, u8 dtype code, u8 ndim, u32 dims[ndim]
            zero padding to 8 bytes | array payloads in table order, each padded to 8 bytes

Numeric arrays travel as raw buffers and decode as zero-copy, read-only numpy views of the message.
Readers ignore meta keys and arrays they do not know, and default optional ones that are absent, so
adding optional fields never breaks old consumers or old data. Integrity in transit is Kafka's job
(record-batch CRC32C); this codec checks structure: every size is bounded by the bytes present
before anything is read, so a lying header cannot trigger a large allocation.
"""

from __future__ import annotations

import json
import math
import re
import struct
from typing import Any, Callable

import numpy as np

from ember.schemas.errors import DecodeError, InvalidRecord
from ember.schemas.rollouts import ROLLOUT_DIGEST_BYTES, TURN_ROLES, Reward, Rollout, RolloutRef, SourceOffset, TrainBatch, Turn

MAGIC = b"EMBR"
WIRE_VERSION = 1
KIND_ROLLOUT, KIND_REWARD, KIND_TRAIN_BATCH = 1, 2, 3
KIND_NAMES = {KIND_ROLLOUT: "Rollout", KIND_REWARD: "Reward", KIND_TRAIN_BATCH: "TrainBatch"}

_HEADER = struct.Struct("<4sBBHI")
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_MAX_NDIM = 4
MAX_JSON_DEPTH = 32
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPENERS = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSERS = np.frombuffer(b"]}", dtype=np.uint8)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype("<u1"): 1,
    np.dtype("<i1"): 2,
    np.dtype("<i2"): 3,
    np.dtype("<i4"): 4,
    np.dtype("<i8"): 5,
    np.dtype("<f8"): 6,
    np.dtype("<f4"): 7,
    np.dtype("<u2"): 8,
    np.dtype("<u4"): 9,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_ROLE_CODES = {role: i for i, role in enumerate(TURN_ROLES)}


def _pad(n: int) -> int:
    return -n % 8


def _encode(kind: int, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    return _frame(kind, json.dumps(meta, separators=(",", ":"), allow_nan=False).encode("utf-8"), arrays)


def _frame(kind: int, meta_bytes: bytes, arrays: dict[str, np.ndarray]) -> bytes:
    """One message around already-serialised meta (tests use it to frame meta no encoder would write)."""
    table = [_U32.pack(len(meta_bytes)), meta_bytes, _U16.pack(len(arrays))]
    payloads: list[bytes | memoryview] = []
    for name, array in arrays.items():
        little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        code = _DTYPE_CODES.get(little.dtype)
        if code is None:
            raise TypeError(f"array '{name}' has unsupported dtype {array.dtype}")
        encoded_name = name.encode("ascii")
        table.append(struct.pack(f"<B{len(encoded_name)}sBB", len(encoded_name), encoded_name, code, little.ndim))
        table.append(struct.pack(f"<{little.ndim}I", *little.shape))
        payloads.append(little.reshape(-1).view(np.uint8).data)
        payloads.append(b"\x00" * _pad(little.nbytes))
    head = b"".join(table)
    body_parts = [head, b"\x00" * _pad(len(head)), *payloads]
    body_len = sum(len(p) for p in body_parts)
    if body_len >= 2**32:
        raise ValueError(f"{KIND_NAMES[kind]} message of {body_len} bytes exceeds the 4 GiB wire limit")
    return b"".join([_HEADER.pack(MAGIC, WIRE_VERSION, kind, 0, body_len), *body_parts])


def _nesting_depth(raw: bytes) -> int:
    """Deepest bracket nesting of a JSON text, measured without recursion.

    `json.loads` recurses once per level and hits the interpreter's recursion limit (RecursionError)
    long before memory runs out, so depth is bounded before parsing. Brackets inside strings do not
    count; string literals are removed first (the alternatives of the pattern are disjoint, so the
    scan is linear).
    """
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return 0
    structure = np.frombuffer(_JSON_STRING.sub(b"", raw), dtype=np.uint8)
    steps = np.isin(structure, _OPENERS).astype(np.int64) - np.isin(structure, _CLOSERS)
    return int(np.cumsum(steps).max(initial=0))


def _unencodable_string(value: Any) -> str | None:
    """The first string (key or value) in a parsed JSON value that is not valid Unicode, if any.

    JSON escapes can spell lone surrogates (`"\\ud800"`) that no UTF-8 encoder accepts: such an id
    would fail later, far from here, when it becomes a Kafka key or a ledger record.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return ascii(item[:40])
    return None


def parse_json(raw: bytes, what: str) -> Any:
    """Parse JSON that came from the wire; raises only DecodeError (a ValueError).

    UTF-8 only (no encoding sniffing), nesting at most MAX_JSON_DEPTH deep, integers of at most 4300
    digits (Python's own limit, otherwise a bare ValueError), every string valid Unicode.
    """
    depth = _nesting_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise DecodeError(f"{what} is nested {depth} levels deep (at most {MAX_JSON_DEPTH})")
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise DecodeError(f"{what} is not valid UTF-8 JSON: {exc}") from None
    bad = _unencodable_string(value)
    if bad is not None:
        raise DecodeError(f"{what} holds a string that is not valid Unicode (lone surrogate): {bad}")
    return value


class _Reader:
    """Bounds-checked cursor over a message body; every failure is a DecodeError."""

    def __init__(self, buffer: memoryview):
        self.buffer = buffer
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buffer):
            raise DecodeError(
                f"truncated: {what} needs {n} bytes at offset {self.pos}, body has {len(self.buffer)}"
            )
        chunk = self.buffer[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: struct.Struct, what: str) -> tuple:
        return fmt.unpack(self.take(fmt.size, what))


def _decode(message: bytes | bytearray | memoryview) -> tuple[int, dict[str, Any], dict[str, np.ndarray]]:
    view = memoryview(message).cast("B")
    if len(view) < _HEADER.size:
        raise DecodeError(f"truncated: {len(view)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, kind, _flags, body_len = _HEADER.unpack(view[: _HEADER.size])
    if magic != MAGIC:
        raise DecodeError(f"bad magic {bytes(magic)!r}: not an ember message (expected {MAGIC!r})")
    if version == 0 or version > WIRE_VERSION:
        raise DecodeError(f"unsupported wire version {version}; this ember reads versions 1..{WIRE_VERSION}")
    if kind not in KIND_NAMES:
        raise DecodeError(f"unknown record kind {kind}")
    body = view[_HEADER.size :]
    if body_len != len(body):
        raise DecodeError(f"length mismatch: header says {body_len} body bytes, message has {len(body)}")
    reader = _Reader(body)
    (meta_len,) = reader.unpack(_U32, "meta length")
    meta = parse_json(bytes(reader.take(meta_len, "meta")), "meta")
    if not isinstance(meta, dict):
        raise DecodeError(f"meta must be a JSON object, got {type(meta).__name__}")
    (count,) = reader.unpack(_U16, "array count")
    specs = []
    for index in range(count):
        (name_len,) = reader.take(1, f"array {index} name length")
        name = bytes(reader.take(name_len, f"array {index} name")).decode("ascii", errors="replace")
        code, ndim = reader.take(2, f"array '{name}' dtype and ndim")
        dtype = _CODE_DTYPES.get(code)
        if dtype is None:
            raise DecodeError(f"array '{name}' has unknown dtype code {code}")
        if ndim > _MAX_NDIM:
            raise DecodeError(f"array '{name}' has {ndim} dimensions (at most {_MAX_NDIM})")
        shape = struct.unpack(f"<{ndim}I", reader.take(4 * ndim, f"array '{name}' shape"))
        specs.append((name, dtype, shape))
    reader.take(_pad(reader.pos), "table padding")
    arrays: dict[str, np.ndarray] = {}
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        data = reader.take(nbytes, f"array '{name}' payload of shape {shape}")
        reader.take(_pad(nbytes), f"array '{name}' padding")
        arrays[name] = np.frombuffer(data, dtype=dtype).reshape(shape)
    if reader.pos != len(body):
        raise DecodeError(f"length mismatch: {len(body) - reader.pos} unexplained trailing bytes")
    return kind, meta, arrays


def _field(meta: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in meta:
        if default is ...:
            raise DecodeError(f"missing field '{key}'")
        return default
    value = meta[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise DecodeError(f"field '{key}' must be {names}, got {type(value).__name__}")
    if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
        raise DecodeError(f"field '{key}' is an integer of {value.bit_length()} bits, outside int64")
    if isinstance(value, list) and not all(isinstance(item, str) for item in value):
        raise DecodeError(f"field '{key}' must be a list of strings")
    return value


def _array(arrays: dict[str, np.ndarray], key: str, dtype: str, ndim: int, optional: bool = False) -> np.ndarray | None:
    if key not in arrays:
        if optional:
            return None
        raise DecodeError(f"missing array '{key}'")
    array = arrays[key]
    if array.ndim != ndim or (dtype != "expert" and array.dtype != np.dtype(dtype)):
        raise DecodeError(f"array '{key}' is {array.dtype}{list(array.shape)}, expected {ndim}-D {dtype}")
    if dtype == "expert" and array.dtype not in (np.uint8, np.uint16):
        raise DecodeError(f"array '{key}' dtype {array.dtype} must be uint8 or uint16")
    return array


def encode_rollout(rollout: Rollout) -> bytes:
    meta = {
        "rollout_id": rollout.rollout_id,
        "group_id": rollout.group_id,
        "prompt_id": rollout.prompt_id,
        "policy_version": int(rollout.policy_version),
        "sampler": rollout.sampler,
        "region": rollout.region,
        "created_at_us": int(rollout.created_at_us),
        "finish_reason": rollout.finish_reason,
        "truncated": bool(rollout.truncated),
        "prompt_tokens": int(rollout.prompt_tokens),
    }
    arrays = {
        "tokens": rollout.tokens,
        "loss_mask": rollout.loss_mask,
        "sampler_logprobs": rollout.sampler_logprobs,
        "turn_roles": np.array([_ROLE_CODES[t.role] for t in rollout.turns], dtype=np.uint8),
        "turn_ends": np.array([t.end for t in rollout.turns], dtype=np.int32),
    }
    if rollout.routed_experts is not None:
        arrays["routed_experts"] = rollout.routed_experts
    return _encode(KIND_ROLLOUT, meta, arrays)


def _rollout_from(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Rollout:
    roles = _array(arrays, "turn_roles", "uint8", 1)
    ends = _array(arrays, "turn_ends", "int32", 1)
    if len(roles) != len(ends):
        raise DecodeError(f"turn_roles has {len(roles)} entries but turn_ends has {len(ends)}")
    if np.any(roles >= len(TURN_ROLES)):
        raise DecodeError(f"turn_roles holds an unknown role code (known: 0..{len(TURN_ROLES) - 1})")
    starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
    turns = [Turn(TURN_ROLES[r], int(s), int(e)) for r, s, e in zip(roles.tolist(), starts.tolist(), ends.tolist())]
    return Rollout(
        rollout_id=_field(meta, "rollout_id", str),
        group_id=_field(meta, "group_id", str),
        prompt_id=_field(meta, "prompt_id", str),
        policy_version=_field(meta, "policy_version", int),
        sampler=_field(meta, "sampler", str),
        region=_field(meta, "region", str),
        created_at_us=_field(meta, "created_at_us", int),
        tokens=_array(arrays, "tokens", "uint32", 1),
        loss_mask=_array(arrays, "loss_mask", "uint8", 1),
        sampler_logprobs=_array(arrays, "sampler_logprobs", "float32", 1),
        turns=turns,
        routed_experts=_array(arrays, "routed_experts", "expert", 3, optional=True),
        finish_reason=_field(meta, "finish_reason", str),
        truncated=_field(meta, "truncated", bool),
        prompt_tokens=_field(meta, "prompt_tokens", int, 0),
    )


def encode_reward(reward: Reward) -> bytes:
    names = list(reward.components)
    meta = {
        "rollout_id": reward.rollout_id,
        "group_id": reward.group_id,
        "grader": reward.grader,
        "score": float(reward.score),
        "created_at_us": int(reward.created_at_us),
        "component_names": names,
    }
    values = np.array([reward.components[n] for n in names], dtype=np.float64)
    return _encode(KIND_REWARD, meta, {"component_values": values})


def _reward_from(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Reward:
    names = _field(meta, "component_names", list, [])
    values = _array(arrays, "component_values", "float64", 1)
    if len(names) != len(values):
        raise DecodeError(f"{len(names)} component names for {len(values)} component values")
    return Reward(
        rollout_id=_field(meta, "rollout_id", str),
        group_id=_field(meta, "group_id", str),
        grader=_field(meta, "grader", str),
        score=float(_field(meta, "score", (int, float))),
        created_at_us=_field(meta, "created_at_us", int),
        components=dict(zip(names, values.tolist())),
    )


def encode_train_batch(batch: TrainBatch) -> bytes:
    """Inline or by reference (`TrainBatch.by_reference`): a by-reference batch carries its rollouts'
    references and sequence advantages instead of the per-token arrays."""
    meta = {
        "batch_id": batch.batch_id,
        "step": int(batch.step),
        "created_at_us": int(batch.created_at_us),
        "rollout_ids": list(batch.rollout_ids),
        "source_topics": [o.topic for o in batch.source_offsets],
    }
    if batch.advantage_estimator is not None:
        meta["advantage_estimator"] = batch.advantage_estimator
    arrays = {}
    if not batch.by_reference:
        arrays.update(tokens=batch.tokens, loss_mask=batch.loss_mask, advantages=batch.advantages, sampler_logprobs=batch.sampler_logprobs)
    arrays.update(
        cu_seqlens=batch.cu_seqlens,
        policy_versions=batch.policy_versions,
        source_offsets=np.array([[o.partition, o.start, o.end] for o in batch.source_offsets], dtype=np.int64).reshape(-1, 3),
    )
    if batch.by_reference:
        refs = batch.rollout_refs
        meta["ref_topics"] = [r.topic for r in refs]
        arrays["ref_positions"] = np.array([[r.partition, r.offset] for r in refs], dtype=np.int64).reshape(-1, 2)
        arrays["ref_sha256"] = np.frombuffer(b"".join(r.sha256 for r in refs), dtype=np.uint8).reshape(-1, ROLLOUT_DIGEST_BYTES)
        arrays["sequence_advantages"] = batch.sequence_advantages
    if batch.routed_experts is not None:
        arrays["routed_experts"] = batch.routed_experts
    return _encode(KIND_TRAIN_BATCH, meta, arrays)


def _rollout_refs(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> list[RolloutRef]:
    topics = _field(meta, "ref_topics", list)
    positions = _array(arrays, "ref_positions", "int64", 2)
    digests = _array(arrays, "ref_sha256", "uint8", 2)
    if positions.shape[1:] != (2,) or digests.shape[1:] != (ROLLOUT_DIGEST_BYTES,) or not len(topics) == len(positions) == len(digests):
        raise DecodeError(f"rollout references: {len(topics)} topics, positions {positions.shape}, sha256 {digests.shape} do not match")
    return [
        RolloutRef(t, int(p), int(o), bytes(d)) for t, (p, o), d in zip(topics, positions.tolist(), digests)
    ]


def _train_batch_from(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> TrainBatch:
    topics = _field(meta, "source_topics", list)
    offsets = _array(arrays, "source_offsets", "int64", 2)
    if offsets.shape[1:] != (3,) or len(topics) != len(offsets):
        raise DecodeError(f"source_offsets shape {offsets.shape} does not match {len(topics)} topics")
    rollout_ids = _field(meta, "rollout_ids", list)
    by_reference = "ref_positions" in arrays
    return TrainBatch(
        batch_id=_field(meta, "batch_id", str),
        step=_field(meta, "step", int),
        tokens=_array(arrays, "tokens", "uint32", 1, optional=by_reference),
        loss_mask=_array(arrays, "loss_mask", "uint8", 1, optional=by_reference),
        advantages=_array(arrays, "advantages", "float32", 1, optional=by_reference),
        sampler_logprobs=_array(arrays, "sampler_logprobs", "float32", 1, optional=by_reference),
        cu_seqlens=_array(arrays, "cu_seqlens", "int32", 1),
        policy_versions=_array(arrays, "policy_versions", "int64", 1),
        rollout_ids=rollout_ids,
        source_offsets=[SourceOffset(t, int(p), int(s), int(e)) for t, (p, s, e) in zip(topics, offsets.tolist())],
        routed_experts=_array(arrays, "routed_experts", "expert", 3, optional=True),
        created_at_us=_field(meta, "created_at_us", int, 0),
        advantage_estimator=_field(meta, "advantage_estimator", str, None),
        rollout_refs=_rollout_refs(meta, arrays) if by_reference else [],
        sequence_advantages=_array(arrays, "sequence_advantages", "float32", 1) if by_reference else None,
    )


_BUILDERS: dict[int, Callable[[dict[str, Any], dict[str, np.ndarray]], Any]] = {
    KIND_ROLLOUT: _rollout_from,
    KIND_REWARD: _reward_from,
    KIND_TRAIN_BATCH: _train_batch_from,
}


def decode(message: bytes | bytearray | memoryview, *, validate: bool = True) -> Rollout | Reward | TrainBatch:
    """Decode any ember message; raises only DecodeError, for any bytes at all.

    Structure, sizes, integer ranges (int64) and Unicode are always checked; InvalidRecord (a
    DecodeError) names the schema issues of a well-formed record.

    `validate=False` skips the schema checks (structure is always checked): for re-reading data this
    process already validated, e.g. replaying its own output topic.
    """
    kind, meta, arrays = _decode(message)
    record = _BUILDERS[kind](meta, arrays)
    issues = record.issues() if validate else []
    if issues:
        raise InvalidRecord(f"invalid {KIND_NAMES[kind]}: " + "; ".join(str(i) for i in issues))
    return record


def _decode_as(message: bytes | bytearray | memoryview, kind: int) -> Any:
    record = decode(message)
    expected = KIND_NAMES[kind]
    if type(record).__name__ != expected:
        raise DecodeError(f"expected a {expected} message, got a {type(record).__name__}")
    return record


def decode_rollout(message: bytes | bytearray | memoryview) -> Rollout:
    return _decode_as(message, KIND_ROLLOUT)


def decode_reward(message: bytes | bytearray | memoryview) -> Reward:
    return _decode_as(message, KIND_REWARD)


def decode_train_batch(message: bytes | bytearray | memoryview) -> TrainBatch:
    return _decode_as(message, KIND_TRAIN_BATCH)


def encode(record: Rollout | Reward | TrainBatch) -> bytes:
    if isinstance(record, Rollout):
        return encode_rollout(record)
    if isinstance(record, Reward):
        return encode_reward(record)
    if isinstance(record, TrainBatch):
        return encode_train_batch(record)
    raise TypeError(f"cannot encode {type(record).__name__}")
