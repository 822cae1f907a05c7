"""The product path's spill store: one SQLite file per shard (WAL), so hours of pending completions live on
disk, not in RAM, and survive a restart.

Why SQLite rather than the compacted state topic: a pending completion is read back once, at its horizon, in
horizon order, and events update it in place; a compacted topic has no index to read "everything due by t" and
would rewrite a completion's whole record per event. SQLite gives that index, in-place updates and a bounded
page cache from the standard library.

Exactly-once with Kafka (the outbox): each checkpoint is one SQLite transaction holding every state change, the
input positions reached and the outputs made (batches, outcomes) in an `outbox`, numbered `txn`. The Kafka
transaction that follows sends that outbox and commits the input offsets with `{"product_txn": txn}` as
metadata. SQLite is the truth and Kafka follows it, so on restart (`recover`):

- Kafka's txn equals the store's: both sides agree; read on from the store's positions;
- Kafka's txn is one behind: the process died between the two commits; the store's last outbox is sent again
  (the same bytes, so nothing is lost or doubled) with the store's positions;
- anything else (the store is older than Kafka, or missing): the state dir was lost or swapped; refuse to start
  rather than lose or double pending completions.

A second process that loads the shard bumps `epoch`; every checkpoint checks it in the same transaction, so a
zombie that lost the shard cannot commit state behind the new owner's back (Kafka fences its producer likewise).
Deletes zero the freed pages (`secure_delete`), so an opted-out user's tokens do not linger in the file.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LOCK_WAIT_S = 30.0  # how long a new owner waits for the previous one to let go of the file
CACHE_KIB = 8 * 1024  # SQLite's page cache per shard: what pending completions cost in RAM, whatever their number

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS pending (
    cid TEXT PRIMARY KEY, offset INTEGER, served_ms INTEGER, horizon_ms INTEGER NOT NULL, version INTEGER,
    context TEXT, user TEXT, org TEXT, tokens INTEGER, payload BLOB, flags INTEGER NOT NULL DEFAULT 0,
    edit INTEGER NOT NULL DEFAULT 0, first_event_offset INTEGER, last_event_offset INTEGER, shown_ms INTEGER, signature TEXT
);
CREATE INDEX IF NOT EXISTS pending_due ON pending (horizon_ms, cid);
CREATE TABLE IF NOT EXISTS ready (
    cid TEXT PRIMARY KEY, seq INTEGER NOT NULL, tokens INTEGER NOT NULL, advantage REAL NOT NULL,
    estimator TEXT NOT NULL, signature TEXT NOT NULL, payload BLOB NOT NULL, offset INTEGER NOT NULL,
    event_offsets TEXT NOT NULL, ready_ms INTEGER NOT NULL, horizon_ms INTEGER NOT NULL, user TEXT, org TEXT
);
CREATE INDEX IF NOT EXISTS ready_order ON ready (seq);
CREATE TABLE IF NOT EXISTS closed (cid TEXT PRIMARY KEY, closed_ms INTEGER NOT NULL, opted_out INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS closed_age ON closed (closed_ms);
CREATE TABLE IF NOT EXISTS ema (context TEXT, version INTEGER, baseline REAL, count INTEGER, PRIMARY KEY (context, version));
CREATE TABLE IF NOT EXISTS recent (context TEXT, at_ms INTEGER, cid TEXT, reward REAL, PRIMARY KEY (context, at_ms, cid));
CREATE TABLE IF NOT EXISTS counts (version INTEGER, what TEXT, n INTEGER, PRIMARY KEY (version, what));
CREATE TABLE IF NOT EXISTS outbox (txn INTEGER, seq INTEGER, kind TEXT, payload BLOB, PRIMARY KEY (txn, seq));
"""


class StoreMismatch(RuntimeError):
    """The spill store and the Kafka commit disagree in a way that would lose or double completions."""


class Fenced(RuntimeError):
    """Another process took this shard's store over: this one must stop writing."""


@dataclass(frozen=True)
class PendingRow:
    cid: str
    offset: int | None  # None: events arrived, the completion not yet
    served_ms: int | None
    horizon_ms: int
    version: int | None
    context: str | None
    user: str | None
    org: str | None
    tokens: int | None
    payload: bytes | None
    flags: int
    edit: int
    first_event_offset: int | None
    last_event_offset: int | None
    shown_ms: int | None  # log time of the first 'shown' event
    signature: str | None  # routed-expert layout: which completions may share a batch


class PendingStore:
    """The spill store of one shard. Every write happens inside the open transaction, made durable by
    `commit` only; `close` without it rolls the transaction back, as a crash would."""

    def __init__(self, path: str | Path, *, durable: bool = True):
        """`durable=False` skips fsync: a killed process still loses nothing (the OS has the pages), a power cut may;
        for tests and benchmarks."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=LOCK_WAIT_S)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if durable else 'OFF'}")  # a commit is the promise Kafka's builds on
        self.db.execute("PRAGMA secure_delete=ON")
        self.db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
        self.db.executescript(_SCHEMA)
        self.epoch = self._take_over()
        self.db.execute("BEGIN IMMEDIATE")

    def _take_over(self) -> int:
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:  # a zombie owner still holds it: the service retries, as on a Kafka error
            raise TimeoutError(f"{self.path}: {exc} (another process still owns this shard's spill store)") from None
        epoch = self.get("epoch", 0) + 1
        self.set("epoch", epoch)
        self.db.execute("COMMIT")
        return epoch

    # ---- meta ----

    def get(self, key: str, default: int | None = None) -> int | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else int(row[0])

    def set(self, key: str, value: int) -> None:
        self.db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))

    # ---- pending ----

    def pending(self, cid: str) -> PendingRow | None:
        row = self.db.execute("SELECT * FROM pending WHERE cid = ?", (cid,)).fetchone()
        return None if row is None else PendingRow(*row)

    def put_pending(self, row: PendingRow) -> None:
        self.db.execute("INSERT OR REPLACE INTO pending VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", tuple(row.__dict__.values()))

    def put_pending_many(self, rows: list[tuple]) -> None:
        """Bulk insert of fresh served completions (same column order as `PendingRow`)."""
        self.db.executemany("INSERT INTO pending VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)

    def drop_pending(self, cid: str) -> None:
        self.db.execute("DELETE FROM pending WHERE cid = ?", (cid,))

    def due(self, now_ms: int, limit: int = 1000) -> list[PendingRow]:
        """The pending rows whose horizon is at or before `now_ms`, oldest horizon first."""
        rows = self.db.execute(
            "SELECT * FROM pending WHERE horizon_ms <= ? ORDER BY horizon_ms, cid LIMIT ?", (now_ms, limit)
        ).fetchall()
        return [PendingRow(*r) for r in rows]

    def next_horizon_ms(self) -> int | None:
        row = self.db.execute("SELECT MIN(horizon_ms) FROM pending").fetchone()
        return row[0]

    def pending_count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM pending").fetchone()[0])

    def pending_of(self, users: frozenset[str], orgs: frozenset[str]) -> Iterator[tuple[str, str]]:
        """Pending and ready completions of these users or organisations (for an opt-out added while they wait).
        A scan, not an index: opt-outs change rarely, and an index per id column would double the cost of
        every insert (a million pending rows are scanned in about a second)."""
        for table in ("pending", "ready"):
            for column, ids in (("user", users), ("org", orgs)):
                for ident in sorted(ids):
                    for (cid,) in self.db.execute(f"SELECT cid FROM {table} WHERE {column} = ?", (ident,)).fetchall():
                        yield cid, table  # (completion id, "pending" or "ready")

    # ---- ready ----

    def put_ready(self, values: tuple) -> None:
        self.db.execute("INSERT INTO ready VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", values)

    def ready_rows(self) -> list[tuple]:
        return self.db.execute(
            "SELECT cid, tokens, advantage, estimator, signature, payload, offset, event_offsets, ready_ms, horizon_ms "
            "FROM ready ORDER BY seq"
        ).fetchall()

    def ready_head(self) -> tuple[int, int] | None:
        """(tokens waiting, ready time of the oldest), or None when nothing waits."""
        row = self.db.execute("SELECT SUM(tokens), MIN(ready_ms) FROM ready").fetchone()
        return None if row[0] is None else (int(row[0]), int(row[1]))

    def ready_row(self, cid: str) -> tuple[int, int, bytes]:
        """(served offset, tokens, encoded rollout) of a scored completion waiting for its batch."""
        offset, tokens, payload = self.db.execute("SELECT offset, tokens, payload FROM ready WHERE cid = ?", (cid,)).fetchone()
        return int(offset), int(tokens), bytes(payload)

    def drop_ready(self, cid: str) -> None:
        self.db.execute("DELETE FROM ready WHERE cid = ?", (cid,))

    # ---- closed ----

    def closed(self, cid: str) -> bool | None:
        """None: not decided (within the dedup window); else whether it was dropped for an opt-out."""
        row = self.db.execute("SELECT opted_out FROM closed WHERE cid = ?", (cid,)).fetchone()
        return None if row is None else bool(row[0])

    def close_id(self, cid: str, at_ms: int, *, opted_out: bool = False) -> None:
        self.db.execute("INSERT OR REPLACE INTO closed VALUES (?, ?, ?)", (cid, at_ms, int(opted_out)))

    def expire_closed(self, before_ms: int) -> None:
        self.db.execute("DELETE FROM closed WHERE closed_ms < ?", (before_ms,))

    # ---- baselines ----

    def ema(self, context: str, version: int) -> tuple[float, int]:
        """This version's (baseline, count) for the context, else the newest earlier version's, else (0, 0)."""
        row = self.db.execute(
            "SELECT baseline, count FROM ema WHERE context = ? AND version <= ? ORDER BY version DESC LIMIT 1",
            (context, version),
        ).fetchone()
        return (0.0, 0) if row is None else (float(row[0]), int(row[1]))

    def set_ema(self, context: str, version: int, baseline: float, count: int) -> None:
        self.db.execute("INSERT OR REPLACE INTO ema VALUES (?, ?, ?, ?)", (context, version, baseline, count))

    def recent(self, context: str, since_ms: int) -> list[float]:
        rows = self.db.execute("SELECT reward FROM recent WHERE context = ? AND at_ms >= ? ORDER BY at_ms, cid", (context, since_ms))
        return [float(r[0]) for r in rows]

    def add_recent(self, context: str, at_ms: int, cid: str, reward: float, expire_before_ms: int) -> None:
        self.db.execute("INSERT OR REPLACE INTO recent VALUES (?, ?, ?, ?)", (context, at_ms, cid, reward))
        self.db.execute("DELETE FROM recent WHERE context = ? AND at_ms < ?", (context, expire_before_ms))

    # ---- per-version counts ----

    def count(self, version: int, what: str, n: int = 1) -> None:
        self.db.execute(
            "INSERT INTO counts VALUES (?, ?, ?) ON CONFLICT (version, what) DO UPDATE SET n = n + excluded.n", (version, what, n)
        )

    def counts(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for version, what, n in self.db.execute("SELECT version, what, n FROM counts ORDER BY version, what"):
            out.setdefault(int(version), {})[what] = int(n)
        return out

    # ---- transactions ----

    def commit(self, outbox: list[tuple[str, bytes]], *, new_txn: bool = True) -> int:
        """Make this transaction's changes durable; with `new_txn`, under a new txn number with `outbox` as its
        outputs (what Kafka must get), else under the current one (changes Kafka need not hear of, such as log
        time moving on). Returns the txn number."""
        if self.get("epoch") != self.epoch:
            self.db.execute("ROLLBACK")
            raise Fenced(f"{self.path}: another process (epoch {self.get('epoch')}) owns this shard now; this one had {self.epoch}")
        txn = self.get("txn", 0)
        if new_txn:
            txn += 1
            self.set("txn", txn)
            self.db.execute("DELETE FROM outbox WHERE txn < ?", (txn - 1,))  # txn - 1 stays until Kafka has txn
            self.db.executemany("INSERT INTO outbox VALUES (?, ?, ?, ?)", [(txn, i, k, p) for i, (k, p) in enumerate(outbox)])
        elif outbox:
            raise ValueError("outputs need a new txn: Kafka must receive them")
        self.db.execute("COMMIT")
        self.db.execute("BEGIN IMMEDIATE")
        return txn

    def outbox(self, txn: int) -> list[tuple[str, bytes]]:
        return [(k, bytes(p)) for k, p in self.db.execute("SELECT kind, payload FROM outbox WHERE txn = ? ORDER BY seq", (txn,))]

    def close(self) -> None:
        """Roll back what was not committed (as a crash would) and close the file."""
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")
        self.db.close()
