"""Small JSON control records, beside the Arrow IPC data records (Rollout, Reward, TrainBatch: ember.schemas.codec).

Each is one compact UTF-8 JSON object per Kafka message, with no Arrow schema and no schema version, parsed
by `ember.schemas.wire_json.parse_json` (any bytes parse or raise DecodeError). JSON because each is a
few scalars and ids, where an Arrow IPC message would carry its whole schema every time, and because of
what each holds:

- `Outcome`: the ETL's ledger (topic `<prefix>.outcomes`), one record per emitted batch, per dropped
  rollout or reward, per dead letter. Written in the same transaction as the batches, so counting the
  ledger counts exactly what the trainer can see; `ember rollouts stats` and `tail` read it, `replay`
  writes the same objects to `outcomes.jsonl`. Its `detail` object's keys depend on the reason.
- `PolicyVersion`: the trainer (or `ember rollouts publish-policy`, `simulate`) announces each new policy
  version (topic `<prefix>.policy-versions`), with where its export is and the sha256 of its manifest once
  it is durable; samplers in any language read it with a JSON parser.
- `ShardSnapshot`: the ETL's crash-recovery state for one partition pair (topic `<prefix>.etl-state`),
  nested and of varying length; only the ETL reads it back (and `tail` prints it).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from ember.schemas.rollouts import INT64_MAX
from ember.schemas.wire_json import parse_json

OUTCOME_KINDS = ("batch", "rollout_dropped", "reward_dropped", "dead_letter")


class Reason(str, Enum):
    """Every reason an outcome can carry: a closed set, so a reason is safe as a metrics label.

    What varies per message (the decoder's message, the offending key) goes to the outcome's
    `detail` and the dead letter's headers, never into the reason.
    """

    BATCHED = "batched"
    # rollout_dropped
    DUPLICATE = "duplicate"
    LATE_ROLLOUT = "late_rollout"
    GROUP_OVERFLOW = "group_overflow"
    ROLLOUT_ID_CONFLICT = "rollout_id_conflict"
    EMPTY = "empty"
    FINISH_STOP = "finish_stop"
    FINISH_LENGTH = "finish_length"
    FINISH_TOOL_ERROR = "finish_tool_error"
    FINISH_ABORT = "finish_abort"
    FINISH_TIMEOUT = "finish_timeout"
    OVERLONG = "overlong"
    TRUNCATED = "truncated"
    STALE = "stale"
    UNREWARDED = "unrewarded"
    UNGRADED = "ungraded"
    REWARD_INCOMPLETE = "reward_incomplete"
    REWARD_NOT_FINITE = "reward_not_finite"
    ADVANTAGE_NOT_FINITE = "advantage_not_finite"
    ROUTED_EXPERTS_MISMATCH = "routed_experts_mismatch"
    BELOW_QUORUM = "below_quorum"
    ZERO_VARIANCE = "zero_variance"
    SEGMENT_CONFLICT = "segment_conflict"
    EPISODE_INCOMPLETE = "episode_incomplete"
    EPISODE_OVER_BUDGET = "episode_over_budget"
    # product path (issue 34): a served completion dropped before or at its horizon
    OPT_OUT = "opt_out"
    NO_SIGNAL = "no_signal"
    BASELINE_WARMUP = "baseline_warmup"
    # reward_dropped
    UNKNOWN_GRADER = "unknown_grader"
    LATE_REWARD = "late_reward"
    DUPLICATE_REWARD = "duplicate_reward"
    ORPHAN_REWARD = "orphan_reward"
    # dead_letter
    OVERSIZED = "oversized"
    MALFORMED = "malformed"
    INVALID_RECORD = "invalid_record"
    WRONG_TOPIC = "wrong_topic"
    KEY_MISMATCH = "key_mismatch"
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"
    SEGMENT_OUT_OF_RANGE = "segment_out_of_range"
    INTERNAL_ERROR = "internal_error"

    @staticmethod
    def finish(finish_reason: str) -> "Reason":
        return Reason(f"finish_{finish_reason}")


REASONS = frozenset(r.value for r in Reason)


def _dumps(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _loads(raw: bytes | None, what: str) -> dict[str, Any]:
    value = parse_json(raw or b"", what)  # DecodeError is a ValueError: bounded depth, ints, Unicode
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
            raise ValueError(f"outcome kind {str(self.kind)[:40]!r} not in {OUTCOME_KINDS}")
        reason = self.reason.value if isinstance(self.reason, Reason) else self.reason
        if reason not in REASONS:
            raise ValueError(f"outcome reason {str(reason)[:40]!r} is not a Reason")
        object.__setattr__(self, "reason", reason)  # the plain string: it is written as JSON and compared as text

    def encode(self) -> bytes:
        return _dumps(asdict(self))

    @staticmethod
    def decode(raw: bytes | None) -> "Outcome":
        value = _loads(raw, "outcome record")
        try:
            return Outcome(**value)
        except TypeError as exc:
            raise ValueError(f"outcome record has unexpected fields: {exc}") from None


_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_URI_CHARS = 4096


@dataclass(frozen=True)
class PolicyVersion:
    """One announced policy version. `weights_uri` and `weights_sha256` (schema 2, both or neither) say where
    its export directory lies and the sha256 of its `export.json` (format 2), the manifest that pins every
    file of the export, weights and config, by sha256 and size (`ember.midtrain.export_format`); the trainer
    announces a version only once those files are durable. Version-1 records (the integer alone, e.g. from
    `ember rollouts simulate`) still decode, with both None, and version-1 readers ignore the new keys."""

    policy_version: int
    published_at_us: int
    weights_uri: str | None = None
    weights_sha256: str | None = None

    def __post_init__(self) -> None:
        if (self.weights_uri is None) != (self.weights_sha256 is None):
            raise ValueError("a policy-version record carries weights_uri and weights_sha256 together or neither")
        if self.weights_uri is not None and not (
            isinstance(self.weights_uri, str) and 0 < len(self.weights_uri) <= MAX_URI_CHARS and "://" in self.weights_uri
        ):
            raise ValueError(f"weights_uri must be a URI (scheme://...) of at most {MAX_URI_CHARS} characters, got {str(self.weights_uri)[:60]!r}")
        if self.weights_sha256 is not None and not (isinstance(self.weights_sha256, str) and _SHA256.fullmatch(self.weights_sha256)):
            raise ValueError(f"weights_sha256 must be 64 lowercase hex digits, got {str(self.weights_sha256)[:70]!r}")

    @property
    def carries_weights(self) -> bool:
        return self.weights_uri is not None

    def encode(self) -> bytes:
        return _dumps({k: v for k, v in asdict(self).items() if v is not None})

    @staticmethod
    def decode(raw: bytes | None) -> "PolicyVersion":
        value = _loads(raw, "policy-version record")
        version, published = value.get("policy_version"), value.get("published_at_us", 0)
        if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= INT64_MAX:
            raise ValueError(f"policy_version must be an integer in [0, 2**63 - 1], got {str(version)[:40]}")
        if not isinstance(published, int) or abs(published) > INT64_MAX:
            raise ValueError(f"published_at_us must be an int64, got {str(published)[:40]}")
        return PolicyVersion(version, published, value.get("weights_uri"), value.get("weights_sha256"))

    @staticmethod
    def now(version: int, weights_uri: str | None = None, weights_sha256: str | None = None) -> "PolicyVersion":
        return PolicyVersion(version, time.time_ns() // 1000, weights_uri, weights_sha256)


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
    """A group whose every message is accounted for; remembered to recognise duplicates and late data.

    `rewarded`: the (rollout id, grader) of every reward the group consumed, so that a second copy of one (a grader
    that graded again, a mirror that copied a record twice) is a duplicate, and only a reward never seen is late."""

    group_id: str
    closed_at_ms: int
    rollout_ids: tuple[str, ...]
    rewarded: tuple[tuple[str, str], ...] = ()


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
        value["closed"] = [[c.group_id, c.closed_at_ms, list(c.rollout_ids), [list(r) for r in c.rewarded]] for c in self.closed]
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
                closed=tuple(_closed_group(*entry) for entry in value["closed"]),
                etl_instance=str(value.get("etl_instance", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"ETL state snapshot is malformed ({exc!r}); was it written by another tool?") from None


def _closed_group(group_id, closed_at_ms, rollout_ids, rewarded=()) -> ClosedGroup:
    """One entry of a snapshot's `closed`; snapshots written before `rewarded` existed have three fields."""
    return ClosedGroup(str(group_id), int(closed_at_ms), tuple(map(str, rollout_ids)), tuple((str(r), str(g)) for r, g in rewarded))
