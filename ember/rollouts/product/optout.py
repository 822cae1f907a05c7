"""Who may not be trained on: user and organisation ids, from a file or a compacted topic, either of which can
change while the ETL runs.

File format: one `user:<id>` or `org:<id>` a line; blank lines and `#` comments are ignored. Anything else is
an error naming the file and line, since a typo must not quietly let an opted-out user through.
Topic format (`<prefix>.opt-out`, compacted): the key is `user:<id>` or `org:<id>`; a value opts out, a
tombstone (no value) opts back in, so compaction keeps each id's latest word.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class OptOutError(ValueError):
    """The opt-out file cannot be read as a list of ids."""


@dataclass(frozen=True)
class OptOutList:
    users: frozenset[str] = field(default_factory=frozenset)
    orgs: frozenset[str] = field(default_factory=frozenset)

    def excludes(self, user_id: str, org_id: str) -> bool:
        return user_id in self.users or (bool(org_id) and org_id in self.orgs)

    def union(self, other: "OptOutList") -> "OptOutList":
        return OptOutList(self.users | other.users, self.orgs | other.orgs)

    @staticmethod
    def parse(text: str, source: str) -> "OptOutList":
        users, orgs = set(), set()
        for number, line in enumerate(text.splitlines(), 1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            parsed = parse_entry(entry)
            if parsed is None:
                raise OptOutError(f"{source}:{number}: {entry[:60]!r} is not 'user:<id>' or 'org:<id>'")
            (users if parsed[0] == "user" else orgs).add(parsed[1])
        return OptOutList(frozenset(users), frozenset(orgs))


def parse_entry(entry: str) -> tuple[str, str] | None:
    """`user:<id>` or `org:<id>` as (kind, id), or None when it is neither."""
    kind, sep, ident = entry.strip().partition(":")
    return (kind, ident.strip()) if sep and ident.strip() and kind in ("user", "org") else None


class OptOutLog:
    """The opt-out topic folded into a list: each record is an id's latest word (a value: out; none: back in)."""

    def __init__(self) -> None:
        self._ids: dict[str, set[str]] = {"user": set(), "org": set()}
        self._list: OptOutList | None = OptOutList()

    def apply(self, key: bytes | None, opted_out: bool, where: str) -> None:
        """One record; raises OptOutError naming `where` (topic@offset) for a key that is not an id."""
        parsed = parse_entry(key.decode("utf-8", "replace")) if key else None
        if parsed is None:
            raise OptOutError(f"{where}: key {key[:60] if key else key!r} is not 'user:<id>' or 'org:<id>'")
        kind, ident = parsed
        (self._ids[kind].add if opted_out else self._ids[kind].discard)(ident)
        self._list = None

    def current(self) -> OptOutList:
        if self._list is None:
            self._list = OptOutList(frozenset(self._ids["user"]), frozenset(self._ids["org"]))
        return self._list


class OptOutFile:
    """Re-reads the file when its size or modification time changes; `current()` is cheap to call every step."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._list = OptOutList()
        self.current()

    def current(self) -> OptOutList:
        try:
            stat = self.path.stat()
        except OSError as exc:
            raise OptOutError(f"{self.path}: cannot read the opt-out list ({exc.strerror})") from None
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            self._list = OptOutList.parse(self.path.read_text(encoding="utf-8"), str(self.path))
            self._stamp = stamp
        return self._list


class OptOutSources:
    """The file's list and the topic's as one; the union is rebuilt only when one of them changed (each returns
    the same object until it changes), since shards ask for it at every message."""

    def __init__(self, sources: list) -> None:
        self.sources = sources
        self._seen: tuple[OptOutList, ...] = ()
        self._list = OptOutList()

    def current(self) -> OptOutList:
        lists = tuple(source.current() for source in self.sources)
        if len(lists) != len(self._seen) or any(a is not b for a, b in zip(lists, self._seen)):
            self._list = OptOutList()
            for found in lists:
                self._list = self._list.union(found)
            self._seen = lists
        return self._list
