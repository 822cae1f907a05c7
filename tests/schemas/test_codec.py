"""The Arrow IPC wire format: round trips, zero-copy views, structure checks, additive evolution."""

import struct

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.rollouts.simulate import synthetic_reward, synthetic_rollout
from ember.schemas import DecodeError, Reward, decode, decode_reward, decode_rollout, decode_train_batch, encode
from ember.schemas.errors import InvalidRecord
from ember.schemas.versioning import SCHEMA_NAME_KEY, SCHEMA_VERSION_KEY
from tests.schemas.strategies import arrow_message, arrow_parts, assert_same, rewards, rewritten, rollouts, train_batches


@settings(max_examples=60, deadline=None)
@given(rollouts())
def test_rollout_round_trips_every_field(rollout):
    assert_same(decode(encode(rollout)), rollout)


@settings(max_examples=60, deadline=None)
@given(rewards())
def test_reward_round_trips_every_field(reward):
    assert_same(decode(encode(reward)), reward)


@settings(max_examples=60, deadline=None)
@given(train_batches())
def test_train_batch_round_trips_every_field(batch):
    assert_same(decode(encode(batch)), batch)


ROLLOUT = synthetic_rollout(np.random.default_rng(7), group_id="g", prompt_id="p", num_tokens=256, layers=4)
MESSAGE = encode(ROLLOUT)
REWARD = synthetic_reward(np.random.default_rng(8), ROLLOUT)


def test_a_message_is_a_plain_arrow_ipc_stream_naming_its_schema():
    """Any Arrow library reads it: one record batch of one row, ember's schema name and version in the metadata."""
    reader = pa.ipc.open_stream(MESSAGE)
    assert reader.schema.metadata[SCHEMA_NAME_KEY] == b"Rollout"
    assert reader.schema.metadata[SCHEMA_VERSION_KEY] == b"2"
    (batch,) = list(reader)
    assert batch.num_rows == 1
    assert batch.column("group_id")[0].as_py() == "g"
    assert batch.column("routed_experts").type == pa.large_list(pa.list_(pa.list_(pa.uint8(), 8), 4))


def test_decoded_arrays_are_zero_copy_read_only_views_of_the_message():
    message = bytearray(MESSAGE)  # writable, so a copy would show as a writeable array
    rollout = decode_rollout(message)
    base = np.frombuffer(message, np.uint8)
    for array in (rollout.tokens, rollout.loss_mask, rollout.sampler_logprobs, rollout.routed_experts):
        assert not array.flags.writeable
        assert np.shares_memory(array, base)
    assert rollout.routed_experts.shape == (256, 4, 8) and rollout.routed_experts.dtype == np.uint8


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_truncation_raises_decode_error(data):
    cut = data.draw(st.integers(0, len(MESSAGE) - 1))
    with pytest.raises(DecodeError):
        decode(MESSAGE[:cut])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_bit_flips_byte_writes_and_splices_give_a_valid_record_or_a_decode_error(data):
    message = bytearray(MESSAGE)
    for _ in range(data.draw(st.integers(1, 6))):
        position = data.draw(st.integers(0, len(message) - 1))
        action = data.draw(st.sampled_from(["flip", "write", "splice"]))
        if action == "flip":
            message[position] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "write":
            message[position] = data.draw(st.integers(0, 255))
        else:
            end = data.draw(st.integers(position, min(len(message), position + 64)))
            message[position:end] = data.draw(st.binary(max_size=64))
    try:
        record = decode(bytes(message))
    except DecodeError:
        return
    record.validate()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300) | st.binary(max_size=300).map(lambda b: b"\xff\xff\xff\xff" + b))
def test_arbitrary_bytes_raise_only_decode_error(blob):
    with pytest.raises(DecodeError):
        decode(blob)


def test_bytes_that_are_not_arrow_are_named():
    with pytest.raises(DecodeError, match="bad magic b'NOPE"):
        decode(b"NOPE" + MESSAGE[4:])
    with pytest.raises(DecodeError, match="ember's old hand-written layout"):
        decode(b"EMBR\x01\x01\x00\x00" + MESSAGE)


def test_the_end_of_stream_marker_is_required_and_nothing_may_follow_it():
    with pytest.raises(DecodeError, match="truncated: .* without its end-of-stream marker"):
        decode(MESSAGE[:-8])
    with pytest.raises(DecodeError, match="without its end-of-stream marker"):
        decode(MESSAGE + b"\x00" * 8)


@pytest.mark.parametrize("length", [2**31 - 1, 2**30])
def test_lying_metadata_length_fails_without_allocating(length):
    """The first message's length prefix claims up to 2 GiB: a bounds check, not an allocation."""
    message = MESSAGE[:4] + struct.pack("<i", length) + MESSAGE[8:]
    with pytest.raises(DecodeError, match="not a well-formed Arrow IPC stream"):
        decode(message)


def test_a_message_with_two_rows_or_two_batches_is_refused():
    meta, columns = arrow_parts(MESSAGE)
    two_rows = pa.RecordBatch.from_arrays([pa.concat_arrays([a, a]) for a in columns.values()], names=list(columns))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, two_rows.schema.with_metadata(meta)) as writer:
        writer.write_batch(two_rows)
    with pytest.raises(DecodeError, match="holds one row, this one 2"):
        decode(sink.getvalue().to_pybytes())
    sink = pa.BufferOutputStream()
    one = pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))
    with pa.ipc.new_stream(sink, one.schema.with_metadata(meta)) as writer:
        writer.write_batch(one)
        writer.write_batch(one)
    with pytest.raises(DecodeError, match="more than one record batch"):
        decode(sink.getvalue().to_pybytes())


def test_schema_identity_is_checked():
    with pytest.raises(DecodeError, match="names no ember record"):
        decode(rewritten(MESSAGE, metadata={SCHEMA_NAME_KEY: b"Document"}))
    with pytest.raises(DecodeError, match="Rollout schema version 3 is newer than this ember reads \\(2\\); upgrade ember"):
        decode(rewritten(MESSAGE, metadata={SCHEMA_VERSION_KEY: b"3"}))
    with pytest.raises(DecodeError, match="is not a number"):
        decode(rewritten(MESSAGE, metadata={SCHEMA_VERSION_KEY: b"9" * 4301}))


def test_a_missing_required_column_and_a_wrong_type_are_named():
    with pytest.raises(DecodeError, match="Rollout has no column 'tokens'"):
        decode(rewritten(MESSAGE, drop=("tokens",)))
    with pytest.raises(DecodeError, match="column 'tokens' is large_list<item: int64>, expected large_list<uint32>"):
        decode(rewritten(MESSAGE, tokens=pa.array([[1, 2]], pa.large_list(pa.int64()))))
    with pytest.raises(DecodeError, match="column 'group_id': the value may not be null"):
        decode(rewritten(MESSAGE, group_id=pa.nulls(1, pa.string())))


def test_unknown_columns_and_metadata_from_a_newer_writer_are_ignored():
    """Additive evolution: a newer writer's extra column and metadata key still decode."""
    message = rewritten(
        encode(REWARD),
        metadata={b"judge.model": b"a-field-from-the-future"},
        per_test_durations=pa.array([[0.5, 1.5]], pa.large_list(pa.float32())),
    )
    assert_same(decode(message), REWARD)


def test_absent_optional_columns_take_their_defaults():
    """An older writer that knew no routed experts, prompt_tokens or reward components."""
    decoded = decode(rewritten(MESSAGE, drop=("routed_experts", "prompt_tokens")))
    assert decoded.routed_experts is None and decoded.prompt_tokens == 0
    reward = decode_reward(rewritten(encode(REWARD), drop=("component_names", "component_values")))
    assert reward.components == {} and reward.score == REWARD.score
    nulled = decode(rewritten(MESSAGE, routed_experts=pa.nulls(1, pa.large_list(pa.list_(pa.list_(pa.uint8(), 8), 4)))))
    assert nulled.routed_experts is None


def test_a_rollout_written_before_the_version_span_ended_with_the_version_it_started_with():
    """policy_version_end is additive: an old writer's rollout has none, and its span is [start, start]."""
    spanning = synthetic_rollout(np.random.default_rng(3), group_id="g", prompt_id="p", num_tokens=16, layers=None)
    spanning.policy_version, spanning.policy_version_end = 4, 6
    assert decode(encode(spanning)).last_policy_version == 6
    old = decode(rewritten(encode(spanning), drop=("policy_version_end",)))
    assert old.policy_version_end is None and old.last_policy_version == old.policy_version == 4
    spanning.policy_version_end = 3
    with pytest.raises(InvalidRecord, match=r"'policy_version_end': must be in \[4, "):
        decode(encode(spanning))


def test_a_reward_before_grader_version_and_verdict_decodes_and_a_graded_one_carries_them():
    """Rewards written before the grading service (no grader_version, no verdict columns) still decode: additive
    evolution, the schema version unchanged; a None field writes no column at all, the old wire form."""
    old = encode(REWARD)
    assert REWARD.grader_version is None and not {"grader_version", "verdict"} & set(pa.ipc.open_stream(old).schema.names)
    decoded = decode_reward(old)
    assert (decoded.grader_version, decoded.verdict) == (None, None)
    graded = Reward("r-0", "g", "unit-tests", 1.0, 5, {"passed": 1.0}, grader_version="3", verdict="passed")
    schema = pa.ipc.open_stream(encode(graded)).schema
    assert schema.metadata[SCHEMA_VERSION_KEY] == b"1"
    assert decode_reward(encode(graded)) == graded
    with pytest.raises(InvalidRecord, match="grader_version"):
        decode_reward(encode(Reward("r-0", "g", "t", 1.0, 5, grader_version="v" * 10_000)))


def test_a_record_written_by_another_arrow_writer_decodes():
    """A grader in another language builds the columns itself; ember only needs names, types and metadata."""
    meta, _columns = arrow_parts(encode(REWARD))
    columns = {
        "rollout_id": pa.array(["r1"]),
        "group_id": pa.array(["g"]),
        "grader": pa.array(["unit-tests"]),
        "score": pa.array([0.75]),
        "created_at_us": pa.array([12], pa.int64()),
        "component_names": pa.array([["passed"]]),
        "component_values": pa.array([[0.75]], pa.large_list(pa.float64())),
    }
    assert decode(arrow_message(meta, columns)) == Reward("r1", "g", "unit-tests", 0.75, 12, {"passed": 0.75})


def test_schema_invalid_payload_is_an_invalid_record_naming_the_field():
    rollout = synthetic_rollout(np.random.default_rng(1), group_id="g", prompt_id="p", num_tokens=32, layers=None)
    rollout.loss_mask = rollout.loss_mask[:-1]
    with pytest.raises(InvalidRecord, match="loss_mask"):
        decode(encode(rollout))


def test_kind_mismatch_is_a_decode_error():
    with pytest.raises(DecodeError, match="expected a Reward"):
        decode_reward(MESSAGE)
    with pytest.raises(DecodeError, match="expected a TrainBatch"):
        decode_train_batch(encode(REWARD))


def test_encoding_is_little_endian_regardless_of_input_byte_order():
    swapped = synthetic_rollout(np.random.default_rng(4), group_id="g", prompt_id="p", num_tokens=16, layers=None)
    expected = swapped.tokens.copy()
    swapped.tokens = swapped.tokens.astype(">u4")
    decoded = decode_rollout(encode(swapped))
    assert np.array_equal(decoded.tokens, expected)
    assert decoded.tokens.dtype == np.dtype("<u4")


def test_encode_refuses_what_the_wire_types_cannot_hold():
    """A silent cast would wrap token ids or round log-probs: the encoder names the field instead."""
    rollout = synthetic_rollout(np.random.default_rng(5), group_id="g", prompt_id="p", num_tokens=16, layers=None)
    rollout.tokens = rollout.tokens.astype(np.int64)
    with pytest.raises(ValueError, match="field 'tokens': is int64\\[16\\], the wire carries 1-D uint32"):
        encode(rollout)
    rollout = synthetic_rollout(np.random.default_rng(5), group_id="g", prompt_id="p", num_tokens=16, layers=None)
    rollout.policy_version = 2**70
    with pytest.raises(ValueError, match="field 'policy_version'"):
        encode(rollout)
    with pytest.raises(TypeError, match="cannot encode str"):
        encode("a rollout")


def test_validate_false_skips_schema_checks_but_not_structure():
    rollout = synthetic_rollout(np.random.default_rng(5), group_id="g", prompt_id="p", num_tokens=32, layers=None)
    rollout.finish_reason = "cosmic-ray"
    message = encode(rollout)
    assert decode(message, validate=False).finish_reason == "cosmic-ray"
    with pytest.raises(InvalidRecord, match="finish_reason"):
        decode(message)
    with pytest.raises(DecodeError, match="truncated"):
        decode(message[:-8], validate=False)
