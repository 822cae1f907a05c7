"""The ETL core without Kafka: validation, filters, reward joins, groups, batches and crash recovery."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.rollouts.advantages import grpo_advantages, rloo_advantages
from ember.rollouts.engine import REWARDS, ROLLOUTS, InputMessage, ShardEngine, StateMismatch
from ember.configs import EtlConfigError
from ember.rollouts.config import parse_config
from ember.rollouts.records import ShardSnapshot
from ember.schemas import Reward, encode
from tests.rollouts.helpers import TOPICS, Committed, Log, config, reward, rollout, run

SCORES = [0.1, 0.9, 0.4, 0.7]


def full_group(log: Log, group: str = "g", at_ms: int = 0, scores=SCORES, **rollout_kwargs):
    rollouts = [rollout(group, i, **rollout_kwargs) for i in range(len(scores))]
    for r in rollouts:
        log.add(r, at_ms)
    for r, s in zip(rollouts, scores):
        log.add(reward(r, s), at_ms)
    return rollouts


def sequence_advantages(batch) -> dict[str, float]:
    out = {}
    for i, rid in enumerate(batch.rollout_ids):
        lo, hi = batch.cu_seqlens[i], batch.cu_seqlens[i + 1]
        trained = batch.advantages[lo:hi][batch.loss_mask[lo:hi] == 1]
        out[rid] = float(trained[0])
    return out


def test_complete_group_becomes_one_batch_with_grpo_advantages():
    log = Log()
    rollouts = full_group(log)
    done = run(config(), log.messages)
    (batch,) = done.batches
    batch.validate()
    assert sorted(batch.rollout_ids) == sorted(r.rollout_id for r in rollouts)
    expected = dict(zip([r.rollout_id for r in rollouts], grpo_advantages(SCORES)))
    for rid, adv in sequence_advantages(batch).items():
        assert adv == pytest.approx(expected[rid], rel=1e-5)
    assert [o.kind for o in done.outcomes] == ["batch"]
    assert done.marks == {ROLLOUTS: 4, REWARDS: 4}
    assert batch.advantage_estimator == "grpo", "the trainer checks its loss normaliser against this stamp"


def test_rloo_estimator_is_applied():
    log = Log()
    rollouts = full_group(log)
    (batch,) = run(config(advantages={"estimator": "rloo"}), log.messages).batches
    assert batch.advantage_estimator == "rloo"
    expected = dict(zip([r.rollout_id for r in rollouts], rloo_advantages(SCORES)))
    for rid, adv in sequence_advantages(batch).items():
        assert adv == pytest.approx(expected[rid], rel=1e-5)


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.permutations(list(range(10))))
def test_any_arrival_order_with_duplicates_gives_the_same_batch(order):
    rollouts = [rollout("g", i) for i in range(4)]
    records = rollouts + [reward(r, s) for r, s in zip(rollouts, SCORES)]
    records += [rollouts[1], reward(rollouts[2], 0.4)]
    log = Log()
    for i in order:
        log.add(records[i], 0)
    done = run(config(), log.messages)
    (batch,) = done.batches
    assert sorted(batch.rollout_ids) == [f"g-{i}" for i in range(4)]
    expected = dict(zip([r.rollout_id for r in rollouts], grpo_advantages(SCORES)))
    assert sequence_advantages(batch) == pytest.approx(expected, rel=1e-5)
    assert done.reasons() == {"duplicate": 1}
    assert done.reasons("reward_dropped") == {"duplicate_reward": 1}, "a repeat is a duplicate, before or after the decision"


def test_missing_reward_waits_then_quorum_decides():
    log = Log()
    rollouts = [rollout("g", i) for i in range(4)]
    for r in rollouts:
        log.add(r, 0)
    for r, s in zip(rollouts[:3], SCORES):
        log.add(reward(r, s), 1000)
    waiting = run(config(groups={"quorum": 3}), log.messages, end_ms=4_999)
    assert waiting.batches == [] and waiting.marks[ROLLOUTS] == 0, "the open group must hold back the commit"
    decided = run(config(groups={"quorum": 3}), log.messages, end_ms=5_000)
    (batch,) = decided.batches
    assert sorted(batch.rollout_ids) == ["g-0", "g-1", "g-2"]
    assert decided.reasons() == {"unrewarded": 1}
    assert decided.marks == {ROLLOUTS: 4, REWARDS: 3}
    below = run(config(groups={"quorum": 4}), log.messages, end_ms=5_000)
    assert below.batches == [] and below.reasons() == {"unrewarded": 1, "below_quorum": 3}


def test_group_timeout_cuts_a_group_missing_samples():
    log = Log()
    rollouts = [rollout("g", i) for i in range(3)]
    for r, s in zip(rollouts, SCORES):
        log.add(r, 0)
        log.add(reward(r, s), 0)
    assert run(config(groups={"quorum": 2}), log.messages, end_ms=9_999).batches == []
    (batch,) = run(config(groups={"quorum": 2}), log.messages, end_ms=10_000).batches
    assert len(batch.rollout_ids) == 3


def test_reward_before_rollout_joins():
    log = Log()
    rollouts = [rollout("g", i) for i in range(4)]
    for r, s in zip(rollouts, SCORES):
        log.add(reward(r, s), 0)
    for r in rollouts:
        log.add(r, 100)
    assert len(run(config(), log.messages).batched_ids) == 4


def test_late_rewards_and_rollouts_after_the_group_was_emitted():
    """After the decision a second copy of a reward the group used (a grader that graded again, a mirror that copied
    the record twice) is a duplicate, as a second copy of a rollout is; only a reward the group never saw is late."""
    log = Log()
    rollouts = full_group(log)
    log.add(reward(rollouts[0], 0.3), 50)
    log.add(reward(rollouts[1], 0.3, grader="judge"), 55)
    log.add(rollouts[2], 60)
    log.add(rollout("g", 99), 70)
    done = run(config(), log.messages)
    assert len(done.batched_ids) == 4
    assert done.reasons("reward_dropped") == {"duplicate_reward": 1, "late_reward": 1}
    assert [o.rollout_id for o in done.outcomes if o.reason == "late_reward"] == [rollouts[1].rollout_id]
    assert done.reasons() == {"duplicate": 1, "late_rollout": 1}
    assert done.marks == {ROLLOUTS: 6, REWARDS: 6}


def test_a_reward_stamped_at_its_deadline_is_late():
    log = Log()
    rollouts = [rollout("g", i) for i in range(4)]
    for r in rollouts:
        log.add(r, 0)
    for r, s in zip(rollouts[:3], SCORES):
        log.add(reward(r, s), 100)
    log.add(reward(rollouts[3], 0.5), 5_000)  # rewards.timeout_s 5: in time means stamped before 5_000
    done = run(config(groups={"quorum": 3}), log.messages, end_ms=9_500)
    assert done.reasons("reward_dropped") == {"late_reward": 1}
    assert done.reasons() == {"unrewarded": 1}
    assert len(done.batched_ids) == 3


def test_zero_variance_group_is_dropped_and_counted():
    log = Log()
    full_group(log, scores=[1.0, 1.0, 1.0, 1.0])
    done = run(config(), log.messages)
    assert done.batches == [] and done.reasons() == {"zero_variance": 4}
    kept = run(config(advantages={"drop_zero_variance": False}), log.messages)
    assert len(kept.batched_ids) == 4


def test_stale_rollouts_are_dropped_with_their_lag():
    log = Log()
    rollouts = [rollout("g", i, policy_version=v) for i, v in enumerate([9, 9, 2, 9])]
    for r, s in zip(rollouts, SCORES):
        log.add(r, 0)
        log.add(reward(r, s), 0)
    done = run(config(filters={"max_policy_lag": 4}, groups={"quorum": 3}), log.messages, policy=10)
    (stale,) = [o for o in done.outcomes if o.reason == "stale"]
    assert stale.rollout_id == "g-2" and stale.detail["lag_versions"] == 8 and stale.tokens == 32
    assert sorted(done.batched_ids) == ["g-0", "g-1", "g-3"]


def test_filters_and_truncation_policies():
    log = Log()
    group = [
        rollout("g", 0),
        rollout("g", 1, finish_reason="tool_error"),
        rollout("g", 2, finish_reason="length"),
        rollout("g", 3, tokens=64),
    ]
    assert group[2].truncated
    empty = rollout("h", 0)
    empty.loss_mask = np.zeros_like(empty.loss_mask)
    for r, s in zip(group, SCORES):
        log.add(r, 0)
        log.add(reward(r, s), 0)
    log.add(empty, 0)
    cfg = config(
        groups={"quorum": 1},
        filters={"max_tokens": 48, "truncated": "drop"},
        advantages={"drop_zero_variance": False},
    )
    done = run(cfg, log.messages, end_ms=100_000)
    assert done.reasons() == {"finish_tool_error": 1, "truncated": 1, "overlong": 1, "empty": 1}
    assert done.batched_ids == ["g-0"]
    penalize = config(
        groups={"quorum": 2}, filters={"truncated": "penalize", "truncated_penalty": -5.0, "drop_finish_reasons": []}
    )
    (batch,) = run(penalize, log.messages[:8]).batches
    advantages = sequence_advantages(batch)
    assert len(advantages) == 4 and min(advantages, key=advantages.get) == "g-2"


def test_dead_letters_name_the_problem_and_do_not_stop_the_shard():
    log = Log()
    r = rollout("g", 0)
    log.add(r, 0, raw=encode(r)[:-8])
    log.add(r, 0, raw=encode(reward(r, 1.0)))
    log.add(r, 0, key=b"other-group")
    log.add(r, 0, raw=b"x" * 8192)
    cfg = config(dead_letter={"max_message_bytes": 4096}, filters={"max_tokens": 256}, batches={"token_budget": 256})
    rollouts = full_group(log, group="ok")
    done = run(cfg, log.messages)
    dead = [o for o in done.outcomes if o.kind == "dead_letter"]
    assert [o.reason for o in dead] == ["malformed", "wrong_topic", "key_mismatch", "oversized"]
    details = [o.detail["error"] for o in dead]
    assert "truncated" in details[0]
    assert details[1] == "Reward on the rollouts topic"
    assert "is not the group_id" in details[2]
    assert details[3].startswith("8192 bytes > dead_letter.max_message_bytes 4096")
    assert [(o.topic, o.partition, o.offset) for o in done.outcomes if o.kind == "dead_letter"] == [
        ("t.rollouts", 0, i) for i in range(4)
    ]
    assert sorted(done.batched_ids) == sorted(x.rollout_id for x in rollouts)


def test_graders_weights_and_incomplete_rewards():
    cfg = config(rewards={"graders": ["tests", "judge"], "weights": {"passed": 1.0, "style": 0.5}}, groups={"quorum": 2})
    log = Log()
    rollouts = [rollout("g", i) for i in range(4)]
    for r in rollouts:
        log.add(r, 0)
    for i, r in enumerate(rollouts[:3]):
        log.add(reward(r, 0.0, grader="tests", passed=float(i % 2)), 0)
        log.add(reward(r, 0.0, grader="judge", style=0.2 * i), 0)
    log.add(reward(rollouts[3], 0.0, grader="tests", passed=1.0), 0)
    log.add(reward(rollouts[3], 0.0, grader="judge"), 0)
    log.add(reward(rollouts[0], 0.0, grader="vibes"), 0)
    done = run(cfg, log.messages)
    assert done.reasons() == {"reward_incomplete": 1}
    assert done.reasons("reward_dropped") == {"unknown_grader": 1}
    (batch,) = done.batches
    combined = [0.0, 1.0 + 0.1, 0.2]
    expected = dict(zip(["g-0", "g-1", "g-2"], grpo_advantages(combined)))
    assert sequence_advantages(batch) == pytest.approx(expected, rel=1e-5)


def test_one_reward_per_grader_a_repeat_is_dropped_and_a_shared_component_name_is_ambiguous():
    """Two graders per rollout: each one's first reward counts, a second from the same grader (a grader that
    crashed before its commit and graded again with another score) is dropped as duplicate_reward, never summed;
    a component name both graders give is weighted by its qualified name, and the bare name is refused."""
    log = Log()
    rollouts = [rollout("g", i) for i in range(4)]
    for r in rollouts:
        log.add(r, 0)
    for i, r in enumerate(rollouts):
        log.add(reward(r, float(i), grader="tests", value=float(i)), 0)
        log.add(reward(r, 0.5, grader="judge", value=0.5 * i), 0)
        if i == 0:  # while the group is still open: after its decision a repeat is late_reward
            log.add(reward(r, 100.0, grader="tests", value=100.0), 0)
    graders = {"graders": ["tests", "judge"]}
    summed = run(config(rewards=graders), log.messages)
    assert summed.reasons("reward_dropped") == {"duplicate_reward": 1}
    (batch,) = summed.batches
    expected = dict(zip([r.rollout_id for r in rollouts], grpo_advantages([i + 0.5 for i in range(4)])))
    assert sequence_advantages(batch) == pytest.approx(expected, rel=1e-5)
    qualified = run(config(rewards={**graders, "weights": {"tests.value": 1.0, "judge.value": 2.0}}), log.messages)
    (batch,) = qualified.batches
    expected = dict(zip([r.rollout_id for r in rollouts], grpo_advantages([i + 2 * 0.5 * i for i in range(4)])))
    assert sequence_advantages(batch) == pytest.approx(expected, rel=1e-5)
    ambiguous = run(config(rewards={**graders, "weights": {"value": 1.0}}), log.messages)
    assert not ambiguous.batches and ambiguous.reasons() == {"reward_incomplete": 4}
    detail = next(o.detail for o in ambiguous.outcomes if o.reason == "reward_incomplete")
    assert "given by graders ['judge', 'tests']" in detail["error"] and "'tests.value'" in detail["error"]


def test_a_partial_grader_set_at_the_deadline_is_unrewarded_and_the_group_goes_on_at_quorum():
    log = Log()
    rollouts = [rollout("g", i) for i in range(4)]
    for r in rollouts:
        log.add(r, 0)
    for i, r in enumerate(rollouts):
        log.add(reward(r, float(i), grader="tests"), 0)
        if i < 3:
            log.add(reward(r, 0.0, grader="judge"), 0)
    done = run(config(rewards={"graders": ["tests", "judge"], "timeout_s": 5}, groups={"quorum": 3}), log.messages, end_ms=20_000)
    (batch,) = done.batches
    assert sorted(batch.rollout_ids) == ["g-0", "g-1", "g-2"]
    (unrewarded,) = [o for o in done.outcomes if o.reason == "unrewarded"]
    assert unrewarded.rollout_id == "g-3" and unrewarded.detail["graders"] == ["tests"]


@pytest.mark.parametrize("verdict", ["malformed", "unavailable", "sandbox_error"])
def test_a_reward_that_holds_no_judgement_drops_its_rollout_at_once_instead_of_scoring_it(verdict):
    """A judge that could not parse its answer, an endpoint that never answered, a sandbox that would not start: the
    grader reports it (so nobody waits for a deadline), and the ETL drops that rollout as `ungraded`, never training
    on the placeholder score. Judgements of a misbehaving completion (timeout, memory, crashed) are scores."""
    log = Log()
    rollouts = [rollout("g", i) for i in range(4)]
    for r in rollouts:
        log.add(r, 0)
    for i, r in enumerate(rollouts):
        log.add(Reward(r.rollout_id, r.group_id, "tests", float(i), 0, verdict="timeout" if i == 0 else "passed"), 0)
        log.add(Reward(r.rollout_id, r.group_id, "judge", 0.0, 0, verdict=verdict if i == 3 else "scored"), 0)
    done = run(config(rewards={"graders": ["tests", "judge"], "timeout_s": 3600}, groups={"quorum": 3}), log.messages, end_ms=1_000)
    (batch,) = done.batches
    assert sorted(batch.rollout_ids) == ["g-0", "g-1", "g-2"], "decided at once, not at the 3600 s deadline"
    (ungraded,) = [o for o in done.outcomes if o.reason == "ungraded"]
    assert ungraded.rollout_id == "g-3" and ungraded.detail["verdicts"] == {"judge": verdict}


def test_orphan_rewards_and_group_overflow():
    log = Log()
    log.add(reward(rollout("never", 0), 1.0), 0)
    rollouts = full_group(log)
    log.add(rollout("g", 7), 0)
    done = run(config(), log.messages, end_ms=20_000)
    assert done.reasons("reward_dropped") == {"orphan_reward": 1}
    assert done.reasons() == {"late_rollout": 1}
    assert len(done.batched_ids) == len(rollouts)
    log2 = Log()
    for i in range(5):
        log2.add(rollout("big", i), 0)
    assert run(config(), log2.messages).reasons() == {"group_overflow": 1}


def test_restored_engine_skips_done_work_and_rebuilds_pending_groups():
    log = Log()
    pending = [rollout("slow", i) for i in range(4)]
    log.add(pending[0], 0)
    full_group(log, group="fast")
    for r in pending[1:]:
        log.add(r, 0)
    cfg = config()
    first = ShardEngine(cfg, 0, TOPICS)
    done = Committed()
    for m in log.messages:
        first.ingest(m)
    done.commit(first)
    assert len(done.batched_ids) == 4 and done.marks == {ROLLOUTS: 0, REWARDS: 4}
    snapshot = ShardSnapshot.decode(done.snapshot.encode())
    second = ShardEngine(cfg, 0, TOPICS, snapshot=snapshot, committed=done.marks, closed=done.closed)
    for m in [m for m in log.messages if m.offset >= done.marks[ROLLOUTS if m.topic == TOPICS.rollouts else REWARDS]]:
        second.ingest(m)
    assert second.pending_count() == 4 and set(second.groups) == {"slow"}
    for r, s in zip(pending, SCORES):
        second.ingest(log.add(reward(r, s), 10))
    second.advance(10, None)
    after = Committed()
    after.commit(second)
    assert sorted(after.batched_ids) == sorted(r.rollout_id for r in pending)
    with pytest.raises(StateMismatch, match="reset the ETL group's offsets and state topic together"):
        ShardEngine(cfg, 0, TOPICS, snapshot=snapshot, committed={ROLLOUTS: 9, REWARDS: 4})


def _workload(draw_seed: int) -> list:
    rng = np.random.default_rng(draw_seed)
    log = Log()
    events = []
    for g in range(6):
        start = g * 400
        for i in range(4):
            r = rollout(f"g{g}", i, tokens=int(rng.integers(16, 48)), seed=draw_seed)
            events.append((start + int(rng.integers(0, 300)), r))
            if rng.random() < 0.1:
                events.append((start + int(rng.integers(300, 600)), r))
            if rng.random() > 0.15:
                score = float(rng.random())
                events.append((start + int(rng.integers(0, 3000)), reward(r, score)))
                if rng.random() < 0.1:
                    events.append((start + int(rng.integers(0, 9000)), reward(r, score)))
        if rng.random() < 0.3:
            events.append((start + 50, reward(rollout(f"orphan{g}", 0), 1.0)))
    events.sort(key=lambda e: e[0])
    for at, record in events:
        log.add(record, at)
    return log.messages


def _uninterrupted(cfg, messages, end):
    engine = ShardEngine(cfg, 0, TOPICS)
    done = Committed()
    for m in messages:
        engine.ingest(m)
    engine.advance(end, None)
    engine.advance(end + 1000, None)
    assert engine.pending_count() == 0
    done.commit(engine)
    return done


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.integers(0, 10_000), st.lists(st.integers(0, 200), min_size=1, max_size=4), st.data())
def test_crashes_at_any_point_lose_and_double_nothing(seed, crash_points, data):
    """Commit at random points, crash at random points (losing uncommitted work), restore from the
    last commit and re-read from the committed offsets: the committed output equals an uninterrupted run."""
    cfg = config(groups={"quorum": 2}, filters={"max_tokens": 256}, batches={"token_budget": 256, "min_fill": 0.5, "max_wait_s": 1})
    messages = _workload(seed)
    end = messages[-1].timestamp_ms + 60_000
    expected = _uninterrupted(cfg, messages, end)

    durable = Committed()
    engine = ShardEngine(cfg, 0, TOPICS)
    crashes = sorted(c % (len(messages) + 1) for c in crash_points)
    position = 0
    while True:
        crash_at = crashes.pop(0) if crashes else None
        while position < len(messages) and (crash_at is None or position < crash_at):
            m = messages[position]
            position += 1
            engine.ingest(m)
            if data.draw(st.integers(0, 3), label="commit") == 0:
                durable.commit(engine)
        if crash_at is None:
            break
        engine = ShardEngine(cfg, 0, TOPICS, snapshot=durable.snapshot, committed=dict(durable.marks), closed=durable.closed)
        marks = durable.marks
        replay_from = [i for i, m in enumerate(messages) if m.offset >= marks.get(ROLLOUTS if m.topic == TOPICS.rollouts else REWARDS, 0)]
        redo = [messages[i] for i in replay_from if i < position]
        for m in redo:
            engine.ingest(m)
    engine.advance(end, None)
    engine.advance(end + 1000, None)
    assert engine.pending_count() == 0
    durable.commit(engine)

    assert len(durable.batched_ids) == len(set(durable.batched_ids)), "a rollout was batched twice"
    assert sorted(durable.batched_ids) == sorted(expected.batched_ids)
    key = lambda o: (o.kind, o.reason, o.topic, o.offset)  # noqa: E731
    assert sorted(map(key, (o for o in durable.outcomes if o.kind != "batch"))) == sorted(
        map(key, (o for o in expected.outcomes if o.kind != "batch"))
    )
    assert sorted(b.batch_id for b in durable.batches) == sorted(b.batch_id for b in expected.batches)
    total = sum(1 for m in messages if m.topic == TOPICS.rollouts)
    dropped = sum(1 for o in durable.outcomes if o.kind == "rollout_dropped")
    assert len(durable.batched_ids) + dropped == total


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.integers(0, 10_000), st.data())
def test_decisions_do_not_depend_on_how_often_time_is_advanced(seed, data):
    """The live ETL advances log time whenever its clock moves (after each poll, while idle), the replay only at
    message timestamps: fed the same messages in log order, both commit the same ledger and the same batches,
    down to the log time each decision records."""
    cfg = config(groups={"quorum": 2}, filters={"max_tokens": 256}, batches={"token_budget": 256, "min_fill": 0.5, "max_wait_s": 1})
    messages = _workload(seed)

    def fed(extra_advances: bool) -> Committed:
        engine, done = ShardEngine(cfg, 0, TOPICS), Committed()
        for m in messages:
            if extra_advances:
                for _ in range(data.draw(st.integers(0, 2), label="advances")):
                    engine.advance(data.draw(st.integers(engine.now_ms, max(engine.now_ms, m.timestamp_ms)), label="to"), None)
            engine.ingest(m)
        engine.finish(None)
        done.commit(engine)
        return done

    replayed, live = fed(False), fed(True)
    assert [o.encode() for o in live.outcomes] == [o.encode() for o in replayed.outcomes]
    assert [encode(b) for b in live.batches] == [encode(b) for b in replayed.batches]


def test_waiting_on_names_the_next_decision_only_time_brings_and_the_setting_behind_it():
    """What `--until-idle` reports while it waits: the orphan reward's wait, a short group's timeout."""
    from tests.rollouts.helpers import Log, config, reward, rollout

    engine = ShardEngine(config(), 0, TOPICS)
    assert engine.waiting_on() is None
    log = Log()
    orphan = rollout("g-orphan", 0)  # its rollout never arrives (say it was dead-lettered): only the reward does
    engine.ingest(log.add(reward(orphan, 1.0), 1_000))
    at_ms, what = engine.waiting_on()
    assert at_ms == 1_000 + 20_000 and "rewards of group g-orphan whose rollouts never came (rewards.orphan_timeout_s)" == what
    engine.ingest(log.add(rollout("g-short", 0), 2_000))
    assert engine.waiting_on() == (2_000 + 10_000, "group g-short, 1 of its 4 rollouts in (groups.timeout_s)")
    full = [rollout("g-full", i) for i in range(4)]
    for i, r in enumerate(full):
        engine.ingest(log.add(r, 3_000 + i))
    for r in full[:3]:
        engine.ingest(log.add(reward(r, 1.0), 3_100))
    assert engine.waiting_on() == (3_003 + 5_000, "the rewards of group g-full (rewards.timeout_s)")
    engine.advance(30_000, None)
    assert engine.waiting_on() is None, "everything decided by log time 30 s"


REGIONS = {"us": "127.0.0.1:1", "eu": "127.0.0.1:2"}


def regional(topic: str, offset: int, at_ms: int, record) -> InputMessage:
    return InputMessage(topic, 0, offset, at_ms, record.group_id.encode(), encode(record))


def test_a_rollout_sampled_in_one_region_joins_its_reward_graded_in_another():
    """Sources are keyed apart: offsets, marks and batch references per mirrored topic, and late rewards name theirs."""
    cfg = config(kafka={"regions": REGIONS}, groups={"size": 2, "timeout_s": 10})
    rs = [rollout("g", i) for i in range(2)]
    messages = [regional("us.t.rollouts", i, 1_000 + i, r) for i, r in enumerate(rs)]
    messages += [regional("eu.t.rewards", i, 2_000 + i, reward(r, float(i))) for i, r in enumerate(rs)]
    messages.append(regional("eu.t.rewards", 2, 9_000, reward(rs[0], 5.0, grader="late")))
    engine = ShardEngine(cfg, 0, TOPICS)
    done = Committed()
    for message in messages:
        engine.ingest(message)
    done.commit(engine, messages)
    (batch,) = done.batches
    assert sorted(batch.rollout_ids) == ["g-0", "g-1"]
    assert [(o.topic, o.start, o.end) for o in batch.source_offsets] == [("us.t.rollouts", 0, 2), ("eu.t.rewards", 0, 2)]
    assert done.marks == {"us.rollouts": 2, "eu.rewards": 3}
    (ledger,) = [o for o in done.outcomes if o.kind == "batch"]
    assert ledger.detail["sources"] == {"us.rollouts": 2}  # what `rollouts stats` counts per region
    (late,) = [o for o in done.outcomes if o.kind == "reward_dropped"]
    assert (late.topic, late.offset) == ("eu.t.rewards", 2)
    restored = ShardEngine(cfg, 0, TOPICS, snapshot=done.snapshot, committed=done.marks)
    assert restored.pending_count() == 0 and set(restored.held) == {"rollouts", "rewards", "us.rollouts", "us.rewards", "eu.rollouts", "eu.rewards"}


@pytest.mark.parametrize("regions, source, why", [
    ({"US": "h:1"}, "groups", "kafka.regions"), ({"central": "h:1"}, "groups", "'central'"), ({"us": "h:1"}, "product", "groups only"),
])
def test_regions_are_refused_with_the_key_named(regions, source, why):
    data = config().model_dump(mode="json")
    data["kafka"]["regions"], data["source"] = regions, source
    with pytest.raises(EtlConfigError, match=why):
        parse_config(data)
