"""Long-horizon episodes through the pure ETL engine: one reward and one advantage per episode, every segment in
one batch or the whole episode in the ledger, whatever the interleaving, duplicates and crashes."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.rollouts.advantages import group_advantages
from ember.rollouts.batching import resolve_from_log
from ember.rollouts.engine import REWARDS, ROLLOUTS, ShardEngine
from ember.rollouts.simulate import synthetic_episode
from ember.schemas import Reward, Rollout
from tests.rollouts.helpers import TOPICS, VOCAB, Committed, Log, config, run

SCORES = [0.1, 0.9, 0.4, 0.7]


def episode(group: str, e: int, segments: int, tokens: int = 24, seed: int = 0) -> list[Rollout]:
    rng = np.random.default_rng(hash((group, e, seed)) % 2**32)
    return synthetic_episode(
        rng, episode_id=f"{group}-e{e}", segments=segments, num_tokens=tokens, group_id=group, prompt_id=group,
        prompt_tokens=6, layers=None, vocab_size=VOCAB, finish_reason="stop",
    )


def episode_reward(segments: list[Rollout], score: float) -> Reward:
    """One reward per episode, sent under its episode id."""
    return Reward(segments[0].episode_key, segments[0].group_id, "unit-tests", score, 0, {})


def advantages_by_rollout(batches) -> dict[str, float]:
    out = {}
    for batch in batches:
        for i, rid in enumerate(batch.rollout_ids):
            lo, hi = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
            out[rid] = float(batch.advantages[lo:hi][batch.loss_mask[lo:hi] == 1][0])
    return out


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_group_of_episodes_is_one_batch_with_each_episodes_advantage_on_every_segment(estimator):
    log = Log()
    episodes = [episode("g", e, segments) for e, segments in enumerate([1, 2, 3, 4])]
    for segment in sorted((s for ep in episodes for s in ep), key=lambda s: (s.segment_index, s.rollout_id), reverse=True):
        log.add(segment, 0)  # last segments first: an episode is complete only once all of its segments are in
    for ep, score in zip(episodes, SCORES):
        log.add(episode_reward(ep, score), 0)
    done = run(config(advantages={"estimator": estimator}), log.messages)
    (batch,) = done.batches
    batch.validate()
    assert done.reasons() == {}
    expected = group_advantages(np.array(SCORES), estimator)
    found = advantages_by_rollout(done.batches)
    for ep, advantage in zip(episodes, expected):
        assert [found[s.rollout_id] for s in ep] == pytest.approx([advantage] * len(ep), rel=1e-5)
    by_id = {s.rollout_id: s for ep in episodes for s in ep}
    order = [(by_id[r].episode_key, by_id[r].segment_index) for r in batch.rollout_ids]
    assert order == sorted(order, key=lambda k: ([e for e, _ in order].index(k[0]), k[1])), "an episode's segments in order, together"
    assert batch.episode_ids == [e for e, _ in order]
    assert done.marks == {ROLLOUTS: 10, REWARDS: 4}


def test_a_missing_segment_or_reward_at_the_deadline_drops_the_whole_episode_with_its_reason():
    log = Log()
    episodes = [episode("g", e, 3) for e in range(4)]
    for e, ep in enumerate(episodes):
        for segment in ep:
            if not (e == 0 and segment.segment_index == 1):  # episode 0 never sends its middle segment
                log.add(segment, 0)
        if e != 1:  # episode 1's reward never comes
            log.add(episode_reward(ep, SCORES[e]), 0)
    cfg = config(groups={"quorum": 2})
    assert run(cfg, log.messages, end_ms=9_999).batches == [], "incomplete episodes wait for the group timeout"
    engine = ShardEngine(cfg, 0, TOPICS)
    for m in log.messages:
        engine.ingest(m)
    assert engine.waiting_on() == (10_000, "group g, 1 of its episodes missing segments (groups.timeout_s)")
    done = run(cfg, log.messages, end_ms=10_000)
    assert sorted(done.batched_ids) == sorted(s.rollout_id for ep in episodes[2:] for s in ep)
    dropped = {o.rollout_id: (o.reason, o.detail.get("episode_id")) for o in done.outcomes if o.kind == "rollout_dropped"}
    assert dropped == {
        **{s.rollout_id: ("episode_incomplete", "g-e0") for s in episodes[0] if s.segment_index != 1},
        **{s.rollout_id: ("unrewarded", "g-e1") for s in episodes[1]},
    }
    incomplete = next(o for o in done.outcomes if o.reason == "episode_incomplete")
    assert incomplete.detail["segments"] == [0, 2] and incomplete.detail["segments_total"] == 3
    assert done.marks == {ROLLOUTS: 11, REWARDS: 3}


def test_an_episode_over_the_token_budget_is_dropped_whole_and_a_group_over_it_splits_between_episodes():
    """An episode is never split across training steps: one over batches.token_budget is dropped at its decision
    (episode_over_budget, with its tokens); a group over the budget is cut between episodes."""
    log = Log()
    episodes = [episode("g", 0, 4, tokens=40), episode("g", 1, 2, tokens=40), episode("g", 2, 2, tokens=40), episode("g", 3, 1, tokens=20)]
    for ep, score in zip(episodes, SCORES):
        for segment in ep:
            log.add(segment, 0)
        log.add(episode_reward(ep, score), 0)
    done = run(config(groups={"quorum": 2}, filters={"max_tokens": 100}, batches={"token_budget": 100}), log.messages)
    assert {o.reason for o in done.outcomes if o.kind == "rollout_dropped"} == {"episode_over_budget"}
    assert done.reasons() == {"episode_over_budget": 4}
    assert next(o for o in done.outcomes if o.kind == "rollout_dropped").detail["tokens"] == 160
    assert [list(b.rollout_ids) for b in done.batches] == [
        [s.rollout_id for s in episodes[1]], [s.rollout_id for s in episodes[2]] + [episodes[3][0].rollout_id]
    ]
    assert len({b.step for b in done.batches}) == 2


def test_a_segment_past_its_episodes_end_is_dead_lettered_and_a_repeat_is_a_duplicate():
    episodes = [episode("g", e, 2) for e in range(4)]
    first = episodes[0]
    stray = dataclasses.replace(first[1], rollout_id="g-e0-s2", segment_index=2, segments_total=None, summarises="g-e0-s1")

    def fed(extra: list[Rollout]) -> Committed:
        log = Log()
        for ep, score in zip(episodes, SCORES):
            for segment in ep + (extra if ep is first else []):
                log.add(segment, 0)
            log.add(episode_reward(ep, score), 0)
        return run(config(groups={"quorum": 2}), log.messages, end_ms=10_000)

    after_the_end = fed([stray, first[0]])
    (letter,) = [o for o in after_the_end.outcomes if o.kind == "dead_letter"]
    assert (letter.reason, letter.offset) == ("segment_out_of_range", 2)
    assert "segment 2 of episode 'g-e0', which has 2 segments" in letter.detail["error"]
    assert after_the_end.reasons() == {"duplicate": 1}
    assert sorted(after_the_end.batched_ids) == sorted(s.rollout_id for ep in episodes for s in ep)

    # the stray index first: the last segment, whose count leaves it out, is the one that contradicts the episode
    log = Log()
    for segment in [first[0], stray, first[1]]:
        log.add(segment, 0)
    for ep, score in zip(episodes, SCORES):
        for segment in ep if ep is not first else []:
            log.add(segment, 0)
        log.add(episode_reward(ep, score), 0)
    before_the_end = run(config(groups={"quorum": 2}), log.messages, end_ms=10_000)
    (letter,) = [o for o in before_the_end.outcomes if o.kind == "dead_letter"]
    assert (letter.reason, letter.offset) == ("segment_out_of_range", 2)
    assert before_the_end.reasons() == {"episode_incomplete": 2}


def _workload(seed: int):
    """Three groups of four episodes of 1-4 segments; some segments and rewards missing, some sent twice."""
    rng = np.random.default_rng(seed)
    events, totals = [], {}
    for g in range(3):
        start = g * 500
        for e in range(4):
            ep = episode(f"g{g}", e, int(rng.integers(1, 5)), tokens=int(rng.integers(16, 40)), seed=seed)
            totals[ep[0].episode_key] = len(ep)
            for segment in ep:
                if rng.random() < 0.08:
                    continue
                at = start + int(rng.integers(0, 2000))
                events.append((at, segment))
                if rng.random() < 0.1:
                    events.append((at + int(rng.integers(0, 4000)), segment))
            if rng.random() < 0.1:
                continue
            at = start + int(rng.integers(0, 3000))
            events.append((at, episode_reward(ep, float(rng.random()))))
            if rng.random() < 0.1:
                events.append((at + int(rng.integers(0, 9000)), episode_reward(ep, 0.5)))
    events.sort(key=lambda e: e[0])
    log = Log()
    for at, record in events:
        log.add(record, at)
    return log.messages, totals


CRASH_CONFIG = config(groups={"quorum": 2}, filters={"max_tokens": 64}, batches={"token_budget": 128, "min_fill": 0.5, "max_wait_s": 1})


def _drained(engine: ShardEngine, done: Committed, end: int, messages) -> Committed:
    """Time runs past every deadline; the batches are resolved from the log as the trainer's reader does."""
    engine.advance(end, None)
    engine.advance(end + 1000, None)
    assert engine.pending_count() == 0
    done.commit(engine)
    values = {(m.topic, m.partition, m.offset): m.value for m in messages}
    done.batches = [resolve_from_log(b, values) for b in done.batches]
    return done


@settings(max_examples=20, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.integers(0, 10_000), st.lists(st.integers(0, 200), min_size=1, max_size=4), st.data())
def test_any_interleaving_duplicates_and_crashes_batch_each_episode_whole_once_or_drop_it_whole(seed, crash_points, data):
    """Commit and crash at random points, restore from the last commit, re-read from the committed offsets: every
    decided episode's segments are all in one batch with one advantage, or all in the ledger as dropped; the
    committed output equals an uninterrupted run's, and every segment message is batched or in the ledger once."""
    messages, totals = _workload(seed)
    end = messages[-1].timestamp_ms + 60_000
    uninterrupted = ShardEngine(CRASH_CONFIG, 0, TOPICS)
    for m in messages:
        uninterrupted.ingest(m)
    expected = _drained(uninterrupted, Committed(), end, messages)
    engine, durable = ShardEngine(CRASH_CONFIG, 0, TOPICS), Committed()
    crashes = sorted(c % (len(messages) + 1) for c in crash_points)
    position = 0
    while True:
        crash_at = crashes.pop(0) if crashes else None
        while position < len(messages) and (crash_at is None or position < crash_at):
            engine.ingest(messages[position])
            position += 1
            if data.draw(st.integers(0, 3), label="commit") == 0:
                durable.commit(engine)
        if crash_at is None:
            break
        marks = durable.marks
        engine = ShardEngine(CRASH_CONFIG, 0, TOPICS, snapshot=durable.snapshot, committed=dict(marks), closed=durable.closed)
        for m in messages[:position]:
            if m.offset >= marks.get(ROLLOUTS if m.topic == TOPICS.rollouts else REWARDS, 0):
                engine.ingest(m)
    _drained(engine, durable, end, messages)

    assert sorted(b.batch_id for b in durable.batches) == sorted(b.batch_id for b in expected.batches)
    key = lambda o: (o.kind, o.reason, o.topic, o.offset)  # noqa: E731
    assert sorted(map(key, (o for o in durable.outcomes if o.kind != "batch"))) == sorted(
        map(key, (o for o in expected.outcomes if o.kind != "batch"))
    )
    batched: dict[str, list[tuple[str, int, float]]] = defaultdict(list)
    advantages = advantages_by_rollout(durable.batches)
    for batch in durable.batches:
        for rid, episode_id in zip(batch.rollout_ids, batch.episode_ids):
            batched[episode_id].append((batch.batch_id, int(rid.rsplit("-s", 1)[1]), advantages[rid]))
    for episode_id, segments in batched.items():
        assert len({b for b, _, _ in segments}) == 1, f"episode {episode_id} split across batches"
        assert sorted(i for _, i, _ in segments) == list(range(totals[episode_id])), f"episode {episode_id}: a segment missing or twice"
        assert len({a for _, _, a in segments}) == 1, f"episode {episode_id}: segments with different advantages"
    dropped = defaultdict(set)
    for o in durable.outcomes:
        if o.kind == "rollout_dropped" and o.reason not in ("duplicate", "late_rollout"):
            dropped[o.rollout_id.rsplit("-s", 1)[0]].add(o.reason)
    assert not set(dropped) & set(batched), "an episode both batched and dropped"
    assert all(len(reasons) == 1 for reasons in dropped.values()), "an episode dropped with several reasons"
    total = sum(1 for m in messages if m.topic == TOPICS.rollouts)
    accounted = sum(len(v) for v in batched.values()) + sum(1 for o in durable.outcomes if o.kind in ("rollout_dropped", "dead_letter") and o.topic == TOPICS.rollouts)
    assert accounted == total


def test_tail_and_stats_show_episodes():
    """`rollouts tail` places a segment in its episode; `stats` counts episodes batched and dropped whole (once each,
    not once per segment), from the ledger the engine writes."""
    from rich.console import Console

    from ember.rollouts import tail
    from ember.rollouts.stats import EtlStats, _add, stats_tables

    log = Log()
    episodes = [episode("g", e, 3) for e in range(4)]
    for e, ep in enumerate(episodes):
        for segment in ep[: 2 if e == 0 else 3]:
            log.add(segment, 0)
        log.add(episode_reward(ep, SCORES[e]), 0)
    done = run(config(groups={"quorum": 2}), log.messages, end_ms=10_000)
    stats = EtlStats(window_s=0)
    for outcome in done.outcomes:
        _add(stats, outcome)
    console = Console(record=True, width=200)
    for table in stats_tables(stats):
        console.print(table)
    text = console.export_text()
    assert "3 batched whole, 1 segmented dropped whole" in text
    (row,) = [line for line in text.splitlines() if "episode: episode_incomplete" in line]
    assert row.split("│")[2].strip() == "1", row

    second = episodes[1][1]
    assert "episode g-e1 segment 2/? from summary [0, 6) 2 tool turns" in tail._rollout(second)
    assert "segment 3/3" in tail._rollout(episodes[1][2])
    (batch,) = done.batches
    assert "9 rollouts (3 episodes)" in tail._batch(batch)
    dropped = next(o for o in done.outcomes if o.kind == "rollout_dropped")
    assert "of episode g-e0" in tail._outcome(dropped)
