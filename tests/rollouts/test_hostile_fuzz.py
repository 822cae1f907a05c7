"""decode() is total, over the public codec API only (issue 17): arbitrary bytes, byte-level damage
to real messages, and records holding hostile values give a record that is safe to use or a
`DecodeError`, never another exception. It holds for any wire format whose `decode` raises only
`DecodeError`: nothing here reads codec internals.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.schemas import DecodeError, Reward, Rollout, TrainBatch, decode, encode
from ember.schemas.rollouts import INT64_MAX, MAX_ID_CHARS
from tests.rollouts.hostile_support import messages, plans


def assert_sane(record: Rollout | Reward | TrainBatch) -> None:
    """What decodes is safe to use: no schema issues, valid Unicode, int64 integers, finite floats."""
    assert not record.issues()
    for name, value in vars(record).items():
        if isinstance(value, str):
            value.encode("utf-8")  # a lone surrogate raises here
            assert len(value) <= MAX_ID_CHARS or name in ("sampler", "region"), name
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            assert -(2**63) <= value <= INT64_MAX, name
        elif isinstance(value, float):
            assert math.isfinite(value), name
        elif isinstance(value, dict):
            assert all(math.isfinite(v) for v in value.values()), name
        elif isinstance(value, np.ndarray) and value.dtype.kind == "f":
            assert np.isfinite(value).all(), name
    assert type(decode(encode(record))) is type(record), "what decodes encodes again"


@settings(max_examples=250, deadline=None)
@given(plans, st.binary(max_size=96))
def test_the_decoder_gives_a_sane_record_or_a_decode_error_for_any_bytes(plan, blob):
    for raw in [blob, *(m.value for m in messages([plan], [0]))]:
        try:
            record = decode(raw)
        except DecodeError:
            continue
        assert_sane(record)
