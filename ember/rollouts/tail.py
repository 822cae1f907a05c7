"""`ember rollouts tail TOPIC`: one line per message of any ember topic, saying what is in it.

The topic's role comes from its name (`Topics(prefix).specs()`, the one place names are spelled), so
the ETL's own JSON topics (policy versions, the outcomes ledger, state snapshots) and the dead letters
(whose reason and source live in headers) are decoded as what they are, not as wire records. A message
that does not decode is shown with its position and the reason, never skipped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterator

import numpy as np
from kafka import KafkaConsumer
from kafka.consumer.fetcher import ConsumerRecord

from ember.rollouts.records import Outcome, PolicyVersion, ShardSnapshot
from ember.rollouts.topics import Topics
from ember.schemas import DecodeError, Reward, Rollout, TrainBatch, decode


def topic_role(topic: str) -> str | None:
    """'rollouts', 'outcomes', ... for a topic named by `Topics`, else None."""
    prefix, dot, _name = topic.rpartition(".")
    if not dot:
        return None
    return next((role for role, spec in Topics(prefix).specs().items() if spec.name == topic), None)


@dataclass(frozen=True)
class TailLine:
    position: str  # topic[partition]@offset
    text: str
    bad: bool = False

    def __str__(self) -> str:
        return f"{self.position} {self.text}"


def _short(value: object, width: int = 24) -> str:
    """Ids keep their head and tail (a rollout id ends in its index within the group)."""
    text = str(value)
    return text if len(text) <= width else text[: width // 2 - 1] + "…" + text[-(width // 2) :]


def _rollout(r: Rollout) -> str:
    policy_tokens = int(np.count_nonzero(r.loss_mask))
    group = "" if r.rollout_id.startswith(r.group_id) else f" group {_short(r.group_id)}"
    return (
        f"rollout {_short(r.rollout_id)}{group}{_segment(r)} v{r.policy_version} {r.num_tokens} tokens "
        f"({policy_tokens} policy) {r.finish_reason}{' truncated' if r.truncated else ''} {r.region}"
    )


def _segment(r: Rollout) -> str:
    """Where a segment sits in its episode: ' episode E segment 2/3', '2/?' before the last says the count."""
    if r.episode_id is None:
        return ""
    total = r.segments_total if r.segments_total is not None else "?"
    summary = f" from summary [{r.summary_start}, {r.summary_end})" if r.summarises is not None else ""
    tools = sum(1 for t in r.turns if t.role == "tool")
    return f" episode {_short(r.episode_id)} segment {r.segment_index + 1}/{total}{summary} {tools} tool turns"


def _reward(r: Reward) -> str:
    parts = ", ".join(f"{k}={v:.3g}" for k, v in sorted(r.components.items())[:3])
    group = "" if r.rollout_id.startswith(r.group_id) else f" group {_short(r.group_id)}"
    return f"reward {_short(r.rollout_id)}{group} {r.grader} {r.score:.4g}" + (f" ({parts})" if parts else "")


def _batch(b: TrainBatch) -> str:
    if b.by_reference:
        advantages = b.sequence_advantages if b.num_sequences else np.asarray([0.0])
    else:
        mask = np.asarray(b.loss_mask, dtype=bool)
        advantages = np.asarray(b.advantages)[mask] if mask.any() else np.asarray([0.0])
    versions = np.asarray(b.policy_versions)
    low, high = (int(versions.min()), int(versions.max())) if versions.size else (0, 0)
    groups = len({rid.rsplit("-", 1)[0] for rid in b.rollout_ids})
    episodes = f" ({len(set(b.episode_ids))} episodes)" if b.episode_ids else ""
    return (
        f"batch {_short(b.batch_id, 20)} step {b.step} {b.num_sequences} rollouts{episodes} ~{groups} groups {b.num_tokens} tokens "
        f"v{low}-{high} adv {advantages.min():.2f}..{advantages.max():.2f}"
    )


def _outcome(o: Outcome) -> str:
    if o.kind == "batch":
        low, high = o.detail.get("policy_versions", [None, None])
        return f"ledger batch {len(o.detail.get('rollout_ids', []))} rollouts {o.tokens} tokens v{low}-{high} shard {o.shard}"
    source = f" from {o.topic}[{o.partition}]@{o.offset}" if o.topic else ""
    what = f"group {_short(o.group_id)}" + (f" rollout {_short(o.rollout_id)}" if o.rollout_id else "")
    if "episode_id" in o.detail:
        what += f" of episode {_short(o.detail['episode_id'])}"
    return f"ledger {o.kind} {o.reason} {what} {o.tokens} tokens{source}"


def _dead_letter(message: ConsumerRecord) -> str:
    headers = {k: v.decode("utf-8", errors="replace") for k, v in (message.headers or [])}
    if "ember.reason" not in headers:
        raise ValueError("dead letter without an ember.reason header (not written by the ETL)")
    topic, partition, offset = (headers.get(f"ember.source_{k}", "?") for k in ("topic", "partition", "offset"))
    source = f"{topic}[{partition}]@{offset}"
    kept = f"{len(message.value)} bytes kept" if message.value is not None else "payload not kept"
    return f"dead letter {headers['ember.reason']} from {source} ({kept}): {_short(headers.get('ember.detail', ''), 60)}"


def _policy(p: PolicyVersion) -> str:
    at = datetime.fromtimestamp(p.published_at_us / 1e6, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    weights = f" weights {p.weights_uri} sha256 {p.weights_sha256[:12]}" if p.carries_weights else ""
    return f"policy version {p.policy_version} announced {at}{weights}"


def _snapshot(s: ShardSnapshot) -> str:
    pending = sum(end - start for ranges in s.pending.values() for start, end in ranges)
    positions = " ".join(f"{role}@{offset}" for role, offset in sorted(s.positions.items()))
    return f"etl state shard {s.shard} {positions} pending {pending} next step {s.next_step} closed {len(s.closed)} groups"


def _wire(value: bytes | None) -> str:
    record = decode(value or b"")
    if isinstance(record, Rollout):
        return _rollout(record)
    if isinstance(record, Reward):
        return _reward(record)
    return _batch(record)


def describe(message: ConsumerRecord) -> TailLine:
    """The one-line summary of a message, or why it does not decode as its topic's records."""
    position = f"{message.topic}[{message.partition}]@{message.offset}"
    role = topic_role(message.topic)
    try:
        if role == "dead_letter":
            text = _dead_letter(message)
        elif role == "policy_versions":
            text = _policy(PolicyVersion.decode(message.value))
        elif role == "outcomes":
            text = _outcome(Outcome.decode(message.value))
        elif role == "etl_state":
            text = _snapshot(ShardSnapshot.decode(message.value))
        else:
            text = _wire(message.value)
    except (DecodeError, ValueError) as exc:
        return TailLine(position, f"bad: {exc}", bad=True)
    return TailLine(position, text)


def read_records(consumer: KafkaConsumer, *, limit: int, idle_timeout_s: float) -> Iterator[ConsumerRecord]:
    """At most `limit` records; stops early once nothing came for `idle_timeout_s`."""
    seen = 0
    deadline = time.monotonic() + idle_timeout_s
    while seen < limit and time.monotonic() < deadline:
        batch = consumer.poll(timeout_ms=200, max_records=min(500, limit - seen))
        if batch:
            deadline = time.monotonic() + idle_timeout_s
        for messages in batch.values():
            for message in messages:
                if seen >= limit:
                    return
                seen += 1
                yield message
