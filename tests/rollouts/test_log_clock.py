"""`LogClock`, the rule the ETL's deadlines run on (pure logic, no Kafka): the wall clock never advances a
decision while data sits unread, only time in the log and end offsets the reader has reached do."""

from __future__ import annotations

import pytest

from ember.rollouts.log_clock import LogClock

T0 = 1_700_000_000_000  # a wall-clock instant in ms; the tests move it by hand


def clock_after_reading(rollout_ms: int, reward_ms: int) -> LogClock:
    clock = LogClock(["rollouts", "rewards"])
    clock.read("rollouts", rollout_ms, wall_ms=rollout_ms)
    clock.read("rewards", reward_ms, wall_ms=reward_ms)
    return clock


def test_wall_time_does_not_advance_the_clock_while_data_is_unread():
    """A rebalance: poll() returns nothing for 30 s while the partitions hold unread data."""
    clock = clock_after_reading(T0, T0)
    for wall in range(T0, T0 + 30_000, 250):  # every end-offset refresh during the rebalance shows unread data
        assert not clock.end_offset("rewards", position=10, end=12, asked_at_ms=wall)
        assert not clock.end_offset("rollouts", position=10, end=11, asked_at_ms=wall)
    assert clock.now_ms == T0  # an 8 s reward deadline from T0 has not passed, whatever the wall clock says


def test_reading_moves_the_clock_by_message_timestamps_and_the_lowest_partition_holds_it():
    clock = clock_after_reading(T0, T0)
    clock.read("rollouts", T0 + 5_000, wall_ms=T0 + 40_000)
    assert clock.now_ms == T0  # rewards are read only up to T0: a reward stamped T0 + 4 s may still be unread
    clock.read("rewards", T0 + 4_000, wall_ms=T0 + 40_000)
    assert clock.now_ms == T0 + 4_000


def test_end_offsets_prove_time_only_up_to_when_they_were_asked_for():
    """Caught up with end offsets asked at t means nothing unread was appended before t, nothing about later."""
    clock = clock_after_reading(T0, T0)
    assert clock.end_offset("rollouts", position=7, end=7, asked_at_ms=T0 + 1_000)
    assert clock.end_offset("rewards", position=9, end=9, asked_at_ms=T0 + 1_200)
    assert clock.now_ms == T0 + 1_000
    # the same (now stale) end offsets, checked again 20 s of wall time later, prove nothing new:
    # the clock only takes the time the answer was asked for
    clock.end_offset("rollouts", position=7, end=7, asked_at_ms=T0 + 1_000)
    assert clock.now_ms == T0 + 1_000


def test_a_partition_never_read_or_proven_holds_the_clock_at_zero():
    clock = LogClock(["rollouts", "rewards"])
    clock.read("rollouts", T0, wall_ms=T0)
    assert clock.now_ms == 0  # nothing is known about the rewards partition yet: no deadline may fire
    assert clock.end_offset("rewards", position=0, end=0, asked_at_ms=T0 + 500)
    assert clock.now_ms == T0


def test_a_producer_clock_ahead_of_the_wall_clock_cannot_fire_deadlines_early():
    clock = clock_after_reading(T0, T0)
    clock.read("rollouts", T0 + 3_600_000, wall_ms=T0 + 10)
    clock.read("rewards", T0 + 3_600_000, wall_ms=T0 + 10)
    assert clock.now_ms == T0 + 10


def test_the_clock_never_goes_back():
    clock = clock_after_reading(T0 + 5_000, T0 + 5_000)
    assert clock.now_ms == T0 + 5_000
    clock.read("rollouts", T0, wall_ms=T0 + 6_000)  # an older stamp read later (another producer's slower send)
    assert clock.now_ms == T0 + 5_000


def test_unknown_partitions_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        LogClock([])
    with pytest.raises(KeyError, match="'policy' is not an input partition"):
        LogClock(["rollouts"]).read("policy", T0, wall_ms=T0)
