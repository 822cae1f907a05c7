"""Config validation, control-record codecs and the co-partitioned cooperative assignor (pure parts)."""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.rollouts.assignor import balance_shards
from ember.configs import EtlConfigError
from ember.rollouts.config import load_config, parse_config
from ember.rollouts.replay import parse_start
from ember.rollouts.records import (
    ClosedGroup,
    Outcome,
    PolicyVersion,
    ShardSnapshot,
    offsets_to_ranges,
    ranges_to_offsets,
)
from ember.schemas import DecodeError, decode

EXAMPLE = Path(__file__).resolve().parents[2] / "ember" / "rollouts" / "etl.example.yaml"
REQUIRED = {"kafka": {"topic_prefix": "t", "group_id": "t-etl"}, "filters": {"vocab_size": 1000}}


def minimal(**sections) -> dict:
    """The required keys plus `sections` merged in."""
    return {name: {**REQUIRED.get(name, {}), **sections.get(name, {})} for name in {*REQUIRED, *sections}}


def test_example_config_loads_with_its_documented_values():
    config = load_config(EXAMPLE)
    assert config.groups.size == 8 and config.groups.min_samples == 6
    assert config.kafka.topics.rollouts == "ember.rollouts"
    assert config.rewards.graders == ["unit-tests"]


@pytest.mark.parametrize(
    "data, fragment",
    [
        (minimal(groups={"sise": 8}), "groups.sise: unknown key"),
        (minimal(groups={"size": 4, "quorum": 5}), "quorum (5) cannot exceed size (4)"),
        (minimal(filters={"truncated": "maybe"}), "filters.truncated"),
        (minimal(advantages={"estimator": "rloo"}, groups={"size": 1}), "rloo needs groups.quorum"),
        (minimal(filters={"max_tokens": 100}, batches={"token_budget": 50}), "could never be packed"),
        (minimal(kafka={"session_timeout_ms": 6000, "heartbeat_interval_ms": 3000}), "at most a third"),
        (minimal(batches={"min_fill": 0}), "batches.min_fill"),
        (minimal(filters={"vocab_size": 2**32 + 1}), "filters.vocab_size"),
        (minimal(rewards={"clip": 1e31}), "rewards.clip"),
        (minimal(rewards={"clip": 0}), "rewards.clip"),
        (minimal(kafka={"partitions": 10**6}), "kafka.partitions: at most 4,096"),
        (minimal(kafka={"max_poll_records": 10**7}), "kafka.max_poll_records: at most 100,000"),
        (minimal(groups={"size": 10**6}), "groups.size: at most 4,096"),
        (minimal(batches={"token_budget": 2**40}), "batches.token_budget: at most 16,777,216"),
        (minimal(dead_letter={"max_message_bytes": 2**40}), "dead_letter.max_message_bytes: at most"),
        ({"groups": {"size": 2}}, "kafka: Field required"),
        ({"kafka": {"topic_prefix": "t"}, "filters": {}}, "kafka.group_id: Field required"),
        ({"kafka": {"group_id": "g"}, "filters": {"vocab_size": 8}}, "kafka.topic_prefix: Field required"),
        ({"kafka": {"topic_prefix": "t", "group_id": "g"}, "filters": {}}, "filters.vocab_size: Field required"),
        ([1, 2], "expected a mapping at the top level"),
    ],
)
def test_config_errors_say_what_to_fix(data, fragment):
    with pytest.raises(EtlConfigError) as info:
        parse_config(data)
    assert fragment in str(info.value)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(EtlConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups: [unclosed\n")
    with pytest.raises(EtlConfigError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize("text", ["", "{}\n", "# only a comment\n"])
def test_an_empty_config_file_is_refused_naming_the_required_keys(tmp_path, text):
    """It used to run against the default topics and consumer group: another deployment's, silently."""
    path = tmp_path / "etl.yaml"
    path.write_text(text)
    with pytest.raises(EtlConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and "is empty" in message
    for key in ("kafka.topic_prefix", "kafka.group_id", "filters.vocab_size"):
        assert key in message


def test_overrides_are_validated_again():
    config = parse_config(REQUIRED)
    assert config.with_overrides(advantages={"estimator": "rloo"}).advantages.estimator.value == "rloo"
    with pytest.raises(EtlConfigError, match="quorum"):
        config.with_overrides(groups={"size": 2, "quorum": 3})
    with pytest.raises(EtlConfigError, match="section 'advantage' does not exist"):
        config.with_overrides(advantage={"estimator": "rloo"})


@given(st.sets(st.integers(0, 500), max_size=80))
def test_offset_ranges_round_trip(offsets):
    ranges = offsets_to_ranges(list(offsets))
    assert ranges_to_offsets(ranges) == offsets
    assert all(a < b for a, b in ranges)
    assert all(ranges[i][1] < ranges[i + 1][0] for i in range(len(ranges) - 1))


def test_control_records_round_trip_and_reject_garbage():
    closed = (ClosedGroup("g", 9, ("a", "b"), (("a", "tests"), ("b", "judge"))),)
    snapshot = ShardSnapshot(3, {"rollouts": 10, "rewards": 7}, {"rollouts": [[2, 4]], "rewards": []}, 5, closed, "etl-0")
    assert ShardSnapshot.decode(snapshot.encode()) == snapshot
    before_rewarded = snapshot.encode().replace(b',[["a","tests"],["b","judge"]]', b"")  # written before `rewarded` existed
    assert ShardSnapshot.decode(before_rewarded).closed == (ClosedGroup("g", 9, ("a", "b")),)
    outcome = Outcome("rollout_dropped", "stale", 1, 2, group_id="g", rollout_id="r", offset=4, detail={"lag_versions": 9})
    assert Outcome.decode(outcome.encode()) == outcome
    assert PolicyVersion.decode(PolicyVersion(4, 99).encode()) == PolicyVersion(4, 99)
    with pytest.raises(ValueError, match="policy_version"):
        PolicyVersion.decode(b'{"policy_version": -1}')
    with pytest.raises(ValueError, match="not valid UTF-8 JSON"):
        ShardSnapshot.decode(b"\xff")
    with pytest.raises(ValueError, match="malformed"):
        ShardSnapshot.decode(b'{"shard": 1}')
    with pytest.raises(ValueError, match="outcome kind"):
        Outcome("exploded", "x", 0, 0)


def test_control_records_are_json_objects_not_arrow():
    """What docs/guides/wire-format.md says: compact JSON objects, no schema or version key, not Arrow IPC."""
    snapshot = ShardSnapshot(3, {"rollouts": 10, "rewards": 7}, {"rollouts": [[2, 4]], "rewards": []}, 5, (ClosedGroup("g", 9, ("a", "b")),), "etl-0")
    outcome = Outcome("rollout_dropped", "stale", 1, 2, group_id="g", detail={"lag_versions": 9})
    version = PolicyVersion.now(4, "file:///runs/a/versions/version_4", "ab" * 32)
    records = [
        (snapshot, {"shard", "positions", "pending", "next_step", "closed", "etl_instance"}),
        (outcome, {"kind", "reason", "shard", "at_ms", "group_id", "rollout_id", "topic", "partition", "offset", "tokens", "detail"}),
        (version, {"policy_version", "published_at_us", "weights_uri", "weights_sha256"}),
    ]
    for record, expected in records:
        raw = record.encode()
        assert raw == json.dumps(json.loads(raw), separators=(",", ":")).encode("utf-8")
        assert set(json.loads(raw)) == expected
        with pytest.raises(DecodeError, match="not an Arrow IPC stream"):
            decode(raw)


@given(
    st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True),
    st.integers(0, 24),
    st.dictionaries(st.sampled_from("abcdefgh"), st.sets(st.integers(0, 30), max_size=8), max_size=8),
)
def test_balance_is_complete_fair_and_sticky(members, count, owned):
    shards = list(range(count))
    result = balance_shards(members, owned, shards)
    assert set(result) == set(members)
    assigned = [s for m in members for s in result[m]]
    assert sorted(assigned) == shards, "every shard exactly once"
    sizes = [len(result[m]) for m in members]
    assert max(sizes) - min(sizes) <= 1
    claimed: set[int] = set()
    for member in sorted(members):
        mine = (owned.get(member, set()) & set(shards)) - claimed
        claimed |= mine
        assert len(result[member] & mine) == min(len(mine), len(result[member])), "owners keep what fits their share"


def test_balance_moves_only_what_it_must():
    before = balance_shards(["a"], {}, list(range(6)))
    after = balance_shards(["a", "b"], before, list(range(6)))
    assert after["a"] <= before["a"] and len(after["a"]) == 3 and len(after["b"]) == 3
    survivor = balance_shards(["b"], after, list(range(6)))
    assert survivor["b"] == set(range(6))


def test_start_specs():
    assert parse_start("earliest").earliest
    assert parse_start("rollouts:0=12,rewards:1=3").offsets == {("rollouts", 0): 12, ("rewards", 1): 3}
    assert parse_start("2026-01-31T00:00:00+00:00").at_ms == 1769817600000
    assert parse_start("1769817600").at_ms == 1769817600000
    with pytest.raises(ValueError, match="give a timezone"):
        parse_start("2026-01-31T00:00:00")
    with pytest.raises(ValueError, match="bad offset spec"):
        parse_start("bogus:0=1")
