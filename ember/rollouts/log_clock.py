"""The clock the ETL's reward and group deadlines run on: time in the log, not the wall clock while not reading.

A deadline decides that something did not arrive in time. That is only true when everything stamped
before the deadline has been read; while a rebalance, an unreachable broker or a slow fetch leaves
data in the partition unread, the wall clock keeps running but the decision must wait. So each input
partition of a shard has a *frontier*, a time before which nothing unread can be stamped, and it moves
on only by evidence from the log:

- reading a message moves it to the message's timestamp (no later than the wall clock at the read, so a
  producer whose clock runs ahead cannot fire deadlines early);
- end offsets asked for at wall time t, with the read position at or past them, move it to t: all that
  was appended before t has been read. An answer proves nothing about later times, so a stale end
  offset (from before a poll, or cached across a rebalance) can never carry the frontier to "now".

The shard's clock is its lowest frontier and never goes back. Pure logic: no Kafka client code.
"""

from __future__ import annotations

from collections.abc import Iterable


class LogClock:
    """One shard's decision clock over its input partitions (named by role, e.g. rollouts and rewards)."""

    def __init__(self, partitions: Iterable[str]):
        self._frontiers: dict[str, int | None] = {p: None for p in partitions}
        if not self._frontiers:
            raise ValueError("a LogClock needs at least one input partition")
        self._now = 0

    def read(self, partition: str, timestamp_ms: int, wall_ms: int) -> None:
        """A message stamped `timestamp_ms` was read from `partition` at wall time `wall_ms`."""
        self._advance(partition, min(timestamp_ms, wall_ms))

    def end_offset(self, partition: str, *, position: int, end: int, asked_at_ms: int) -> bool:
        """The broker said `partition` ends at `end`, asked at wall time `asked_at_ms`, and the reader is at
        `position`: if it has read up to that end, nothing unread was appended before `asked_at_ms`.
        Returns whether the partition was caught up."""
        if position < end:
            return False
        self._advance(partition, asked_at_ms)
        return True

    def _advance(self, partition: str, at_ms: int) -> None:
        if partition not in self._frontiers:
            raise KeyError(f"{partition!r} is not an input partition of this clock ({', '.join(self._frontiers)})")
        current = self._frontiers[partition]
        self._frontiers[partition] = at_ms if current is None else max(current, at_ms)

    @property
    def now_ms(self) -> int:
        """The lowest frontier (0 until every partition has one); never decreases."""
        frontiers = self._frontiers.values()
        if all(f is not None for f in frontiers):
            self._now = max(self._now, min(f for f in frontiers if f is not None))
        return self._now
