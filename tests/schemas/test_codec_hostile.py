"""decode() is total: any bytes give a record or a DecodeError, never another exception (issue 17).

A foreign Arrow writer can put anything into a column: invalid UTF-8 (lone surrogates), integers
wider than int64 (uint64, decimal), nulls, nested types. Each reaches the ETL only as a DecodeError
naming the column.
"""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.rollouts.simulate import synthetic_reward, synthetic_rollout
from ember.schemas import DecodeError, decode, encode
from ember.schemas.errors import InvalidRecord
from ember.schemas.rollouts import MAX_ID_CHARS
from tests.schemas.strategies import deep_list_type, hostile_rewrite, raw_strings, rewritten, train_batches

ROLLOUT = synthetic_rollout(np.random.default_rng(0), group_id="g", prompt_id="p", num_tokens=8, layers=2)
REWARD = synthetic_reward(np.random.default_rng(1), ROLLOUT)


@pytest.mark.parametrize("field", ["rollout_id", "group_id", "prompt_id", "sampler", "region"])
def test_a_lone_surrogate_in_an_id_is_a_decode_error(field):
    with pytest.raises(DecodeError, match=f"column '{field}': Invalid UTF8"):
        decode(rewritten(encode(ROLLOUT), **{field: raw_strings("g\ud800")}))


def test_a_lone_surrogate_in_a_list_of_strings_is_a_decode_error():
    names = pa.ListArray.from_arrays(pa.array([0, 1], pa.int32()), raw_strings("\udfff"))
    with pytest.raises(DecodeError, match="column 'component_names': .*Invalid UTF8"):
        decode(rewritten(encode(REWARD), component_names=names, component_values=pa.array([[1.0]], pa.large_list(pa.float64()))))


def test_a_surrogate_pair_is_valid_unicode():
    rollout = synthetic_rollout(np.random.default_rng(0), group_id="g-\U0001f600", prompt_id="p", num_tokens=8, layers=None)
    assert decode(encode(rollout)).group_id == "g-\U0001f600"


@pytest.mark.parametrize(
    "column, expected",
    [
        (pa.array([2**64 - 1], pa.uint64()), "is uint64, expected int64"),  # 2**70 cannot be written at all
        (pa.array([10**75], pa.decimal256(76)), "is decimal256\\(76, 0\\), expected int64"),
        (pa.array(["7" * 4301]), "is string, expected int64"),
    ],
)
def test_integers_wider_than_int64_are_decode_errors(column, expected):
    with pytest.raises(DecodeError, match=f"column 'policy_version' {expected}"):
        decode(rewritten(encode(ROLLOUT), policy_version=column))


def test_a_deeply_nested_unknown_column_is_ignored_and_a_nested_known_one_refused():
    deep = pa.array([[[[1]]]], deep_list_type(3))
    assert decode(rewritten(encode(ROLLOUT), future=deep)).group_id == "g"
    with pytest.raises(DecodeError, match="column 'tokens' is list<item: list"):
        decode(rewritten(encode(ROLLOUT), tokens=deep))


def test_negative_policy_version_is_invalid():
    with pytest.raises(InvalidRecord, match="policy_version"):
        decode(rewritten(encode(ROLLOUT), policy_version=pa.array([-1], pa.int64())))


def test_ids_longer_than_the_limit_are_invalid():
    with pytest.raises(InvalidRecord, match=f"group_id': has {MAX_ID_CHARS + 1} characters"):
        decode(rewritten(encode(ROLLOUT), group_id=pa.array(["g" * (MAX_ID_CHARS + 1)])))


def test_turns_that_do_not_pair_up_are_decode_errors():
    with pytest.raises(DecodeError, match="turn_roles has 1 entries but turn_ends has 2"):
        decode(rewritten(encode(ROLLOUT), turn_roles=pa.array([["user"]]), turn_ends=pa.array([[2, 8]], pa.large_list(pa.int32()))))


def test_duplicate_reward_component_names_are_decode_errors():
    names, values = pa.array([["a", "a"]]), pa.array([[1.0, 2.0]], pa.large_list(pa.float64()))
    with pytest.raises(DecodeError, match="2 component names \\(1 distinct\\) for 2 component values"):
        decode(rewritten(encode(REWARD), component_names=names, component_values=values))


def test_nulls_inside_an_array_are_decode_errors():
    tokens = pa.array([[1, None, 3, 4, 5, 6, 7, 8]], pa.large_list(pa.uint32()))
    with pytest.raises(DecodeError, match="column 'tokens': its values may not be null"):
        decode(rewritten(encode(ROLLOUT), tokens=tokens))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_log_prob_on_a_prompt_token_is_invalid(bad):
    """A loss-mask-0 token's log-prob still enters the batch (and the RL loss): it must be finite too."""
    rollout = synthetic_rollout(np.random.default_rng(0), group_id="g", prompt_id="p", num_tokens=8, layers=None)
    rollout.sampler_logprobs = rollout.sampler_logprobs.copy()
    rollout.sampler_logprobs[int(np.flatnonzero(rollout.loss_mask == 0)[0])] = bad
    with pytest.raises(InvalidRecord, match="sampler_logprobs.*finite on every token"):
        decode(encode(rollout))


@settings(max_examples=50, deadline=None)
@given(train_batches(), st.sampled_from(["advantages", "sampler_logprobs"]), st.sampled_from([np.nan, np.inf]))
def test_train_batch_with_non_finite_values_is_invalid(batch, field, bad):
    getattr(batch, field)[0] = bad
    with pytest.raises(InvalidRecord, match=f"{field}.*finite"):
        decode(encode(batch))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.sampled_from([encode(ROLLOUT), encode(REWARD)]), st.data())
def test_hostile_columns_give_a_valid_record_or_a_decode_error(message, data):
    try:
        decoded = decode(data.draw(hostile_rewrite(message)))
    except DecodeError:
        return
    decoded.validate()
    assert decode(encode(decoded)) is not None, "what decodes must encode again"
