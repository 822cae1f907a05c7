"""Hostile and broken input against the ETL engine (issue 17): no message stops the shard, nothing
out of vocabulary or non-finite reaches a batch, metric labels never carry message content.

Before the fixes each named case raised out of `ShardEngine.ingest` or `advance` (and again on every
restart, so the partition was stuck), or reached a batch.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from ember.rollouts.engine import REWARDS, ROLLOUTS, InputMessage, ShardEngine, input_topics
from ember.rollouts.etl import EtlService
from ember.rollouts.metrics import EtlMetrics
from ember.rollouts.records import REASONS, Reason
from ember.schemas import Reward, Rollout, decode, encode
from ember.schemas.codec import KIND_REWARD, KIND_ROLLOUT, _decode, _frame
from ember.schemas.rollouts import FINISH_REASONS
from tests.rollouts.helpers import TOPICS, VOCAB, Committed, Log, config, reward, rollout, run
from tests.schemas.strategies import deep_json, hostile_ints, hostile_meta_text, hostile_text

SCORES = [0.1, 0.9, 0.4, 0.7]


def good_group(log: Log, group: str = "ok", at_ms: int = 0) -> list[Rollout]:
    rollouts = [rollout(group, i) for i in range(4)]
    for r, s in zip(rollouts, SCORES):
        log.add(r, at_ms)
        log.add(reward(r, s), at_ms)
    return rollouts


def raw_rollout(meta_text: str, template: Rollout | None = None) -> bytes:
    """A rollout frame whose meta is exactly `meta_text` (arrays from a valid rollout)."""
    _kind, _meta, arrays = _decode(encode(template or rollout("x", 0)))
    return _frame(KIND_ROLLOUT, meta_text.encode("utf-8"), {k: np.array(v) for k, v in arrays.items()})


def meta_of(record) -> dict:
    return _decode(encode(record))[1]


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
    text = json.dumps({**meta_of(hostile), "group_id": "g\ud800"})  # json escapes it as \ud800
    log.add(hostile, 0, raw=raw_rollout(text), key=b"g")
    good = good_group(log)
    assert_only_the_hostile_message_is_lost(run(config(), log.messages), good, "malformed", "not valid Unicode")


def test_lone_surrogate_rollout_id_is_dead_lettered():
    log = Log()
    hostile = rollout("x", 0)
    log.add(hostile, 0, raw=raw_rollout(json.dumps({**meta_of(hostile), "rollout_id": "\udc00r"})))
    good = good_group(log)
    assert_only_the_hostile_message_is_lost(run(config(), log.messages), good, "malformed", "not valid Unicode")


def test_deeply_nested_meta_is_dead_lettered_not_a_recursion_error():
    log = Log()
    hostile = rollout("x", 0)
    text = json.dumps({**meta_of(hostile), "future": "@@"}).replace('"@@"', deep_json(50_000))
    log.add(hostile, 0, raw=raw_rollout(text))
    good = good_group(log)
    assert_only_the_hostile_message_is_lost(run(config(), log.messages), good, "malformed", "levels deep")


def test_policy_version_2_pow_70_is_dead_lettered_not_an_overflow_error_in_batching():
    log = Log()
    hostile = rollout("x", 0)
    log.add(hostile, 0, raw=raw_rollout(json.dumps({**meta_of(hostile), "policy_version": 2**70})))
    good = good_group(log)
    assert_only_the_hostile_message_is_lost(run(config(), log.messages), good, "malformed", "outside int64")


def test_a_4301_digit_integer_is_dead_lettered():
    log = Log()
    hostile = rollout("x", 0)
    text = json.dumps({**meta_of(hostile), "created_at_us": "@@"}).replace('"@@"', "9" * 4301)
    log.add(hostile, 0, raw=raw_rollout(text))
    good = good_group(log)
    assert_only_the_hostile_message_is_lost(run(config(), log.messages), good, "malformed", "integer string conversion")


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
        engine.ingest(m, 0)
    engine.advance(0, None)
    output, _snapshot, _marks = engine.checkpoint()
    (emitted,) = output.batches
    advantages = emitted.batch.sequence_advantages  # the ETL writes batches by reference: one advantage per rollout
    assert np.isfinite(advantages).all() and np.abs(advantages).max() > 0
    assert ("rewards_clipped", 2.0) in output.observations
    assert max(v for name, v in output.observations if name == "reward") == 10.0


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
    log.add(r, 0, raw=raw_rollout(json.dumps({**meta_of(r), "group_id": "\ud800" * 3})))
    log.add(r, 0, raw=encode(reward(r, 1.0)))
    t = rollout("g", 1)
    t.tokens = t.tokens.copy()
    t.tokens[0] = 4_000_000_000
    log.add(t, 0)
    log.add(r, 0, raw=b"x" * 4096)
    good_group(log)
    return log


def test_metric_labels_are_reasons_never_message_content():
    done_engine = ShardEngine(config(dead_letter={"max_message_bytes": 2048}), 0, TOPICS)
    for m in hostile_log().messages:
        done_engine.ingest(m, 0)
        done_engine.advance(0, None)
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

GROUPS = ("g0", "g1", "g2")


@st.composite
def hostile_rollout(draw) -> tuple[bytes, bytes | None]:
    group = draw(st.sampled_from(GROUPS) | hostile_text)
    index = draw(st.integers(0, 5))
    r = rollout(group if group else "g0", index, tokens=draw(st.integers(2, 24)))
    r.group_id = group
    r.rollout_id = draw(st.sampled_from([f"{group}-{index}", f"shared-{index}"]) | hostile_text)
    corruption = draw(st.sampled_from(["none", "none", "token", "logprob", "version", "created", "mask"]))
    n = r.num_tokens
    if corruption == "token":
        r.tokens = r.tokens.copy()
        r.tokens[draw(st.integers(0, n - 1))] = draw(st.sampled_from([VOCAB, 2**32 - 1, VOCAB - 1]))
    elif corruption == "logprob":
        r.sampler_logprobs = r.sampler_logprobs.copy()
        r.sampler_logprobs[draw(st.integers(0, n - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 3.0, -1e38]))
    elif corruption == "version":
        r.policy_version = draw(hostile_ints)
    elif corruption == "created":
        r.created_at_us = draw(hostile_ints)
    elif corruption == "mask":
        r.loss_mask = draw(hnp.arrays(np.uint8, n, elements=st.integers(0, 2)))
    key = group.encode("utf-8", errors="surrogatepass") if draw(st.integers(0, 9)) else draw(st.binary(max_size=4))
    return encode(r), key


@st.composite
def hostile_reward(draw) -> tuple[bytes, bytes | None]:
    group = draw(st.sampled_from(GROUPS))
    rollout_id = draw(st.sampled_from([f"{group}-{i}" for i in range(6)] + [f"shared-{i}" for i in range(3)]))
    score = draw(st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([1e308, -1e308, 0.0, 1.0]))
    grader = draw(st.sampled_from(["unit-tests", "judge"]) | hostile_text)
    finite = st.floats(allow_nan=False, allow_infinity=False)
    components = draw(st.dictionaries(st.sampled_from(["passed", "style"]), finite, max_size=2))
    return encode(Reward(rollout_id, group, grader, score, 0, components)), group.encode()


@st.composite
def garbage(draw) -> tuple[bytes, bytes | None]:
    kind = draw(st.sampled_from(["bytes", "rollout_meta", "reward_meta"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64)), draw(st.none() | st.binary(max_size=4))
    template = rollout("g0", 0, tokens=8)
    record = template if kind == "rollout_meta" else reward(template, 0.5)
    code = KIND_ROLLOUT if kind == "rollout_meta" else KIND_REWARD
    _kind, meta, arrays = _decode(encode(record))
    raw = _frame(code, draw(hostile_meta_text(meta)), {k: np.array(v) for k, v in arrays.items()})
    return raw, b"g0"


@st.composite
def hostile_logs(draw) -> list[InputMessage]:
    topics = input_topics(TOPICS)
    offsets = {ROLLOUTS: 0, REWARDS: 0}
    messages, now = [], 0
    for _ in range(draw(st.integers(1, 30))):
        choice = draw(st.sampled_from(["rollout", "rollout", "reward", "reward", "garbage"]))
        value, key = draw({"rollout": hostile_rollout(), "reward": hostile_reward(), "garbage": garbage()}[choice])
        role = {"rollout": ROLLOUTS, "reward": REWARDS}.get(choice) or draw(st.sampled_from([ROLLOUTS, REWARDS]))
        now += draw(st.integers(0, 3000))
        messages.append(InputMessage(topics[role], 0, offsets[role], now, key, value))
        offsets[role] += 1
    return messages


def _account(messages: list[InputMessage], output) -> None:
    """Each message is in exactly one place: a ledger outcome naming its offset, or a batch.

    A reward joined to a rollout travels with it: into the batch, or into the ledger with the
    rollout's drop outcome.
    """
    named: dict[tuple[str, int], int] = {}
    for o in output.outcomes:
        if o.kind != "batch":
            named[(o.topic, o.offset)] = named.get((o.topic, o.offset), 0) + 1
    assert all(n == 1 for n in named.values()), "a message is in the ledger twice"
    assert len(output.dead_letters) == sum(o.kind == "dead_letter" for o in output.outcomes)
    # neither dropped nor dead-lettered: a valid record, a batched rollout or a reward of one
    rest = [(m, decode(m.value)) for m in messages if (m.topic, m.offset) not in named]
    batched_rollouts = [r for m, r in rest if m.topic == TOPICS.rollouts]
    assert sorted(r.rollout_id for r in batched_rollouts) == sorted(
        rid for e in output.batches for rid in e.batch.rollout_ids
    ), "the rollouts in no ledger record are exactly the batched ones"
    joined = {(r.group_id, r.rollout_id) for r in batched_rollouts}
    joined |= {(o.group_id, o.rollout_id) for o in output.outcomes if o.kind == "rollout_dropped"}
    for m, record in rest:
        if m.topic == TOPICS.rewards:
            assert (record.group_id, record.rollout_id) in joined, f"reward @{m.offset} is in no batch and nowhere in the ledger"


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], deadline=None)
@given(hostile_logs(), st.none() | st.integers(0, 2**63 - 1))
def test_no_exception_escapes_and_every_message_ends_in_exactly_one_place(messages, latest_policy):
    cfg = config(groups={"quorum": 2}, advantages={"drop_zero_variance": False}, rewards={"clip": 100.0})
    engine = ShardEngine(cfg, 0, TOPICS)
    for m in messages:
        engine.ingest(m, m.timestamp_ms)
        engine.advance(m.timestamp_ms, latest_policy)
    engine.flush_all(messages[-1].timestamp_ms + 10**7, latest_policy)
    output, _snapshot, _marks = engine.checkpoint()
    assert engine.pending_count() == 0
    _account(messages, output)
    for emitted in output.batches:
        checked = decode(encode(emitted.batch))  # validates: finite values, unique ids, cu_seqlens
        assert int(checked.tokens.max()) < VOCAB
    assert {o.reason for o in output.outcomes} <= REASONS
    for outcome in output.outcomes:
        json.loads(outcome.encode())  # every ledger record is writable JSON
    assert all(math.isfinite(v) for _name, v in output.observations)


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
