"""Long-horizon episodes in the ETL: the rules for a segment joining its episode, and packing whole episodes.

An episode is one sample of a group (GRPO's o_i): its segments (one rollout per context, the later ones
starting from the model's summary of the one before) share its one reward, so its one advantage, and are
trained in one step. A rollout without an `episode_id` is an episode of one segment, keyed by its own id,
so everything here reduces to the per-rollout behaviour for plain rollouts. Pure functions, no state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ember.rollouts.batching import ScoredRollout, split_by_budget
from ember.rollouts.records import Reason
from ember.schemas import Rollout


def known_total(segments: Mapping[int, Rollout]) -> int | None:
    """How many segments the episode has, once its last segment (the one that says) arrived; 1 for a plain rollout."""
    for rollout in segments.values():
        if rollout.episode_id is None:
            return 1
        if rollout.segments_total is not None:
            return rollout.segments_total
    return None


def refusal(segments: Mapping[int, Rollout], new: Rollout) -> tuple[Reason, str] | None:
    """Why `new` cannot join the episode that already holds `segments` (by index), or None.

    DUPLICATE: the same rollout again, or its index again. SEGMENT_CONFLICT: a plain rollout and an episode
    share a key. SEGMENT_OUT_OF_RANGE (dead-lettered: the record contradicts its episode): an index at or past
    the episode's known segment count, or a second last segment, or a last segment that leaves an index held out."""
    if not segments:
        return None
    held = next(iter(segments.values()))
    if (held.episode_id is None) != (new.episode_id is None):
        return Reason.SEGMENT_CONFLICT, f"episode {new.episode_key!r} has both a plain rollout and segments"
    if new.episode_id is None or new.segment_index in segments or any(r.rollout_id == new.rollout_id for r in segments.values()):
        return Reason.DUPLICATE, f"segment {new.segment_index} of episode {new.episode_key!r} is already in"
    total = known_total(segments)
    if total is not None and (new.segment_index >= total or new.segments_total is not None):
        return Reason.SEGMENT_OUT_OF_RANGE, f"segment {new.segment_index} of episode {new.episode_key!r}, which has {total} segments"
    if new.segments_total is not None and max(segments) >= new.segments_total:
        return (
            Reason.SEGMENT_OUT_OF_RANGE,
            f"segments_total {new.segments_total} for episode {new.episode_key!r}, which already holds segment {max(segments)}",
        )
    return None


def episode_chunks(sequences: Sequence[ScoredRollout], budget: int) -> list[list[int]]:
    """`split_by_budget` over consecutive episodes (an episode's segments are consecutive), for a group over the
    token budget: every episode lies in one chunk, so in one training step. An episode alone over the budget
    never reaches here: the engine drops it at its decision (Reason.EPISODE_OVER_BUDGET)."""
    spans: list[list[int]] = []  # each episode's sequence indices
    for index, sequence in enumerate(sequences):
        if spans and sequences[spans[-1][0]].rollout.episode_key == sequence.rollout.episode_key:
            spans[-1].append(index)
        else:
            spans.append([index])
    tokens = [sum(sequences[i].rollout.num_tokens for i in span) for span in spans]
    return [[i for e in chunk for i in spans[e]] for chunk in split_by_budget(tokens, budget)]
