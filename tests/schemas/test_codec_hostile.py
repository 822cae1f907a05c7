"""decode() is total: any bytes give a record or a DecodeError, never another exception (issue 17).

Each named case crashed (or decoded a value that crashed the ETL later) before the decoder bounded
nesting, integer sizes and Unicode.
"""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.rollouts.simulate import synthetic_reward, synthetic_rollout
from ember.schemas import DecodeError, decode, encode
from ember.schemas.codec import KIND_REWARD, KIND_ROLLOUT, MAX_JSON_DEPTH, _decode, _frame
from ember.schemas.errors import InvalidRecord
from ember.schemas.rollouts import MAX_ID_CHARS
from tests.schemas.strategies import deep_json, hostile_meta_text, train_batches

ROLLOUT = synthetic_rollout(np.random.default_rng(0), group_id="g", prompt_id="p", num_tokens=8, layers=None)
REWARD = synthetic_reward(np.random.default_rng(1), ROLLOUT)


def parts(record) -> tuple[int, dict, dict]:
    kind, meta, arrays = _decode(encode(record))
    return kind, meta, {name: np.array(a) for name, a in arrays.items()}


def with_meta(record, text: str | bytes, **arrays) -> bytes:
    kind, _meta, original = parts(record)
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return _frame(kind, raw, {**original, **arrays})


def replaced(record, **fields) -> bytes:
    _kind, meta, _arrays = parts(record)
    return with_meta(record, json.dumps({**meta, **fields}))


@pytest.mark.parametrize("field", ["rollout_id", "group_id", "prompt_id", "sampler", "region"])
def test_a_lone_surrogate_in_an_id_is_a_decode_error(field):
    with pytest.raises(DecodeError, match="not valid Unicode"):
        decode(replaced(ROLLOUT, **{field: "g\ud800"}))


def test_a_lone_surrogate_in_a_reward_component_name_is_a_decode_error():
    with pytest.raises(DecodeError, match="not valid Unicode"):
        decode(replaced(REWARD, component_names=["\udfff"] * len(REWARD.components)))


def test_a_surrogate_pair_escape_is_valid_unicode():
    assert decode(replaced(ROLLOUT, group_id="g-\U0001f600")).group_id == "g-\U0001f600"


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_deeply_nested_meta_is_a_decode_error_not_a_recursion_error(depth):
    _kind, meta, _arrays = parts(ROLLOUT)
    text = json.dumps({**meta, "future": "@@"}).replace('"@@"', deep_json(depth))
    with pytest.raises(DecodeError, match=f"nested {depth + 1} levels deep"):
        decode(with_meta(ROLLOUT, text))


def test_brackets_inside_strings_do_not_count_as_nesting():
    assert decode(replaced(ROLLOUT, region="[" * 100 + '{"')).region == "[" * 100 + '{"'


def test_a_4301_digit_integer_is_a_decode_error():
    _kind, meta, _arrays = parts(ROLLOUT)
    text = json.dumps({**meta, "policy_version": "@@"}).replace('"@@"', "1" * 4301)
    with pytest.raises(DecodeError, match="not valid UTF-8 JSON"):
        decode(with_meta(ROLLOUT, text))


@pytest.mark.parametrize("value", [2**70, 2**63, -(2**63) - 1])
def test_integers_outside_int64_are_decode_errors(value):
    with pytest.raises(DecodeError, match="'policy_version' is an integer of .* bits, outside int64"):
        decode(replaced(ROLLOUT, policy_version=value))


def test_a_huge_integer_score_is_a_decode_error_not_an_overflow_error():
    with pytest.raises(DecodeError, match="'score'"):
        decode(replaced(REWARD, score=10**400))


def test_negative_policy_version_is_invalid():
    with pytest.raises(InvalidRecord, match="policy_version"):
        decode(replaced(ROLLOUT, policy_version=-1))


def test_ids_longer_than_the_limit_are_invalid():
    with pytest.raises(InvalidRecord, match=f"group_id': has {MAX_ID_CHARS + 1} characters"):
        decode(replaced(ROLLOUT, group_id="g" * (MAX_ID_CHARS + 1)))


def test_meta_in_utf16_is_refused():
    _kind, meta, _arrays = parts(ROLLOUT)
    with pytest.raises(DecodeError, match="not valid UTF-8 JSON"):
        decode(with_meta(ROLLOUT, json.dumps(meta).encode("utf-16")))


def test_non_string_list_items_are_decode_errors():
    with pytest.raises(DecodeError, match="'component_names' must be a list of strings"):
        decode(replaced(REWARD, component_names=[1] * len(REWARD.components)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_log_prob_on_a_prompt_token_is_invalid(bad):
    """A loss-mask-0 token's log-prob still enters the batch (and the RL loss): it must be finite too."""
    logprobs = np.array(ROLLOUT.sampler_logprobs)
    prompt = int(np.flatnonzero(ROLLOUT.loss_mask == 0)[0])
    logprobs[prompt] = bad
    with pytest.raises(InvalidRecord, match="sampler_logprobs.*finite on every token"):
        decode(with_meta(ROLLOUT, json.dumps(parts(ROLLOUT)[1]), sampler_logprobs=logprobs))


@settings(max_examples=50)
@given(train_batches(), st.sampled_from(["advantages", "sampler_logprobs"]), st.sampled_from([np.nan, np.inf]))
def test_train_batch_with_non_finite_values_is_invalid(batch, field, bad):
    getattr(batch, field)[0] = bad
    with pytest.raises(InvalidRecord, match=f"{field}.*finite"):
        decode(encode(batch))


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.sampled_from([ROLLOUT, REWARD]), st.data())
def test_hostile_meta_gives_a_record_or_a_decode_error(record, data):
    _kind, meta, _arrays = parts(record)
    message = with_meta(record, data.draw(hostile_meta_text(meta)))
    try:
        decoded = decode(message)
    except DecodeError:
        return
    decoded.validate()
    assert decode(encode(decoded)) is not None, "what decodes must encode again"


@settings(max_examples=300)
@given(st.sampled_from([KIND_ROLLOUT, KIND_REWARD]), st.binary(max_size=300))
def test_arbitrary_meta_bytes_give_only_decode_errors(kind, raw):
    record = ROLLOUT if kind == KIND_ROLLOUT else REWARD
    try:
        decode(with_meta(record, raw))
    except DecodeError:
        pass
