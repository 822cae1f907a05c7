"""The ETL's status line and exit summary stay one readable line each, whatever the counts."""

from collections import Counter

from ember.rollouts.etl import RunTotals, status_line, summary_lines

PREFIX = len("19:37:58 INFO ETL 0 ")  # the CLI's log format before the message


def test_status_line_reports_rates_unread_and_held_input_groups_and_drops_by_reason():
    """Unread input (behind on reading) and held input (read, waiting in open groups for a decision) are two
    numbers: one "lag" that counted both looked stuck on reading while rewards only waited for a timeout."""
    previous = RunTotals(batches=4, rollouts=30)
    totals = RunTotals(messages=500, batches=9, rollouts=70, dropped=Counter({"stale": 12, "duplicate": 3}))
    line = status_line(totals, previous, 10.0, unread=0, held=53, groups=5)
    assert line == "rollouts 4.0/s batches 0.5/s unread 0 held 53 in 5 groups dropped 15"
    totals = RunTotals(messages=500, batches=9, rollouts=70, dropped=Counter({"stale": 12}))
    line = status_line(totals, previous, 10.0, unread=4, held=3, groups=1)
    assert line == "rollouts 4.0/s batches 0.5/s unread 4 held 3 in 1 groups dropped 12 (stale 12)"
    one = RunTotals(dropped=Counter({"empty": 2}), dead_letters=1)
    assert status_line(one, RunTotals(), 10.0, unread=0, held=0, groups=0).endswith("dropped 2 (empty 2) dead 1")


def test_status_line_fits_100_columns_with_many_reasons_and_dead_letters():
    reasons = ["routed_experts_mismatch", "finish_tool_error", "advantage_not_finite", "stale", "unrewarded", "duplicate"]
    totals = RunTotals(rollouts=50_000, batches=500, dropped=Counter({r: 1000 + i for i, r in enumerate(reasons)}), dead_letters=123)
    line = status_line(totals, RunTotals(), 10.0, unread=99_999, held=99_999, groups=9_999)
    assert PREFIX + len(line) <= 100, line
    assert "dropped 6" in line and line.endswith("dead 123"), line


def test_summary_totals_the_run_in_short_lines():
    totals = RunTotals(
        messages=900, batches=12, rollouts=96, tokens=40_000,
        dropped=Counter({"stale": 7, "unrewarded": 2}), rewards_dropped=Counter({"late_reward": 3}), dead_letters=4,
    )
    lines = summary_lines(totals, 61.04, recoveries=1)
    text = "\n".join(lines)
    assert lines[0] == "stopped after 61.0s: 900 messages in, 12 batches, 96 rollouts"
    assert "40000 tokens batched, 9 rollouts dropped, 3 rewards dropped, 4 dead letters" in text
    assert "rollouts dropped: stale 7, unrewarded 2" in text and "rewards dropped: late_reward 3" in text
    assert "1 recoveries" in text
    assert all(PREFIX + len(line) <= 100 for line in lines), lines
