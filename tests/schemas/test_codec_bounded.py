"""decode() allocates a fixed multiple of the message, whatever the message claims (issue 26).

Arrow IPC may compress a batch's body, and 64 KB of zstd holds 2 GB of zeros: a compressed body is
refused from the batch headers, before any body is read, while an unknown uncompressed column is still
ignored (additive evolution). Arrow's allocations are counted on a proxy of its memory pool, Python's
(numpy's included) with tracemalloc.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.rollouts.simulate import synthetic_reward, synthetic_rollout
from ember.schemas import DecodeError, decode, encode
from ember.schemas.rollouts import Turn
from tests.schemas.strategies import arrow_message_with, arrow_pool, assert_same, rewritten, zeros_column

ROLLOUT = synthetic_rollout(np.random.default_rng(3), group_id="g", prompt_id="p", num_tokens=64, layers=2)
MESSAGE = encode(ROLLOUT)
REWARD = synthetic_reward(np.random.default_rng(4), ROLLOUT)
BOMB_ZEROS = 2 * 10**9  # the issue's bomb: 64.6 KB on the wire, 2.0 GB of Arrow memory in decode() before the fix
ARROW_SLACK = 64 * 1024
PYTHON_PER_BYTE, PYTHON_SLACK = 32, 2 << 20  # a decoded turn or component name is a few Python objects


def test_the_issue_bomb_is_refused_before_its_body_is_expanded():
    bomb = arrow_message_with(MESSAGE, "zstd", future=zeros_column(BOMB_ZEROS))
    assert len(bomb) < 100_000
    with arrow_pool() as pool:
        with pytest.raises(DecodeError, match="record batch message's body is zstd-compressed: ember refuses compressed bodies"):
            decode(bomb)
    assert pool.max_memory() < ARROW_SLACK


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_a_compressed_record_is_refused_naming_the_codec(compression):
    with pytest.raises(DecodeError, match=f"body is {compression}-compressed"):
        decode(arrow_message_with(MESSAGE, compression))


def test_a_compressed_dictionary_is_refused_too():
    labels = pa.DictionaryArray.from_arrays(pa.array([0], pa.int32()), pa.array(["a"]))
    with pytest.raises(DecodeError, match="the dictionary message's body is zstd-compressed"):
        decode(arrow_message_with(MESSAGE, "zstd", labels=labels))


def test_uncompressed_unknown_columns_are_still_ignored_and_never_copied():
    labels = pa.DictionaryArray.from_arrays(pa.array([0], pa.int32()), pa.array(["a"]))
    message = arrow_message_with(MESSAGE, future=zeros_column(10**6), labels=labels, note=pa.array(["x"]))
    with arrow_pool() as pool:
        record = decode(message)
    assert_same(record, ROLLOUT)
    assert pool.max_memory() < ARROW_SLACK
    del record
    assert pool.bytes_allocated() == 0


def _turns(count: int, valid: bool) -> bytes:
    if not valid:  # roles no writer sends and ends that go nowhere: each turn is a schema issue
        roles = pa.ListArray.from_arrays(pa.array([0, count], pa.int32()), pa.array([""] * count, pa.string()))
        ends = pa.LargeListArray.from_arrays(pa.array([0, count], pa.int64()), pa.array(np.zeros(count, np.int32)))
        return rewritten(MESSAGE, turn_roles=roles, turn_ends=ends)
    rollout = synthetic_rollout(np.random.default_rng(5), group_id="g", prompt_id="p", num_tokens=count + 1, layers=None)
    rollout.turns = [Turn("user", i, i + 1) for i in range(count)] + [Turn("assistant", count, count + 1)]
    return encode(rollout)


def _components(count: int, finite: bool) -> bytes:
    names = pa.ListArray.from_arrays(pa.array([0, count], pa.int32()), pa.array([str(i) for i in range(count)], pa.string()))
    values = pa.LargeListArray.from_arrays(pa.array([0, count], pa.int64()), pa.array(np.full(count, 0.5 if finite else np.nan)))
    return rewritten(encode(REWARD), component_names=names, component_values=values)


# Records whose size is in their lists: Python objects per turn or component, or an unknown column's bytes.
_SHAPES = {
    "unknown zeros": lambda n: rewritten(MESSAGE, future=zeros_column(100 * n)),
    "unknown strings": lambda n: rewritten(MESSAGE, future=pa.array([["ab"] * n])),
    "zeros for tokens": lambda n: rewritten(MESSAGE, tokens=pa.LargeListArray.from_arrays(pa.array([0, 100 * n], pa.int64()), pa.array(np.zeros(100 * n, np.uint32)))),
    "turns": lambda n: _turns(n, valid=True),
    "bad turns": lambda n: _turns(n, valid=False),
    "components": lambda n: _components(n, finite=True),
    "non-finite components": lambda n: _components(n, finite=False),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(_SHAPES)), st.integers(0, 20_000), st.sampled_from([None, None, "lz4", "zstd"]))
def test_no_message_makes_decode_allocate_more_than_a_fixed_multiple_of_its_size(shape, count, compression):
    message = arrow_message_with(_SHAPES[shape](count), compression)
    tracemalloc.start()
    try:
        with arrow_pool() as pool:
            try:
                decode(message)
            except DecodeError as exc:
                assert compression is None or f"{compression}-compressed" in str(exc)
            else:
                assert compression is None, "a compressed body decoded"
        python_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert pool.max_memory() <= len(message) + ARROW_SLACK, (shape, count, pool.max_memory(), len(message))
    assert python_peak <= PYTHON_PER_BYTE * len(message) + PYTHON_SLACK, (shape, count, python_peak, len(message))
    assert pool.bytes_allocated() == 0
