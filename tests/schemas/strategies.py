"""Hypothesis strategies for ember records with every field varied."""

from __future__ import annotations

import json

import numpy as np
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
    return Rollout(
        rollout_id=draw(text),
        group_id=draw(text),
        prompt_id=draw(text),
        policy_version=draw(int64s),
        sampler=draw(text),
        region=draw(st.text(max_size=10)),
        created_at_us=draw(int64s),
        tokens=draw(hnp.arrays(np.uint32, n)),
        loss_mask=loss_mask,
        sampler_logprobs=logprobs,
        turns=draw(turns_for(n)),
        routed_experts=experts,
        finish_reason=draw(st.sampled_from(FINISH_REASONS)),
        truncated=draw(st.booleans()),
        prompt_tokens=draw(st.integers(0, n)),
    )


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


# ---- hostile input: well-formed frames around values no honest writer sends -------------------------

hostile_text = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),  # lone surrogates
    st.text(min_size=257, max_size=300),
    st.just(""),
)
hostile_ints = st.one_of(
    st.integers(-(2**64), 2**64),
    st.just(2**70),
    st.just(-1),
    st.integers(min_value=10**30, max_value=10**40),
)
hostile_scalars = st.one_of(
    hostile_text, hostile_ints, st.floats(), st.booleans(), st.none(), st.floats(min_value=1e300, max_value=1e308)
)
hostile_json = st.recursive(
    hostile_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(hostile_text, inner, max_size=3), max_leaves=8
)


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


@st.composite
def hostile_meta_text(draw, meta: dict) -> bytes:
    """`meta` serialised with one field replaced, added or removed, sometimes spliced with deep nesting or a huge int."""
    meta = dict(meta)
    key = draw(st.sampled_from(sorted(meta) + ["extra"]))
    action = draw(st.sampled_from(["replace", "delete", "deep", "digits"]))
    if action == "delete":
        meta.pop(key, None)
        return json.dumps(meta).encode("utf-8")
    if action == "replace":
        meta[key] = draw(hostile_json)
        return json.dumps(meta).encode("utf-8")  # ASCII: json escapes surrogates as \\udxxx
    meta[key] = "@@"
    spliced = deep_json(draw(st.integers(1, 5000))) if action == "deep" else "1" * draw(st.integers(4000, 5000))
    return json.dumps(meta).replace('"@@"', spliced).encode("utf-8")
