"""Hostile and broken input against the ETL engine (issue 17): no message stops the shard, nothing
out of vocabulary or non-finite reaches a batch, metric labels never carry message content.

Before the fixes each named case raised out of `ShardEngine.ingest` or `advance` (and again on every
restart, so the partition was stuck), or reached a batch.
"""

from __future__ import annotations

import copy
import json
import math
import re

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from ember.rollouts.engine import REWARDS, ROLLOUTS, InputMessage, ShardEngine
from ember.rollouts.etl import EtlService
from ember.rollouts.metrics import EtlMetrics
from ember.rollouts.records import REASONS, Reason
from ember.schemas import Reward, Rollout, decode, encode
from ember.schemas.rollouts import FINISH_REASONS
from tests.rollouts.helpers import TOPICS, VOCAB, Committed, Log, config, reward, rollout, run
from tests.rollouts.hostile_support import messages, plans
from tests.schemas.strategies import deep_list_type, raw_strings, rewritten

SCORES = [0.1, 0.9, 0.4, 0.7]


def good_group(log: Log, group: str = "ok", at_ms: int = 0) -> list[Rollout]:
    rollouts = [rollout(group, i) for i in range(4)]
    for r, s in zip(rollouts, SCORES):
        log.add(r, at_ms)
        log.add(reward(r, s), at_ms)
    return rollouts


def raw_rollout(**columns) -> bytes:
    """A valid rollout's message with these columns replaced, as a foreign Arrow writer could send it."""
    return rewritten(encode(rollout("x", 0)), **columns)


def dead_letters(done: Committed) -> list:
    return [o for o in done.outcomes if o.kind == "dead_letter"]


def assert_only_the_hostile_message_is_lost(done: Committed, good: list[Rollout], reason: str, fragment: str) -> None:
    (dead,) = dead_letters(done)
    assert dead.reason == reason
    assert fragment in dead.detail["error"]
    assert sorted(done.batched_ids) == sorted(r.rollout_id for r in good), "the valid group behind it is batched"
    for batch in done.batches:
        decode(encode(batch)).validate()


# ---- the named crashes --------------------------------------------------------------------------


def test_lone_surrogate_group_id_is_dead_lettered_not_a_unicode_encode_error():
    log = Log()
    hostile = rollout("x", 0)
    log.add(hostile, 0, raw=raw_rollout(group_id=raw_strings("g\ud800")), key=b"g")
    good = good_group(log)
    assert_only_the_hostile_message_is_lost(run(config(), log.messages), good, "malformed", "Invalid UTF8")


def test_lone_surrogate_rollout_id_is_dead_lettered():
    log = Log()
    hostile = rollout("x", 0)
    log.add(hostile, 0, raw=raw_rollout(rollout_id=raw_strings("\udc00r")))
    good = good_group(log)
    assert_only_the_hostile_message_is_lost(run(config(), log.messages), good, "malformed", "Invalid UTF8")


def test_a_deeply_nested_column_in_place_of_tokens_is_dead_lettered():
    log = Log()
    hostile = rollout("x", 0)
    log.add(hostile, 0, raw=raw_rollout(tokens=pa.array([[[[[1]]]]], deep_list_type(4))))
    good = good_group(log)
    assert_only_the_hostile_message_is_lost(run(config(), log.messages), good, "malformed", "column 'tokens' is list<")


def test_policy_version_2_pow_70_is_dead_lettered_not_an_overflow_error_in_batching():
    log = Log()
    hostile = rollout("x", 0)
    log.add(hostile, 0, raw=raw_rollout(policy_version=pa.array([2**70], pa.decimal128(38))))
    good = good_group(log)
    assert_only_the_hostile_message_is_lost(run(config(), log.messages), good, "malformed", "expected int64")


def test_a_4301_digit_integer_is_dead_lettered():
    log = Log()
    hostile = rollout("x", 0)
    log.add(hostile, 0, raw=raw_rollout(created_at_us=pa.array(["9" * 4301])))
    good = good_group(log)
    assert_only_the_hostile_message_is_lost(run(config(), log.messages), good, "malformed", "is string, expected int64")


# ---- validity at the boundary -------------------------------------------------------------------


@pytest.mark.parametrize("token", [VOCAB, 4_000_000_000])
def test_token_ids_outside_the_vocabulary_are_dead_lettered(token):
    log = Log()
    hostile = rollout("g", 0)
    hostile.tokens = hostile.tokens.copy()
    hostile.tokens[5] = token
    log.add(hostile, 0)
    good = good_group(log)
    assert_only_the_hostile_message_is_lost(
        run(config(), log.messages), good, "token_out_of_vocab", f"token id {token} at position 5 >= filters.vocab_size {VOCAB}"
    )


def test_the_last_id_of_the_vocabulary_is_kept():
    log = Log()
    rollouts = [rollout("g", i) for i in range(4)]
    rollouts[0].tokens = rollouts[0].tokens.copy()
    rollouts[0].tokens[0] = VOCAB - 1
    for r, s in zip(rollouts, SCORES):
        log.add(r, 0)
        log.add(reward(r, s), 0)
    assert len(run(config(), log.messages).batched_ids) == 4


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_log_prob_on_a_loss_mask_0_token_is_dead_lettered(bad):
    log = Log()
    hostile = rollout("g", 0)
    hostile.sampler_logprobs = hostile.sampler_logprobs.copy()
    hostile.sampler_logprobs[0] = bad  # a prompt token: loss mask 0
    assert hostile.loss_mask[0] == 0
    log.add(hostile, 0)
    good = good_group(log)
    done = run(config(), log.messages)
    assert_only_the_hostile_message_is_lost(done, good, "invalid_record", "sampler_logprobs")
    assert all(np.isfinite(b.sampler_logprobs).all() for b in done.batches)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_extreme_finite_rewards_give_finite_advantages(estimator):
    """[1e308, 1e308, 0, 0.5] gave NaN advantages (std overflows); rewards are clipped first."""
    log = Log()
    rollouts = [rollout("g", i) for i in range(4)]
    for r, s in zip(rollouts, [1e308, 1e308, 0.0, 0.5]):
        log.add(r, 0)
        log.add(reward(r, s), 0)
    engine = ShardEngine(config(advantages={"estimator": estimator}, rewards={"clip": 10.0}), 0, TOPICS)
    for m in log.messages:
        engine.ingest(m)
    output, _snapshot, _marks = engine.checkpoint()
    (emitted,) = output.batches
    advantages = emitted.batch.sequence_advantages  # the ETL writes batches by reference: one advantage per rollout
    assert np.isfinite(advantages).all() and np.abs(advantages).max() > 0
    assert ("rewards_clipped", 2.0) in output.observations
    assert max(v for name, v in output.observations if name == "reward") == 10.0


def test_the_reported_rewards_give_finite_advantages_under_the_default_clip():
    """The issue's case as reported: [1e308, 1e308, 0] under a default config gave 144 NaN advantages."""
    log = Log()
    rollouts = [rollout("g", i) for i in range(3)]
    for r, s in zip(rollouts, [1e308, 1e308, 0.0]):
        log.add(r, 0)
        log.add(reward(r, s), 0)
    cfg = config(groups={"size": 3})
    done = run(cfg, log.messages)
    (batch,) = done.batches
    assert np.isfinite(batch.advantages).all() and np.abs(batch.advantages).max() > 0
    assert cfg.rewards.clip == 1e6


def test_a_combined_reward_that_overflows_is_dropped_not_batched():
    """Two graders' finite scores can sum past float64: that member is dropped with its reason."""
    log = Log()
    rollouts = [rollout("g", i) for i in range(4)]
    for r, s in zip(rollouts, SCORES):
        log.add(r, 0)
        log.add(reward(r, s, grader="a"), 0)
        log.add(reward(r, 1e308 if r is rollouts[0] else s, grader="b"), 0)
    log.add(reward(rollouts[0], 1e308, grader="c"), 0)
    done = run(config(rewards={"graders": ["a", "b", "c"]}, groups={"quorum": 3}), log.messages, end_ms=60_000)
    assert done.reasons()["reward_not_finite"] == 1
    assert rollouts[0].rollout_id not in done.batched_ids


def test_a_rollout_id_reused_by_another_open_group_is_dropped():
    """Two groups sharing a rollout id could be packed into one batch, which the trainer refuses."""
    log = Log()
    first = [rollout("a", i) for i in range(4)]
    second = [rollout("b", i) for i in range(4)]
    second[0].rollout_id = first[0].rollout_id
    for r in first + second:
        log.add(r, 0)
    for r, s in zip(first + second, SCORES + SCORES):
        log.add(reward(r, s), 0)
    done = run(config(groups={"quorum": 3}), log.messages, end_ms=60_000)
    assert done.reasons()["rollout_id_conflict"] == 1
    for batch in done.batches:
        decode(encode(batch)).validate()
    assert len(done.batched_ids) == len(set(done.batched_ids)) == 7


def test_every_finish_reason_is_a_reason():
    assert {Reason.finish(f).value for f in FINISH_REASONS} <= REASONS


# ---- bounded metric labels ----------------------------------------------------------------------


def hostile_log() -> Log:
    log = Log()
    r = rollout("g", 0)
    log.add(r, 0, raw=b"\xd3t" + encode(r)[2:])  # bad magic b'\xd3t...'
    log.add(r, 0, raw=encode(r)[:-3])
    log.add(r, 0, key="k\u00e9y-\x00".encode())
    log.add(r, 0, raw=raw_rollout(group_id=raw_strings("\ud800" * 3)))
    log.add(r, 0, raw=encode(reward(r, 1.0)))
    t = rollout("g", 1)
    t.tokens = t.tokens.copy()
    t.tokens[0] = 4_000_000_000
    log.add(t, 0)
    log.add(r, 0, raw=b"x" * 16384)
    good_group(log)
    return log


def test_metric_labels_are_reasons_never_message_content():
    done_engine = ShardEngine(config(dead_letter={"max_message_bytes": 8192}), 0, TOPICS)
    for m in hostile_log().messages:
        done_engine.ingest(m)
    output, _snapshot, _marks = done_engine.checkpoint()
    assert len(output.dead_letters) == 7
    service = EtlService(config(), metrics=EtlMetrics())
    service._count(output)
    labels = [
        (key, value)
        for family in text_string_to_metric_families(generate_latest(service.metrics.registry).decode())
        for sample in family.samples
        for key, value in sample.labels.items()
    ]
    reasons = {value for key, value in labels if key == "reason"}
    assert reasons == {"malformed", "key_mismatch", "wrong_topic", "token_out_of_vocab", "oversized", "batched"}
    assert reasons <= REASONS
    for _key, value in labels:
        assert value.isascii() and "magic" not in value and "\\x" not in value and len(value) <= 64
    details = [d.detail for d in output.dead_letters]
    assert any("bad magic b'\\xd3t" in d for d in details), "the detail keeps what the message said"


# ---- the property: no exception escapes, every message ends in exactly one place ---------------


def write_raw(record: Rollout | Reward) -> bytes:
    """`record` on the wire as a hostile Arrow producer would write it where `encode` refuses: strings
    with lone surrogates as their raw bytes, NaN and infinite floats as given. Integers wider than
    int64 cannot be written in an int64 column, so those records are refused (`OverflowError`)."""
    clean = copy.copy(record)
    columns: dict[str, pa.Array] = {}
    for name, value in vars(record).items():
        if isinstance(value, str):
            setattr(clean, name, "")
            columns[name] = raw_strings(value)
        elif isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
            if isinstance(value, int) and not -(2**63) <= value < 2**63:
                raise OverflowError(f"{name}={value} does not fit an int64 column")
            setattr(clean, name, type(value)())
            columns[name] = pa.array([value], pa.float64() if isinstance(value, float) else pa.int64())
    if isinstance(record, Reward):
        clean.components = {}
        if record.components:
            names = record.components
            columns["component_names"] = pa.array([list(names)], pa.list_(pa.string()))
            columns["component_values"] = pa.array([list(names.values())], pa.large_list(pa.float64()))
    return rewritten(encode(clean), **columns)


class Durable:
    """What the Kafka transactions made durable, across every instance that held the shard."""

    def __init__(self) -> None:
        self.batches: list = []
        self.outcomes: list = []
        self.dead_letters: list = []
        self.observations: list[tuple[str, float]] = []
        self.snapshot, self.marks, self.closed = None, {}, []

    def commit(self, engine: ShardEngine) -> None:
        output, self.snapshot, self.marks = engine.checkpoint("fuzz")
        self.batches += [e.batch for e in output.batches]
        self.outcomes += output.outcomes
        self.dead_letters += output.dead_letters
        self.observations += output.observations
        self.closed += list(self.snapshot.closed)

    def take_over(self, cfg) -> ShardEngine:
        """The next instance gets the shard: it restores the last commit; uncommitted work is lost."""
        return ShardEngine(cfg, 0, TOPICS, snapshot=self.snapshot, committed=dict(self.marks), closed=self.closed)

    def uncommitted(self, log: list[InputMessage], read: int) -> list[InputMessage]:
        """Of the first `read` messages, those the next instance re-reads: at or after the committed offsets."""
        role = {TOPICS.rollouts: ROLLOUTS, TOPICS.rewards: REWARDS}
        return [m for m in log[:read] if m.offset >= self.marks.get(role[m.topic], 0)]

    def ledger(self) -> list[tuple]:
        return sorted((o.kind, o.reason, o.topic, o.offset) for o in self.outcomes if o.kind != "batch")

    def batched_ids(self) -> list[str]:
        return sorted(r for b in self.batches for r in b.rollout_ids)


def _account(messages: list[InputMessage], done: Durable) -> None:
    """Each message is in exactly one place: a ledger record naming its offset, or a batch.

    A reward joined to a rollout travels with it: into the batch, or into the ledger with the
    rollout's drop outcome.
    """
    named: dict[tuple[str, int], int] = {}
    for o in done.outcomes:
        if o.kind != "batch":
            named[(o.topic, o.offset)] = named.get((o.topic, o.offset), 0) + 1
    assert all(n == 1 for n in named.values()), "a message is in the ledger twice"
    assert len(done.dead_letters) == sum(o.kind == "dead_letter" for o in done.outcomes)
    rest = [(m, decode(m.value)) for m in messages if (m.topic, m.offset) not in named]
    batched = [r for m, r in rest if m.topic == TOPICS.rollouts]
    assert sorted(r.rollout_id for r in batched) == done.batched_ids(), "the rollouts in no ledger record are the batched ones"
    joined = {(r.group_id, r.rollout_id) for r in batched}
    joined |= {(o.group_id, o.rollout_id) for o in done.outcomes if o.kind == "rollout_dropped"}
    for m, record in rest:
        if m.topic == TOPICS.rewards:
            assert (record.group_id, record.rollout_id) in joined, f"reward @{m.offset} is in no batch and nowhere in the ledger"
    for batch in done.batches:
        checked = decode(encode(batch))  # validates: finite values, unique ids, cu_seqlens
        assert int(checked.tokens.max()) < VOCAB
    assert {o.reason for o in done.outcomes} <= REASONS
    for outcome in done.outcomes:
        json.loads(outcome.encode())  # every ledger record is writable JSON
    assert all(math.isfinite(v) for _name, v in done.observations)


def _feed(engine: ShardEngine, m: InputMessage, latest_policy: int | None) -> None:
    engine.ingest(m, latest_policy=latest_policy)


FUZZ_CONFIG = config(groups={"quorum": 2}, advantages={"drop_zero_variance": False}, rewards={"clip": 100.0})


@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    st.lists(st.tuples(plans, st.integers(0, 3000)), min_size=1, max_size=24),
    st.none() | st.integers(0, 2**63 - 1),
    st.lists(st.sampled_from(["go", "go", "commit", "take_over"]), min_size=24, max_size=24),
)
def test_no_exception_escapes_and_every_message_ends_in_exactly_one_place(steps, latest_policy, events):
    """Arbitrary bytes and well-formed records with hostile values, some written raw where `encode`
    refuses. Several instances: after some messages the instance commits, after others it dies and
    the next one takes over from the last commit and re-reads; the durable result is the same as
    one instance's uninterrupted run, and every message is accounted for once."""
    log = messages([p for p, _ in steps], [d for _, d in steps], write=write_raw)
    alone, expected = ShardEngine(FUZZ_CONFIG, 0, TOPICS), Durable()
    for m in log:
        _feed(alone, m, latest_policy)
    alone.finish(latest_policy)
    assert alone.pending_count() == 0
    expected.commit(alone)
    _account(log, expected)

    done = Durable()
    engine = ShardEngine(FUZZ_CONFIG, 0, TOPICS)
    for position, (m, event) in enumerate(zip(log, events)):
        _feed(engine, m, latest_policy)
        if event == "commit":
            done.commit(engine)
        elif event == "take_over":
            engine = done.take_over(FUZZ_CONFIG)
            for again in done.uncommitted(log, position + 1):
                _feed(engine, again, latest_policy)
    engine.finish(latest_policy)
    done.commit(engine)
    _account(log, done)
    assert done.ledger() == expected.ledger()
    assert done.batched_ids() == expected.batched_ids()


def test_each_instance_taking_over_dead_letters_the_poison_instead_of_crashing_in_turn():
    """The crashes of the issue, with an instance dying after each message before its commit: the
    next one restores, re-reads and goes on. Each poison is committed once, the group behind is batched."""
    poisons = [
        raw_rollout(group_id=raw_strings("g\ud800")),
        raw_rollout(rollout_id=raw_strings("\udc00r")),
        raw_rollout(tokens=pa.array([None], deep_list_type(60))),
        raw_rollout(policy_version=pa.array([2**64 - 1], pa.uint64())),
        raw_rollout(created_at_us=pa.array(["9" * 4301])),
    ]
    log = Log()
    for poison in poisons:
        log.add(rollout("x", 0), 0, raw=poison)
    good = good_group(log)
    for dies_after in range(len(log.messages)):
        done = Durable()
        engine = ShardEngine(config(), 0, TOPICS)
        for position, m in enumerate(log.messages):
            _feed(engine, m, None)
            if position < dies_after:
                done.commit(engine)
            elif position == dies_after:
                engine = done.take_over(config())
                for again in done.uncommitted(log.messages, position + 1):
                    _feed(engine, again, None)
        done.commit(engine)
        assert done.ledger() == [("dead_letter", "malformed", TOPICS.rollouts, offset) for offset in range(len(poisons))]
        assert done.batched_ids() == sorted(r.rollout_id for r in good)


def test_an_unforeseen_failure_while_admitting_costs_one_message_not_the_shard(monkeypatch):
    """The safety net behind the checks: whatever admission raises dead-letters that message alone."""
    import ember.rollouts.engine as engine_module

    log = Log()
    poison = rollout("g", 0)
    log.add(poison, 0)
    good = good_group(log)
    real_decode = engine_module.decode

    def decode_failing_on_poison(value):
        if value == log.messages[0].value:
            raise RuntimeError("a bug no test foresaw")
        return real_decode(value)

    monkeypatch.setattr(engine_module, "decode", decode_failing_on_poison)
    assert_only_the_hostile_message_is_lost(run(config(), log.messages), good, "internal_error", "a bug no test foresaw")


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b'{"policy_version": ' + b"[" * 5000 + b"]" * 5000 + b"}", "levels deep"),
        (b'{"policy_version": ' + str(2**70).encode() + b"}", "policy_version must be an integer in [0, 2**63 - 1]"),
        (b'{"policy_version": ' + b"7" * 4301 + b"}", "not valid UTF-8 JSON"),
        (b'{"policy_version": 1, "published_at_us": "\\ud800"}', "not valid Unicode"),
    ],
)
def test_hostile_policy_announcements_are_value_errors_the_watcher_skips(raw, fragment):
    from ember.rollouts.records import PolicyVersion

    with pytest.raises(ValueError, match=re.escape(fragment)):
        PolicyVersion.decode(raw)


def test_a_snapshot_of_the_wrong_shape_is_a_value_error():
    from ember.rollouts.records import ShardSnapshot

    with pytest.raises(ValueError, match="malformed"):
        ShardSnapshot.decode(b'{"shard": 1, "positions": [1], "pending": {}, "next_step": 0, "closed": []}')
