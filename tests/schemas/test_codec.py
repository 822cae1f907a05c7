import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.rollouts.simulate import synthetic_reward, synthetic_rollout
from ember.schemas import DecodeError, decode, decode_reward, decode_rollout, encode
from ember.schemas.codec import MAGIC, WIRE_VERSION, _encode, KIND_REWARD
from tests.schemas.strategies import assert_same, rewards, rollouts, train_batches


@given(rollouts())
def test_rollout_round_trips_every_field(rollout):
    assert_same(decode(encode(rollout)), rollout)


@given(rewards())
def test_reward_round_trips_every_field(reward):
    assert_same(decode(encode(reward)), reward)


@given(train_batches())
def test_train_batch_round_trips_every_field(batch):
    assert_same(decode(encode(batch)), batch)


def realistic_message() -> bytes:
    rng = np.random.default_rng(7)
    return encode(synthetic_rollout(rng, group_id="g", prompt_id="p", num_tokens=256, layers=4))


def test_decoded_arrays_are_zero_copy_views():
    message = realistic_message()
    rollout = decode_rollout(message)
    assert not rollout.tokens.flags.writeable
    assert rollout.routed_experts.dtype == np.uint8


@settings(max_examples=300)
@given(st.data())
def test_any_truncation_raises_decode_error(data):
    message = realistic_message()
    cut = data.draw(st.integers(0, len(message) - 1))
    with pytest.raises(DecodeError):
        decode(message[:cut])


@settings(max_examples=300)
@given(st.data())
def test_random_corruption_never_raises_anything_but_decode_error(data):
    message = bytearray(realistic_message())
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, 400))
        message[position] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(message))
    except DecodeError:
        pass


@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_decode_error(blob):
    with pytest.raises(DecodeError):
        decode(blob)


def test_wrong_magic_is_named():
    message = b"NOPE" + realistic_message()[4:]
    with pytest.raises(DecodeError, match="bad magic"):
        decode(message)


def test_newer_wire_version_is_refused_with_versions_named():
    message = bytearray(realistic_message())
    message[4] = WIRE_VERSION + 1
    with pytest.raises(DecodeError, match="unsupported wire version 2"):
        decode(bytes(message))


def test_lying_body_length_is_named():
    message = bytearray(realistic_message())
    struct.pack_into("<I", message, 8, 2**32 - 1)
    with pytest.raises(DecodeError, match="length mismatch"):
        decode(bytes(message))


def test_lying_array_shape_does_not_allocate():
    """A shape claiming 2^32 x 2^32 elements must fail on the bounds check, not in numpy."""
    header = struct.pack("<4sBBHI", MAGIC, WIRE_VERSION, KIND_REWARD, 0, 0)
    meta = b'{"rollout_id":"r","group_id":"g","grader":"x","score":1.0,"created_at_us":1,"component_names":[]}'
    name = b"component_values"
    table = struct.pack("<I", len(meta)) + meta + struct.pack("<H", 1)
    table += struct.pack(f"<B{len(name)}sBB", len(name), name, 6, 2) + struct.pack("<2I", 2**32 - 1, 2**32 - 1)
    body = table + b"\x00" * (-len(table) % 8)
    message = header[:8] + struct.pack("<I", len(body)) + body
    with pytest.raises(DecodeError, match="truncated: array 'component_values' payload"):
        decode(message)


def test_schema_invalid_payload_is_a_decode_error_naming_the_field():
    rng = np.random.default_rng(1)
    rollout = synthetic_rollout(rng, group_id="g", prompt_id="p", num_tokens=32, layers=None)
    rollout.loss_mask = rollout.loss_mask[:-1]
    with pytest.raises(DecodeError, match="loss_mask"):
        decode(encode(rollout))


def test_kind_mismatch_is_a_decode_error():
    rng = np.random.default_rng(2)
    rollout = synthetic_rollout(rng, group_id="g", prompt_id="p", num_tokens=32, layers=None)
    with pytest.raises(DecodeError, match="expected a Reward"):
        decode_reward(encode(rollout))


def test_unknown_fields_from_a_newer_writer_are_ignored():
    """Additive evolution on the wire: an extra meta key and an extra array still decode."""
    rng = np.random.default_rng(3)
    reward = synthetic_reward(rng, synthetic_rollout(rng, group_id="g", prompt_id="p", num_tokens=8, layers=None))
    names = list(reward.components)
    meta = {
        "rollout_id": reward.rollout_id,
        "group_id": reward.group_id,
        "grader": reward.grader,
        "score": reward.score,
        "created_at_us": reward.created_at_us,
        "component_names": names,
        "judge_model": "a-field-from-the-future",
    }
    arrays = {
        "component_values": np.array([reward.components[n] for n in names]),
        "per_test_durations": np.arange(5, dtype=np.float32),
    }
    assert_same(decode(_encode(KIND_REWARD, meta, arrays)), reward)


def test_encoding_is_little_endian_regardless_of_input_byte_order():
    rng = np.random.default_rng(4)
    rollout = synthetic_rollout(rng, group_id="g", prompt_id="p", num_tokens=16, layers=None)
    swapped = synthetic_rollout(rng, group_id="g", prompt_id="p", num_tokens=16, layers=None)
    swapped.tokens = rollout.tokens.astype(">u4")
    decoded = decode_rollout(encode(swapped))
    assert np.array_equal(decoded.tokens, rollout.tokens)
    assert decoded.tokens.dtype == np.dtype("<u4")


def test_validate_false_skips_schema_checks_but_not_structure():
    rng = np.random.default_rng(5)
    rollout = synthetic_rollout(rng, group_id="g", prompt_id="p", num_tokens=32, layers=None)
    rollout.finish_reason = "cosmic-ray"
    message = encode(rollout)
    assert decode(message, validate=False).finish_reason == "cosmic-ray"
    with pytest.raises(DecodeError, match="finish_reason"):
        decode(message)
    with pytest.raises(DecodeError, match="length mismatch"):
        decode(message[:-1], validate=False)
