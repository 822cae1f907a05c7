"""JSON control records from Kafka parse to a value or a DecodeError (issue 17): bounded nesting,
integer sizes and Unicode, checked before json.loads can raise anything else."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.schemas import DecodeError
from ember.schemas.wire_json import MAX_JSON_DEPTH, parse_json


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_deep_nesting_is_a_decode_error_not_a_recursion_error(depth):
    with pytest.raises(DecodeError, match=f"nested {depth + 1} levels deep"):
        parse_json(b'{"a": ' + b"[" * depth + b"]" * depth + b"}", "record")


def test_brackets_inside_strings_do_not_count_as_nesting():
    assert parse_json(b'{"a": "' + b"[" * 100 + b'{"}', "record") == {"a": "[" * 100 + "{"}


def test_a_4301_digit_integer_is_a_decode_error():
    with pytest.raises(DecodeError, match="not valid UTF-8 JSON"):
        parse_json(b'{"v": ' + b"1" * 4301 + b"}", "record")


def test_lone_surrogates_are_decode_errors_and_pairs_are_fine():
    with pytest.raises(DecodeError, match="not valid Unicode"):
        parse_json(b'{"g\\ud800": 1}', "record")
    assert parse_json(b'{"g": "\\ud83d\\ude00"}', "record") == {"g": "\U0001f600"}


def test_utf16_is_refused():
    with pytest.raises(DecodeError, match="not valid UTF-8 JSON"):
        parse_json('{"a": 1}'.encode("utf-16"), "record")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_any_bytes_give_a_value_or_a_decode_error(raw):
    try:
        parse_json(raw, "record")
    except DecodeError:
        pass
