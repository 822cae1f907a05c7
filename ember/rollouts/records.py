"""Small JSON control records the ETL reads and writes beside the binary data records.

- `Outcome`: the ETL's ledger (topic `<prefix>.outcomes`), one record per emitted batch, per dropped
  rollout or reward, per dead letter. Written in the same transaction as the batches, so counting the
  ledger counts exactly what the trainer can see; `ember rollouts stats` reads it.
- `PolicyVersion`: the trainer announces each new policy version (topic `<prefix>.policy-versions`).
- `ShardSnapshot`: the ETL's crash-recovery state for one partition pair (topic `<prefix>.etl-state`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

OUTCOME_KINDS = ("batch", "rollout_dropped", "reward_dropped", "dead_letter")


def _dumps(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _loads(raw: bytes | None, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Outcome:
    kind: str
    reason: str
    shard: int
    at_ms: int
    group_id: str = ""
    rollout_id: str = ""
    topic: str = ""
    partition: int = -1
    offset: int = -1
    tokens: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in OUTCOME_KINDS:
            raise ValueError(f"outcome kind '{self.kind}' not in {OUTCOME_KINDS}")

    def encode(self) -> bytes:
        return _dumps(asdict(self))

    @staticmethod
    def decode(raw: bytes | None) -> "Outcome":
        value = _loads(raw, "outcome record")
        try:
            return Outcome(**value)
        except TypeError as exc:
            raise ValueError(f"outcome record has unexpected fields: {exc}") from None


@dataclass(frozen=True)
class PolicyVersion:
    policy_version: int
    published_at_us: int

    def encode(self) -> bytes:
        return _dumps(asdict(self))

    @staticmethod
    def decode(raw: bytes | None) -> "PolicyVersion":
        value = _loads(raw, "policy-version record")
        version, published = value.get("policy_version"), value.get("published_at_us", 0)
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"policy_version must be an integer >= 0, got {version!r}")
        if not isinstance(published, int):
            raise ValueError(f"published_at_us must be an integer, got {published!r}")
        return PolicyVersion(version, published)

    @staticmethod
    def now(version: int) -> "PolicyVersion":
        return PolicyVersion(version, time.time_ns() // 1000)


def offsets_to_ranges(offsets: list[int]) -> list[list[int]]:
    """[3, 4, 5, 9] -> [[3, 6], [9, 10]]: pending offsets are mostly runs, so snapshots stay small."""
    ranges: list[list[int]] = []
    for offset in sorted(offsets):
        if ranges and ranges[-1][1] == offset:
            ranges[-1][1] = offset + 1
        else:
            ranges.append([offset, offset + 1])
    return ranges


def ranges_to_offsets(ranges: list[list[int]]) -> set[int]:
    return {o for start, end in ranges for o in range(start, end)}


@dataclass(frozen=True)
class ClosedGroup:
    """A group whose every message is accounted for; remembered to recognise duplicates and late data."""

    group_id: str
    closed_at_ms: int
    rollout_ids: tuple[str, ...]


@dataclass(frozen=True)
class ShardSnapshot:
    """What survives a crash for one shard (rollouts partition p + rewards partition p).

    `positions` are the next offsets after everything processed; `pending` the offsets still held in
    memory. On restart the ETL re-reads from the committed offset (the oldest pending one), skips what
    lies below `positions` and is not pending (already in committed output), and re-ingests the rest.
    `closed` lists only the groups closed by this snapshot's transaction; recovery unions them over the
    dedup window.
    """

    shard: int
    positions: dict[str, int]
    pending: dict[str, list[list[int]]]
    next_step: int
    closed: tuple[ClosedGroup, ...] = ()
    etl_instance: str = ""

    def encode(self) -> bytes:
        value = asdict(self)
        value["closed"] = [[c.group_id, c.closed_at_ms, list(c.rollout_ids)] for c in self.closed]
        return _dumps(value)

    @staticmethod
    def decode(raw: bytes | None) -> "ShardSnapshot":
        value = _loads(raw, "ETL state snapshot")
        try:
            return ShardSnapshot(
                shard=int(value["shard"]),
                positions={str(k): int(v) for k, v in value["positions"].items()},
                pending={str(k): [[int(a), int(b)] for a, b in v] for k, v in value["pending"].items()},
                next_step=int(value["next_step"]),
                closed=tuple(ClosedGroup(str(g), int(t), tuple(ids)) for g, t, ids in value["closed"]),
                etl_instance=str(value.get("etl_instance", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"ETL state snapshot is malformed ({exc!r}); was it written by another tool?") from None
