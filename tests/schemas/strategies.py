"""Hypothesis strategies for ember records with every field varied."""

from __future__ import annotations

import decimal
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pyarrow as pa
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ember.schemas.rollouts import FINISH_REASONS, TURN_ROLES, Reward, Rollout, SourceOffset, TrainBatch, Turn

text = st.text(min_size=1, max_size=20)
int64s = st.integers(min_value=0, max_value=2**62)


@st.composite
def turns_for(draw, n: int) -> list[Turn]:
    if n == 0 or draw(st.booleans()):
        return []
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(5, n - 1)))) if n > 1 else []
    bounds = [0, *cuts, n]
    return [Turn(draw(st.sampled_from(TURN_ROLES)), s, e) for s, e in zip(bounds, bounds[1:])]


@st.composite
def rollouts(draw) -> Rollout:
    n = draw(st.integers(0, 64))
    loss_mask = draw(hnp.arrays(np.uint8, n, elements=st.integers(0, 1)))
    logprobs = draw(hnp.arrays(np.float32, n, elements=st.floats(-30, 0, width=32)))
    experts = None
    if draw(st.booleans()):
        dtype = draw(st.sampled_from([np.uint8, np.uint16]))
        shape = (n, draw(st.integers(1, 4)), draw(st.integers(1, 8)))
        experts = draw(hnp.arrays(dtype, shape))
    version = draw(int64s)
    turns = draw(turns_for(n))
    for turn in turns:
        if turn.role == "tool":
            loss_mask[turn.start : turn.end] = 0  # tool output is never the policy's: a loss mask there is invalid
    return Rollout(
        rollout_id=draw(text),
        group_id=draw(text),
        prompt_id=draw(text),
        policy_version=version,
        sampler=draw(text),
        region=draw(st.text(max_size=10)),
        created_at_us=draw(int64s),
        tokens=draw(hnp.arrays(np.uint32, n)),
        loss_mask=loss_mask,
        sampler_logprobs=logprobs,
        turns=turns,
        routed_experts=experts,
        finish_reason=draw(st.sampled_from(FINISH_REASONS)),
        truncated=draw(st.booleans()),
        prompt_tokens=draw(st.integers(0, n)),
        policy_version_end=draw(st.none() | st.integers(version, 2**63 - 1)),
        **draw(segment_fields(loss_mask)),
    )


@st.composite
def segment_fields(draw, loss_mask: np.ndarray) -> dict:
    """None (a plain rollout) or a valid segment: last or not, from a summary (context, no loss) or not."""
    if draw(st.booleans()):
        return {}
    index = draw(st.integers(0, 7))
    fields = {"episode_id": draw(text), "segment_index": index}
    if draw(st.booleans()):
        fields["segments_total"] = index + 1
    n = len(loss_mask)
    if index > 0 and n > 0 and draw(st.booleans()):
        start = draw(st.integers(0, n - 1))
        end = draw(st.integers(start + 1, n))
        loss_mask[start:end] = 0
        fields.update(summarises=draw(text), summary_start=start, summary_end=end)
    return fields


finite = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def rewards(draw) -> Reward:
    return Reward(
        rollout_id=draw(text),
        group_id=draw(text),
        grader=draw(text),
        score=draw(finite),
        created_at_us=draw(int64s),
        components=draw(st.dictionaries(st.text(max_size=12), finite, max_size=5)),
        grader_version=draw(st.none() | text),
        verdict=draw(st.none() | text),
    )


@st.composite
def train_batches(draw) -> TrainBatch:
    lengths = draw(st.lists(st.integers(1, 16), min_size=1, max_size=6))
    n = sum(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    experts = draw(hnp.arrays(np.uint8, (n, 2, 3))) if draw(st.booleans()) else None
    return TrainBatch(
        batch_id=draw(text),
        step=draw(int64s),
        tokens=draw(hnp.arrays(np.uint32, n)),
        loss_mask=draw(hnp.arrays(np.uint8, n, elements=st.integers(0, 1))),
        advantages=draw(hnp.arrays(np.float32, n, elements=st.floats(-10, 10, width=32))),
        sampler_logprobs=draw(hnp.arrays(np.float32, n, elements=st.floats(-30, 0, width=32))),
        cu_seqlens=cu,
        policy_versions=draw(hnp.arrays(np.int64, len(lengths), elements=st.integers(0, 2**40))),
        rollout_ids=[f"r{i}-{draw(text)}" for i in range(len(lengths))],
        source_offsets=draw(
            st.lists(st.builds(SourceOffset, text, st.integers(0, 1000), int64s, int64s), max_size=4)
        ),
        routed_experts=experts,
        created_at_us=draw(int64s),
        advantage_estimator=draw(st.sampled_from([None, "grpo", "dr_grpo", "rloo"])),
        episode_ids=sorted(draw(st.lists(st.sampled_from("abc"), min_size=len(lengths), max_size=len(lengths)))) if draw(st.booleans()) else [],
    )


def assert_same(a, b) -> None:
    """Field-by-field equality that compares numpy arrays exactly, including dtype and shape."""
    assert type(a) is type(b)
    for name, left in vars(a).items():
        right = getattr(b, name)
        if isinstance(left, np.ndarray) or isinstance(right, np.ndarray):
            assert isinstance(left, np.ndarray) and isinstance(right, np.ndarray), name
            assert left.dtype == right.dtype and left.shape == right.shape, name
            assert np.array_equal(left, right), name
        else:
            assert left == right, name


# ---- hostile input: messages another Arrow writer could send ------------------------------------


def arrow_parts(message: bytes) -> tuple[dict[bytes, bytes], dict[str, pa.Array]]:
    """A message's schema metadata and columns, read with plain pyarrow (no ember checks)."""
    batch = pa.ipc.open_stream(message).read_next_batch()
    return dict(batch.schema.metadata or {}), dict(zip(batch.schema.names, batch.columns))


def arrow_message(metadata: dict[bytes, bytes], columns: dict[str, pa.Array]) -> bytes:
    """An IPC stream as any Arrow writer would write it: no ember code involved."""
    batch = pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema.with_metadata(metadata)) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def arrow_message_with(message: bytes, compression: str | None = None, **columns: pa.Array) -> bytes:
    """`message` with columns added or replaced, written as any Arrow writer may, its body compressed with
    `compression` ("zstd", "lz4") or not."""
    meta, original = arrow_parts(message)
    batch = pa.RecordBatch.from_arrays([*original.values(), *columns.values()], names=[*original, *columns])
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, batch.schema.with_metadata(meta), options=options) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def zeros_column(count: int) -> pa.Array:
    """One row of `count` zero bytes, `large_list<uint8>`: calloc'd, so it costs no memory until read."""
    return pa.LargeListArray.from_arrays(pa.array([0, count], pa.int64()), pa.array(np.zeros(count, np.uint8)))


_POOLS: list[pa.MemoryPool] = []  # never freed: a buffer that outlived its block must not outlive its pool


@contextmanager
def arrow_pool() -> Iterator[pa.MemoryPool]:
    """Arrow's allocations inside the block, counted on a pool of their own (a proxy of the default)."""
    previous = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(previous)
    _POOLS.append(pool)
    pa.set_memory_pool(pool)
    try:
        yield pool
    finally:
        pa.set_memory_pool(previous)


def rewritten(message: bytes, *, drop: tuple[str, ...] = (), metadata: dict[bytes, bytes] | None = None, **columns: pa.Array) -> bytes:
    """`message` with columns replaced or added, some dropped, its metadata updated."""
    meta, original = arrow_parts(message)
    kept = {name: array for name, array in original.items() if name not in drop}
    return arrow_message({**meta, **(metadata or {})}, {**kept, **columns})


def raw_strings(*values: str) -> pa.Array:
    """One row of a string column holding exactly these characters' bytes, lone surrogates included
    (pyarrow refuses to build such an array from Python strings; a foreign writer need not)."""
    data = [v.encode("utf-8", "surrogatepass") for v in values]
    offsets = np.cumsum([0, *map(len, data)], dtype=np.int32)
    return pa.Array.from_buffers(pa.string(), len(values), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))])


def deep_list_type(depth: int) -> pa.DataType:
    nested = pa.int64()
    for _ in range(depth):
        nested = pa.list_(nested)
    return nested


hostile_text = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),  # lone surrogates
    st.text(min_size=257, max_size=300),
    st.just(""),
)
hostile_int64s = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([-1, 2**63 - 1, -(2**63)]))


def _list_column(values: list[int], dtype: pa.DataType, list_type) -> pa.Array:
    return pa.array([[v % 256 for v in values] if dtype == pa.uint8() else values], list_type(dtype))


def _nested_column(depth: int) -> pa.Array:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return pa.array([value], deep_list_type(depth))


# One row of a column of some type with values no honest writer sends (built once: strategies are
# cheap to draw from, not to construct).
hostile_column = st.one_of(
    hostile_text.map(raw_strings),
    hostile_int64s.map(lambda v: pa.array([v], pa.int64())),
    st.integers(0, 2**64 - 1).map(lambda v: pa.array([v], pa.uint64())),
    st.integers(-(10**75), 10**75).map(lambda v: pa.array([decimal.Decimal(v)], pa.decimal256(76))),
    st.floats().map(lambda v: pa.array([v], pa.float64())),
    st.booleans().map(lambda v: pa.array([v])),
    st.sampled_from([pa.string(), pa.int64(), pa.large_list(pa.uint32()), pa.null()]).map(lambda t: pa.nulls(1, t)),
    st.builds(
        _list_column,
        st.lists(st.integers(0, 2**24), max_size=8),
        st.sampled_from([pa.uint32(), pa.uint8(), pa.int64(), pa.float32()]),
        st.sampled_from([pa.list_, pa.large_list]),
    ),
    st.integers(2, 63).map(_nested_column),  # pyarrow writes at most 63 levels; its reader stops at 64
)
_REWRITES = st.sampled_from(["replace", "replace", "drop", "metadata"])


@st.composite
def hostile_rewrite(draw, message: bytes) -> bytes:
    """`message` with one column replaced by a hostile one, added, or removed, or its metadata changed."""
    meta, columns = arrow_parts(message)
    name = draw(st.sampled_from(sorted(columns) + ["extra"]))
    action = draw(_REWRITES)
    if action == "drop":
        return rewritten(message, drop=(name,))
    if action == "metadata":
        key = draw(st.sampled_from(sorted(meta) + [b"extra"]))
        return rewritten(message, metadata={key: draw(st.binary(max_size=12))})
    return rewritten(message, **{name: draw(hostile_column)})
