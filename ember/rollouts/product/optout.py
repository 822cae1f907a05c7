"""Who may not be trained on: user and organisation ids, from a file that can change while the ETL runs.

File format: one `user:<id>` or `org:<id>` a line; blank lines and `#` comments are ignored. Anything else is
an error naming the file and line, since a typo must not quietly let an opted-out user through.
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

    @staticmethod
    def parse(text: str, source: str) -> "OptOutList":
        users, orgs = set(), set()
        for number, line in enumerate(text.splitlines(), 1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            kind, sep, ident = entry.partition(":")
            if not sep or not ident.strip() or kind not in ("user", "org"):
                raise OptOutError(f"{source}:{number}: {entry[:60]!r} is not 'user:<id>' or 'org:<id>'")
            (users if kind == "user" else orgs).add(ident.strip())
        return OptOutList(frozenset(users), frozenset(orgs))


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
