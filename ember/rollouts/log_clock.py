"""The order and the clock the ETL's decisions run on: time in the log, as the broker stamped it.

The input topics stamp records with `message.timestamp.type=LogAppendTime`: a timestamp is the broker's
clock when the record was appended, so within a partition timestamps follow offsets and never decrease.
A shard reads two partitions (rollouts p, rewards p); `LogClock` merges what it read into one *log order*,
by (timestamp, partition role, offset), rollouts first on a tie, and releases a message only once nothing
that comes before it in that order can still be unread. `now_ms`, the lowest timestamp anything not yet
released can carry, is the log time every record before it has been released up to: a deadline at or
before it may be decided. The replay puts the whole retained log through the same merge, so the engine is
fed the same messages in the same order on both sides and decides the same (see `ShardEngine.advance`).

What a partition may still hold unread is bounded below only by evidence:

- a message read from it: later records are stamped no earlier;
- end offsets asked for at wall time t, with the read position at or past them: what comes later is
  appended after t, so stamped no earlier than t - `skew_ms`, how far the broker's clock may lag this
  host's. This is the one assumption, and the only way wall time enters: a partition with data left
  unread (a rebalance, a broker outage, a slow or loaded consumer) holds the clock however long that lasts.

A partition without evidence yet holds the merge and the clock. Pure logic: no Kafka client code.

Mirrored partitions (`<region>.<prefix>.rollouts` in central, copied by MirrorMaker 2) are judged by their own
source's log time, with one rule each way:

- their timestamps are the regional broker's append times (the regional topics are LogAppendTime; MM2 copies the
  timestamp but not the topic setting, so central shows them as CreateTime): read records are evidence as above;
- central's end offsets say nothing about what the region has not sent yet (MM2 may be dead, the region cut off),
  so `end_offset` never raises a mirrored partition's bound. Only `mirror_end` does: the region's own cluster,
  asked at wall time t, held nothing the mirror had not copied, and the reader is at central's end of those copies.

So a region that stops flowing never lets the others' clocks advance on its behalf (its partitions hold the merge),
and a region that is merely idle does not hold anyone hostage: its own cluster proves it idle, as central does for
a local partition. Only a region that cannot be asked (down, cut off) holds the clock, for as long as that lasts:
deciding without it would judge its in-time rewards late. `holder` names the partition holding the clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")

END_OF_TIME_MS = 2**62  # end offsets "asked at the end of time": a retained log that is all there will be (the replay)


@dataclass
class _Partition(Generic[Item]):
    rank: int  # its place on a timestamp tie
    bound: int | None = None  # no record not yet read is stamped earlier; None: no evidence yet
    queue: deque[tuple[int, Item]] = field(default_factory=deque)  # read, not yet released: (timestamp, item)

    def raise_bound(self, at_ms: int) -> None:
        self.bound = at_ms if self.bound is None else max(self.bound, at_ms)


class LogClock(Generic[Item]):
    """One shard's input partitions (named by role, in tie order: rollouts, rewards) merged into log order."""

    def __init__(self, partitions: Iterable[str], *, skew_ms: int = 0, mirrored: Iterable[str] = ()):
        self._partitions = {name: _Partition[Item](rank) for rank, name in enumerate(partitions)}
        if not self._partitions:
            raise ValueError("a LogClock needs at least one input partition")
        self._mirrored = set(mirrored)
        unknown = self._mirrored - set(self._partitions)
        if unknown:
            raise ValueError(f"mirrored partitions {sorted(unknown)} are not input partitions of this clock")
        self._skew_ms = skew_ms
        self._now = 0

    def read(self, partition: str, timestamp_ms: int, item: Item) -> None:
        """A record of `partition`, stamped `timestamp_ms`, was read (in offset order); `item` waits for its turn."""
        p = self._partition(partition)
        p.queue.append((timestamp_ms, item))
        p.raise_bound(timestamp_ms)

    def end_offset(self, partition: str, *, position: int, end: int, asked_at_ms: int) -> bool:
        """The broker said `partition` ends at `end`, asked at wall time `asked_at_ms`, and the reader is at
        `position`: if that is at or past the end, nothing still unread can be stamped before
        `asked_at_ms - skew_ms`. Returns whether the partition was read to its end. A mirrored partition's bound does
        not move: central's end says nothing about what its region has not sent (see `mirror_end`)."""
        p = self._partition(partition)
        if position < end:
            return False
        if partition not in self._mirrored:
            p.raise_bound(asked_at_ms - self._skew_ms)
        return True

    def mirror_end(self, partition: str, *, position: int, copied_end: int, region_asked_at_ms: int) -> bool:
        """The mirrored `partition`'s region, asked at wall time `region_asked_at_ms`, held nothing the mirror had not
        copied into central offsets below `copied_end`, and the reader is at `position`: if that is at or past
        `copied_end`, nothing still unread can carry a region timestamp before `region_asked_at_ms - skew_ms`.
        Returns whether the partition was read to that end."""
        if partition not in self._mirrored:
            raise ValueError(f"{partition!r} is not a mirrored partition of this clock: use end_offset")
        if position < copied_end:
            return False
        self._partition(partition).raise_bound(region_asked_at_ms - self._skew_ms)
        return True

    def release(self) -> Iterator[tuple[str, Item]]:
        """The read messages, in log order, that nothing unread can come before."""
        while True:
            heads = [(p.queue[0][0], p.rank, name) for name, p in self._partitions.items() if p.queue]
            if not heads:
                return
            timestamp, rank, name = min(heads)
            for other in self._partitions.values():
                if not other.queue and (other.bound is None or (other.bound, other.rank) < (timestamp, rank)):
                    return  # `other` may still hold, unread, a record that comes first
            yield name, self._partitions[name].queue.popleft()[1]

    def proof_wanted_ms(self) -> int | None:
        """The wall time from which end offsets asked for could release the first message held back, or None when
        none is held: the service asks then rather than on its next round."""
        heads = [p.queue[0][0] for p in self._partitions.values() if p.queue]
        return min(heads) + self._skew_ms + 1 if heads else None

    def held(self) -> int:
        """Messages read but not released yet."""
        return sum(len(p.queue) for p in self._partitions.values())

    @property
    def now_ms(self) -> int:
        """The lowest timestamp a message not yet released can carry (0 until every partition has evidence); never
        decreases."""
        floors = [p.queue[0][0] if p.queue else p.bound for p in self._partitions.values()]
        if all(f is not None for f in floors):
            self._now = max(self._now, min(f for f in floors if f is not None))
        return self._now

    def holder(self) -> str:
        """The partition whose floor is lowest (one without evidence first): what the clock waits on, for status
        and metrics (a region that is cut off shows here)."""
        def floor(p: _Partition[Item]) -> int:
            if p.queue:
                return p.queue[0][0]
            return -1 if p.bound is None else p.bound

        return min(self._partitions, key=lambda name: (floor(self._partitions[name]), self._partitions[name].rank))

    def _partition(self, name: str) -> _Partition[Item]:
        if name not in self._partitions:
            raise KeyError(f"{name!r} is not an input partition of this clock ({', '.join(self._partitions)})")
        return self._partitions[name]
