"""`LogClock`, the order and the clock the ETL's decisions run on (pure logic, no Kafka): messages are released in
log order (broker timestamp, then rollouts before rewards) only once nothing unread can come before them, and the
wall clock moves nothing while data sits unread."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.rollouts.log_clock import END_OF_TIME_MS, LogClock

T0 = 1_700_000_000_000  # a wall-clock instant in ms; the tests move it by hand
ROLES = ["rollouts", "rewards"]


def released(clock: LogClock) -> list:
    return [item for _role, item in clock.release()]


def test_wall_time_does_not_advance_the_clock_while_data_is_unread():
    """A rebalance or a loaded host: for 30 s every end-offset refresh shows data not yet read."""
    clock = LogClock(ROLES)
    clock.read("rollouts", T0, "r0")
    clock.read("rewards", T0, "w0")
    for wall in range(T0, T0 + 30_000, 250):
        assert not clock.end_offset("rewards", position=10, end=12, asked_at_ms=wall)
        assert not clock.end_offset("rollouts", position=10, end=11, asked_at_ms=wall)
    assert released(clock) == ["r0"]  # the reward stamped T0 waits: a rollout stamped T0 may still be unread
    assert clock.now_ms == T0  # an 8 s reward deadline from T0 has not passed, whatever the wall clock says


def test_messages_come_out_in_log_order_whatever_order_they_were_read_in():
    clock = LogClock(ROLES)
    for ts, name in [(T0 + 10, "w10"), (T0 + 30, "w30"), (T0 + 40, "w40")]:
        clock.read("rewards", ts, name)
    assert released(clock) == []  # nothing is known about the rollouts partition yet
    clock.read("rollouts", T0 + 20, "r20")
    clock.read("rollouts", T0 + 30, "r30")
    # w30 waits: a rollout stamped T0 + 30 may still be unread, and on a tie the rollout comes first
    assert released(clock) == ["w10", "r20", "r30"]
    assert clock.now_ms == T0 + 30
    assert clock.end_offset("rollouts", position=2, end=2, asked_at_ms=T0 + 1_000)
    assert released(clock) == ["w30", "w40"] and clock.held() == 0


def test_end_offsets_prove_time_only_up_to_when_they_were_asked_for_less_the_skew():
    clock = LogClock(ROLES, skew_ms=200)
    clock.read("rewards", T0 + 500, "w")
    assert clock.end_offset("rollouts", position=7, end=7, asked_at_ms=T0 + 600)
    assert released(clock) == []  # a rollout appended right after may be stamped T0 + 400 by a broker 200 ms behind
    assert clock.now_ms == T0 + 400
    assert clock.proof_wanted_ms() == T0 + 701  # the earliest ask that can release it: the service asks then
    clock.end_offset("rollouts", position=7, end=7, asked_at_ms=T0 + 600)  # the same answer again proves nothing new
    assert clock.now_ms == T0 + 400
    assert clock.end_offset("rollouts", position=7, end=7, asked_at_ms=T0 + 701)
    assert released(clock) == ["w"] and clock.proof_wanted_ms() is None


def test_a_partition_never_read_or_proven_holds_the_clock_at_zero_and_the_clock_never_goes_back():
    clock = LogClock(ROLES)
    clock.read("rollouts", T0, "r")
    assert clock.now_ms == 0
    assert clock.end_offset("rewards", position=0, end=0, asked_at_ms=T0 + 500)
    assert released(clock) == ["r"] and clock.now_ms == T0  # the rollouts partition is known only up to T0
    assert clock.end_offset("rollouts", position=1, end=1, asked_at_ms=T0 + 800)
    assert clock.now_ms == T0 + 500
    assert clock.end_offset("rollouts", position=1, end=1, asked_at_ms=T0 + 100)  # an older proof
    assert clock.now_ms == T0 + 500


def test_unknown_partitions_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        LogClock([])
    with pytest.raises(KeyError, match="'policy' is not an input partition"):
        LogClock(["rollouts"]).read("policy", T0, "p")


appends = st.lists(st.integers(0, 50), max_size=12).map(lambda gaps: [T0 + sum(gaps[: i + 1]) for i in range(len(gaps))])


@settings(max_examples=300, deadline=None)
@given(appends, appends, st.lists(st.tuples(st.sampled_from(["read", "ends", "wait"]), st.integers(0, 1), st.integers(1, 40)), max_size=80))
def test_any_interleaving_of_reads_and_proofs_releases_exactly_the_log_order(rollout_times, reward_times, steps):
    """Two partitions appended at broker times (LogAppendTime: non-decreasing); a consumer that reads them in any
    interleaving and asks for end offsets at any moment releases every message in log order, never one before a
    message it could not have read yet, and the clock never passes a message not yet released."""
    logs = [rollout_times, reward_times]
    log_order = sorted((ts, rank, offset) for rank, times in enumerate(logs) for offset, ts in enumerate(times))
    clock: LogClock[tuple[int, int, int]] = LogClock(ROLES)
    wall, positions, out = T0, [0, 0], []

    def check() -> None:
        out.extend(released(clock))
        assert out == log_order[: len(out)]
        assert all(clock.now_ms <= ts for ts, _, _ in log_order[len(out):])

    for action, rank, amount in steps:
        appended = sum(1 for ts in logs[rank] if ts <= wall)
        if action == "wait":
            wall += amount
        elif action == "read" and positions[rank] < appended:
            offset = positions[rank]
            clock.read(ROLES[rank], logs[rank][offset], (logs[rank][offset], rank, offset))
            positions[rank] += 1
        elif action == "ends":
            clock.end_offset(ROLES[rank], position=positions[rank], end=appended, asked_at_ms=wall)
        check()
    for rank, times in enumerate(logs):  # the rest of the log, then the end of time (as the replay does)
        for offset in range(positions[rank], len(times)):
            clock.read(ROLES[rank], times[offset], (times[offset], rank, offset))
        clock.end_offset(ROLES[rank], position=len(times), end=len(times), asked_at_ms=END_OF_TIME_MS)
    check()
    assert out == log_order


REGIONAL = ["rollouts", "rewards", "us.rollouts", "eu.rewards"]


def test_central_end_offsets_never_advance_a_mirrored_partition():
    """A region cut off: central's end of its mirrored topic is read to the end, again and again, and proves nothing,
    so the others' clocks do not advance on its behalf and its in-time reward is not judged late."""
    clock = LogClock(REGIONAL, mirrored=["us.rollouts", "eu.rewards"])
    clock.read("rollouts", T0, "r0")
    clock.read("eu.rewards", T0 + 5, "w5")
    for wall in range(T0, T0 + 60_000, 1_000):
        assert clock.end_offset("rollouts", position=1, end=1, asked_at_ms=wall)
        assert clock.end_offset("rewards", position=0, end=0, asked_at_ms=wall)
        assert clock.end_offset("us.rollouts", position=3, end=3, asked_at_ms=wall)  # read to the end, proves no time
        assert clock.end_offset("eu.rewards", position=1, end=1, asked_at_ms=wall)
    assert released(clock) == []  # us may still send a rollout stamped before T0
    assert clock.now_ms == 0 and clock.holder() == "us.rollouts"


def test_a_region_proven_idle_by_its_own_cluster_holds_no_one():
    clock = LogClock(REGIONAL, skew_ms=100, mirrored=["us.rollouts", "eu.rewards"])
    clock.read("rollouts", T0, "r0")
    clock.read("eu.rewards", T0 + 5, "w5")
    for name in ("rollouts", "rewards"):
        clock.end_offset(name, position=9, end=9, asked_at_ms=T0 + 10_000)
    # us was asked at T0 + 2 s and MM2 had copied all of it into offsets < 4, but the reader is only at 3
    assert not clock.mirror_end("us.rollouts", position=3, copied_end=4, region_asked_at_ms=T0 + 2_000)
    assert clock.now_ms == 0
    assert clock.mirror_end("us.rollouts", position=4, copied_end=4, region_asked_at_ms=T0 + 2_000)
    assert released(clock) == ["r0", "w5"]
    assert clock.now_ms == T0 + 5 and clock.holder() == "eu.rewards"  # its read reward is its only evidence
    assert clock.mirror_end("eu.rewards", position=1, copied_end=1, region_asked_at_ms=T0 + 3_000)
    assert clock.now_ms == T0 + 1_900 and clock.holder() == "us.rollouts"  # the region's proof, less the skew


def test_mirror_end_is_refused_for_a_local_partition_and_mirrored_names_must_be_inputs():
    with pytest.raises(ValueError, match="not input partitions"):
        LogClock(ROLES, mirrored=["us.rollouts"])
    with pytest.raises(ValueError, match="use end_offset"):
        LogClock(REGIONAL, mirrored=["us.rollouts"]).mirror_end("rollouts", position=0, copied_end=0, region_asked_at_ms=T0)
