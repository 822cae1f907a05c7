"""Rollout schema 2: episode segments, their summary span, tool turns, and version-1 rollouts read as one-segment episodes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ember.schemas.errors import InvalidRecord, SchemaValidationError
from ember.schemas.codec import decode, encode
from ember.schemas.rollouts import Rollout, Turn, rollouts_to_table, table_to_rollouts
from ember.schemas.versioning import SCHEMA_VERSION_KEY
from tests.schemas.strategies import rewritten


def segment(**fields) -> Rollout:
    """Segment 1 of episode e: user context = the summary of segment 0, an assistant turn, a tool turn, an assistant turn."""
    mask = np.array([0, 0, 0, 1, 1, 0, 0, 1], np.uint8)
    base = Rollout(
        rollout_id="e-s1", group_id="g", prompt_id="p", policy_version=3, sampler="s", region="", created_at_us=1,
        tokens=np.arange(8, dtype=np.uint32), loss_mask=mask,
        sampler_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
        turns=[Turn("user", 0, 3), Turn("assistant", 3, 5), Turn("tool", 5, 7), Turn("assistant", 7, 8)],
        episode_id="e", segment_index=1, segments_total=2, summarises="e-s0", summary_start=0, summary_end=3,
    )
    return dataclasses.replace(base, **fields)


def test_a_segment_round_trips_through_the_wire_and_arrow_tables():
    good = segment()
    decoded = decode(encode(good))
    assert (decoded.episode_id, decoded.segment_index, decoded.segments_total) == ("e", 1, 2)
    assert (decoded.summarises, decoded.summary_start, decoded.summary_end) == ("e-s0", 0, 3)
    assert decoded.episode_key == "e"
    (back,) = table_to_rollouts(rollouts_to_table([good]))
    assert (back.episode_id, back.segment_index, back.summary_end) == ("e", 1, 3)


def test_a_version_1_rollout_reads_as_a_one_segment_episode_keyed_by_its_own_id():
    plain = segment(episode_id=None, segment_index=0, segments_total=None, summarises=None, summary_start=None, summary_end=None)
    message = encode(plain)
    assert "segment_index" not in message.decode("latin-1")  # a plain rollout writes no segment column at all
    old = decode(rewritten(message, metadata={SCHEMA_VERSION_KEY: b"1"}))
    assert (old.episode_id, old.segment_index, old.segments_total, old.episode_key) == (None, 0, None, "e-s1")


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"segment_index": 2, "segments_total": 2}, "segment_index.*2 out of range \\[0, segments_total=2\\)"),
        ({"segment_index": 5000, "segments_total": None}, "segment_index.*5000 out of range"),
        ({"segment_index": -1, "segments_total": None, "summarises": None, "summary_start": None, "summary_end": None}, "out of range"),
        ({"segments_total": 3}, "only the last segment"),
        ({"turns": [Turn("user", 0, 3), Turn("assistant", 2, 5), Turn("tool", 5, 7), Turn("assistant", 7, 8)]}, "overlaps the turn ending at 3"),
        ({"loss_mask": np.array([0, 0, 0, 1, 1, 1, 0, 1], np.uint8)}, "loss mask set on tool output \\[5, 7\\)"),
        ({"loss_mask": np.array([0, 1, 0, 1, 1, 0, 0, 1], np.uint8)}, "set on the summary span \\[0, 3\\)"),
        ({"summary_end": 9}, "summary span \\[0, 9\\)"),
        ({"segment_index": 0, "segments_total": None}, "segment 0 starts the episode"),
        ({"episode_id": None}, "need an episode_id"),
    ],
)
def test_boundary_validation_names_the_reason(fields, reason):
    bad = segment(**fields)
    if "sampler_logprobs" not in fields and "loss_mask" in fields:
        bad.sampler_logprobs = np.where(bad.loss_mask == 1, -0.5, 0.0).astype(np.float32)
    with pytest.raises(SchemaValidationError, match=reason):
        bad.validate()


def test_the_wire_carries_turn_ends_only_so_an_overlap_there_is_an_end_before_its_start():
    bad = segment(turns=[Turn("user", 0, 3), Turn("assistant", 3, 5), Turn("tool", 5, 4), Turn("assistant", 4, 8)])
    with pytest.raises(InvalidRecord, match="turns\\[2\\]"):
        decode(encode(bad))
