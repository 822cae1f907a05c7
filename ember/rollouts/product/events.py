"""The product path's two records: a served completion (a `Rollout` plus who and where it was served) and a
user event about it, keyed by completion id.

A separate record rather than new `Rollout` fields: the group path's schema stays as it is (issue 29 bumps it
in parallel), and a served completion's privacy fields (user, org, context text) never reach a `TrainBatch`,
which carries only the inner `Rollout`. Wire form: a JSON header line, then the inner rollout in ember's codec,
so a reader needs no new Arrow schema and old readers of `Rollout` are untouched.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum

from ember.schemas import Rollout, decode, encode
from ember.schemas.rollouts import MAX_ID_CHARS

SERVED_MAGIC = b"EMBSERVED1\n"
MAX_CONTEXT_CHARS = 1 << 20  # context text past 1 MiB is not a completion's context: refuse the record


class ProductRecordError(ValueError):
    """A served completion or event that cannot be read; the message names the field and why."""


def _check_id(name: str, value: object, *, required: bool = True) -> str:
    if not isinstance(value, str):
        raise ProductRecordError(f"{name} must be a string, got {type(value).__name__}")
    if required and not value:
        raise ProductRecordError(f"{name} must be non-empty")
    if len(value) > MAX_ID_CHARS:
        raise ProductRecordError(f"{name} has {len(value)} characters (at most {MAX_ID_CHARS})")
    return value


@dataclass
class ServedCompletion:
    """One completion the product served: its rollout (tokens, sampler log-probs, routed experts, the deployed
    `policy_version`) and the product's view of it. `rollout.rollout_id` is the completion id."""

    rollout: Rollout
    session_id: str
    context_key: str  # e.g. "python/inline/test_file": the baseline's key
    user_id: str
    org_id: str = ""
    context_text: str | None = None  # the editor text around the cursor, when the product logs it
    rollout_wire: bytes | None = field(default=None, repr=False, compare=False)  # the rollout's bytes as read: stored as is

    @property
    def completion_id(self) -> str:
        return self.rollout.rollout_id

    def encode(self) -> bytes:
        header = {
            "session_id": self.session_id,
            "context_key": self.context_key,
            "user_id": self.user_id,
            "org_id": self.org_id,
            "context_text": self.context_text,
        }
        return SERVED_MAGIC + json.dumps(header, separators=(",", ":")).encode() + b"\n" + encode(self.rollout)

    @staticmethod
    def decode(raw: bytes) -> "ServedCompletion":
        if not raw.startswith(SERVED_MAGIC):
            raise ProductRecordError(f"not a served completion (expected the {SERVED_MAGIC[:-1].decode()} header)")
        body = raw[len(SERVED_MAGIC):]
        cut = body.find(b"\n")
        if cut < 0:
            raise ProductRecordError("served completion header has no end")
        try:
            header = json.loads(body[:cut])
        except ValueError as exc:
            raise ProductRecordError(f"served completion header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise ProductRecordError("served completion header must be a JSON object")
        text = header.get("context_text")
        if text is not None and (not isinstance(text, str) or len(text) > MAX_CONTEXT_CHARS):
            raise ProductRecordError(f"context_text must be a string of at most {MAX_CONTEXT_CHARS} characters")
        rollout = decode(body[cut + 1:])
        if not isinstance(rollout, Rollout):
            raise ProductRecordError(f"served completion carries a {type(rollout).__name__}, not a Rollout")
        return ServedCompletion(
            rollout,
            session_id=_check_id("session_id", header.get("session_id")),
            context_key=_check_id("context_key", header.get("context_key")),
            user_id=_check_id("user_id", header.get("user_id")),
            org_id=_check_id("org_id", header.get("org_id", ""), required=False),
            context_text=text,
            rollout_wire=body[cut + 1:],
        )


class EventKind(str, Enum):
    SHOWN = "shown"
    ACCEPTED = "accepted"
    EDITED = "edited"
    REVERTED = "reverted"
    KEPT = "kept"


@dataclass(frozen=True)
class ProductEvent:
    """What the user did with a completion. `edit_distance` only on `edited`; `kept_minutes` only on `kept`.
    Its time is the log time the broker stamped, never a field: deadlines run on the log."""

    completion_id: str
    kind: EventKind
    edit_distance: int | None = None
    kept_minutes: float | None = None

    def encode(self) -> bytes:
        value = {**asdict(self), "kind": self.kind.value}
        return json.dumps({k: v for k, v in value.items() if v is not None}, separators=(",", ":")).encode()

    @staticmethod
    def decode(raw: bytes) -> "ProductEvent":
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise ProductRecordError(f"product event is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ProductRecordError("product event must be a JSON object")
        unknown = sorted(set(value) - {"completion_id", "kind", "edit_distance", "kept_minutes"})
        if unknown:
            raise ProductRecordError(f"product event has unknown fields {unknown}")
        try:
            kind = EventKind(value.get("kind"))
        except ValueError:
            raise ProductRecordError(f"product event kind {str(value.get('kind'))[:40]!r} not in {[k.value for k in EventKind]}") from None
        distance, kept = value.get("edit_distance"), value.get("kept_minutes")
        if (distance is not None) != (kind is EventKind.EDITED):
            raise ProductRecordError("edit_distance is given on, and only on, an 'edited' event")
        if distance is not None and (not isinstance(distance, int) or isinstance(distance, bool) or distance < 0):
            raise ProductRecordError(f"edit_distance must be a non-negative integer, got {distance!r}")
        if (kept is not None) != (kind is EventKind.KEPT):
            raise ProductRecordError("kept_minutes is given on, and only on, a 'kept' event")
        if kept is not None and (not isinstance(kept, (int, float)) or isinstance(kept, bool) or not 0 <= kept < 1e7):
            raise ProductRecordError(f"kept_minutes must be a number of minutes >= 0, got {kept!r}")
        return ProductEvent(_check_id("completion_id", value.get("completion_id")), kind, distance, kept)
