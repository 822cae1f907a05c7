"""The product path's engine for one shard: served completions (the rollouts partition) joined to user events
(the events partition, keyed by completion id) until each completion's horizon, then rewarded, baselined,
packed. Kafka-free and deterministic like `ShardEngine`: fed messages in log order, it decides everything at
log times (a message's timestamp or a horizon), never by the wall clock.

Nothing per pending completion is held in Python: it is a row in the shard's `PendingStore` (SQLite), so RAM
stays the store's page cache however many completions wait. Every served completion ends exactly once: in a
batch, or in a `rollout_dropped` outcome with its reason (opt_out, no_signal, stale, baseline_warmup, ...).
"""

from __future__ import annotations

import json
import logging
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from ember.rollouts.batching import ScoredRollout, build_train_batch, expert_signature, plan_batches
from ember.rollouts.product.baselines import BaselineKind, ema_step, loo_baseline
from ember.rollouts.product.config import JoinLimits, ProductSettings
from ember.rollouts.product.events import EventKind, ProductEvent, ProductRecordError, ServedCompletion
from ember.rollouts.product.optout import OptOutList
from ember.rollouts.product.reward import Features, evaluate
from ember.rollouts.product.store import PendingRow, PendingStore, StoreMismatch
from ember.rollouts.records import Outcome, Reason
from ember.schemas import DecodeError, Rollout, SourceOffset, TrainBatch, decode, encode
from ember.schemas.errors import InvalidRecord

SERVED, EVENTS = "served", "events"

log = logging.getLogger("ember.etl")


@dataclass(frozen=True)
class Message:
    """One input record, transport-free (the service builds it from a Kafka record)."""

    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes


@dataclass(frozen=True)
class Rejected:
    """An input record for the dead-letter topic: where it came from, why, and its bytes unless too large to keep."""

    role: str
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    reason: str
    detail: str

    def encode(self) -> bytes:
        head = {"role": self.role, "offset": self.offset, "timestamp_ms": self.timestamp_ms, "reason": self.reason,
                "detail": self.detail, "key": None if self.key is None else self.key.hex(), "kept": self.value is not None}
        return json.dumps(head).encode() + b"\n" + (self.value or b"")

    @staticmethod
    def decode(raw: bytes) -> "Rejected":
        head, _, value = raw.partition(b"\n")
        h = json.loads(head)
        key = None if h["key"] is None else bytes.fromhex(h["key"])
        return Rejected(h["role"], h["offset"], h["timestamp_ms"], key, value if h["kept"] else None, h["reason"], h["detail"])


@dataclass
class ProductOutput:
    """What one checkpoint made; the service sends it in one Kafka transaction tagged with `txn`."""

    txn: int
    batches: list[TrainBatch] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    def outbox(self) -> list[tuple[str, bytes]]:
        return (
            [("batch", encode(b)) for b in self.batches]
            + [("outcome", o.encode()) for o in self.outcomes]
            + [("dead_letter", r.encode()) for r in self.rejected]
        )

    @staticmethod
    def from_outbox(txn: int, rows: list[tuple[str, bytes]]) -> "ProductOutput":
        out = ProductOutput(txn)
        for kind, payload in rows:
            if kind == "batch":
                out.batches.append(decode(payload))
            elif kind == "outcome":
                out.outcomes.append(Outcome.decode(payload))
            else:
                out.rejected.append(Rejected.decode(payload))
        return out


def _version_counts(batch: TrainBatch) -> dict[str, int]:
    versions, counts = np.unique(batch.policy_versions, return_counts=True)
    return {str(int(v)): int(n) for v, n in zip(versions, counts)}


class ProductJoin:
    def __init__(
        self,
        settings: ProductSettings,
        limits: JoinLimits,
        store: PendingStore,
        *,
        shard: int = 0,
        topics: tuple[str, str] = ("rollouts", "events"),
        opt_out: OptOutList | None = None,
    ):
        self.settings, self.limits, self.store, self.shard = settings, limits, store, shard
        self.topics = dict(zip((SERVED, EVENTS), topics))
        self.opt_out = opt_out or OptOutList()
        self._batches: list[TrainBatch] = []
        self._outcomes: list[Outcome] = []
        self._rejected: list[Rejected] = []
        self._committed_positions = (store.get(f"pos.{SERVED}"), store.get(f"pos.{EVENTS}"))
        self.horizon_to_batch_ms: deque[int] = deque(maxlen=100_000)  # log time from horizon to batch, newest last

    # ---- restart ----

    def recover(self, kafka_txn: int | None) -> ProductOutput | None:
        """Square the store with the txn the Kafka commit carries (see `store`): the outputs to send again (also
        queued for the next checkpoint), or None."""
        mine = self.store.get("txn", 0)
        theirs = kafka_txn or 0
        if mine == theirs:
            return None
        if mine == theirs + 1:  # sent again within the next txn: its outbox then holds them too
            resent = ProductOutput.from_outbox(mine, self.store.outbox(mine))
            self._batches, self._outcomes = resent.batches + self._batches, resent.outcomes + self._outcomes
            self._rejected = resent.rejected + self._rejected
            return resent
        raise StoreMismatch(
            f"shard {self.shard}: spill store {self.store.path} is at txn {mine} but Kafka committed txn {theirs}; "
            "the state dir was lost or replaced: reset the ETL group's offsets and the state dir together, never one alone"
        )

    def position(self, role: str) -> int | None:
        """Where to read `role` from: the store's position (Kafka's committed offset follows it)."""
        return self.store.get(f"pos.{role}")

    @property
    def now_ms(self) -> int:
        return self.store.get("now_ms", 0)

    # ---- ingest ----

    def ingest(self, role: str, message: Message, *, latest_policy: int | None = None) -> None:
        """The next message in log order; what falls due before its timestamp is decided first."""
        if message.offset < self.store.get(f"pos.{role}", -1):
            return  # already in the store (the Kafka commit lagged it)
        self.advance(message.timestamp_ms, latest_policy)
        self.store.set(f"pos.{role}", message.offset + 1)
        now = self.now_ms
        size = len(message.value)
        if size > self.limits.max_message_bytes:
            self._dead_letter(role, message, Reason.OVERSIZED, f"{size} bytes > dead_letter.max_message_bytes {self.limits.max_message_bytes}", keep=False)
            return
        marks = (len(self._batches), len(self._outcomes), len(self._rejected))
        self.store.db.execute("SAVEPOINT message")  # a message is taken whole or not at all
        try:
            if role == SERVED:
                self._served(message, now)
            else:
                self._event(message, now)
        except Exception as exc:  # bad input costs this one message, never the shard
            self.store.db.execute("ROLLBACK TO message")
            del self._batches[marks[0]:], self._outcomes[marks[1]:], self._rejected[marks[2]:]
            if isinstance(exc, InvalidRecord):
                reason = Reason.INVALID_RECORD
            elif isinstance(exc, (ProductRecordError, DecodeError)):
                reason = Reason.MALFORMED
            else:
                log.exception("shard %d: %s@%d could not be taken", self.shard, self.topics[role], message.offset)
                reason = Reason.INTERNAL_ERROR
            self._dead_letter(role, message, reason, str(exc) if reason is not Reason.INTERNAL_ERROR else repr(exc))
        finally:
            self.store.db.execute("RELEASE message")

    def _dead_letter(self, role: str, message: Message, reason: Reason, detail: str, *, keep: bool = True) -> None:
        detail = detail[:1000]
        self._rejected.append(Rejected(role, message.offset, message.timestamp_ms, message.key, message.value if keep else None,
                                       reason.value, detail))
        self._outcomes.append(
            Outcome("dead_letter", reason, self.shard, message.timestamp_ms, topic=self.topics[role], partition=self.shard,
                    offset=message.offset, detail={"error": detail})
        )

    def _dropped(self, reason: Reason, cid: str, at_ms: int, *, offset: int = -1, tokens: int = 0, version: int | None = None, **detail) -> None:
        if version is not None:  # the ledger's per-version counts (`rollouts stats`) read it
            detail["policy_version"] = version
            self.store.count(version, "dropped")
        self._outcomes.append(
            Outcome("rollout_dropped", reason, self.shard, at_ms, group_id=cid, rollout_id=cid, topic=self.topics[SERVED],
                    partition=self.shard, offset=offset, tokens=tokens, detail=detail)
        )

    def _event_dropped(self, reason: Reason, cid: str, at_ms: int, offset: int) -> None:
        self._outcomes.append(
            Outcome("reward_dropped", reason, self.shard, at_ms, group_id=cid, rollout_id=cid, topic=self.topics[EVENTS],
                    partition=self.shard, offset=offset, detail={"grader": "product"})
        )

    def _served(self, message: Message, now: int) -> None:
        served = ServedCompletion.decode(message.value)
        rollout, cid = served.rollout, served.completion_id
        if message.key != cid.encode():
            self._dead_letter(SERVED, message, Reason.KEY_MISMATCH, f"key {message.key!r} is not the completion id {cid!r}")
            return
        if rollout.num_tokens and int(rollout.tokens.max()) >= self.limits.vocab_size:
            self._dead_letter(SERVED, message, Reason.TOKEN_OUT_OF_VOCAB, f"a token id >= filters.vocab_size {self.limits.vocab_size}")
            return
        existing = self.store.pending(cid)
        if self.store.closed(cid) is not None or (existing is not None and existing.payload is not None):
            self._dropped(Reason.DUPLICATE, cid, now, offset=message.offset, tokens=rollout.num_tokens)
            return
        version = rollout.policy_version
        self.store.count(version, "served")
        self.store.set("max_version", max(version, self.store.get("max_version", version)))
        if self.opt_out.excludes(served.user_id, served.org_id):
            self._opt_out(cid, now, offset=message.offset, tokens=rollout.num_tokens, version=version, early=existing)
            return
        unfit = self._unfit(rollout)
        if unfit is not None:  # decided at arrival: no reward can make it trainable, so it is never stored
            self._drop_at_arrival(cid, now, unfit, offset=message.offset, tokens=rollout.num_tokens, version=version, early=existing)
            return
        shown_ms = existing.shown_ms if existing else None
        reward = self.settings.reward
        horizon = shown_ms + reward.horizon_s * 1000 if shown_ms is not None else message.timestamp_ms + reward.unshown_horizon_s * 1000
        self.store.put_pending(
            PendingRow(
                cid, message.offset, message.timestamp_ms, int(horizon), version, served.context_key, served.user_id,
                served.org_id, rollout.num_tokens, served.rollout_wire,  # the context text is never stored (see the guide)
                existing.flags if existing else 0, existing.edit if existing else 0,
                existing.first_event_offset if existing else None, existing.last_event_offset if existing else None, shown_ms,
                repr(expert_signature(rollout)),
            )
        )

    def _unfit(self, rollout: Rollout) -> tuple[Reason, dict] | None:
        if self.limits.drop_empty and not rollout.loss_mask.any():
            return Reason.EMPTY, {}
        if rollout.num_tokens > self.limits.max_tokens:
            return Reason.OVERLONG, {"max_tokens": self.limits.max_tokens}
        return None

    def _drop_at_arrival(self, cid: str, at_ms: int, unfit: tuple[Reason, dict], *, early: PendingRow | None, **where) -> None:
        if early is not None:  # its events came first: they go with it
            self.store.drop_pending(cid)
            self._event_dropped(unfit[0], cid, at_ms, early.first_event_offset)
        self._dropped(unfit[0], cid, at_ms, **where, **unfit[1])
        self.store.close_id(cid, at_ms)

    def _event(self, message: Message, now: int) -> None:
        event = ProductEvent.decode(message.value)
        cid = event.completion_id
        if message.key != cid.encode():
            self._dead_letter(EVENTS, message, Reason.KEY_MISMATCH, f"key {message.key!r} is not the completion id {cid!r}")
            return
        closed = self.store.closed(cid)
        if closed is not None:
            self._event_dropped(Reason.OPT_OUT if closed else Reason.LATE_REWARD, cid, now, message.offset)
            return
        row = self.store.pending(cid)
        if row is None:  # the event came first: an orphan until its completion arrives
            orphan_at = message.timestamp_ms + int(self.settings.orphan_timeout_s * 1000)
            row = PendingRow(cid, None, None, orphan_at, None, None, None, None, None, None, 0, 0, None, None, None, None)
        features = Features.from_bits(row.flags, row.edit).fold(event, self.settings.reward.kept_after_min)
        flags, edit = features.to_bits()
        shown_ms, horizon = row.shown_ms, row.horizon_ms
        if event.kind is EventKind.SHOWN and shown_ms is None:
            shown_ms = message.timestamp_ms
            if row.payload is not None:
                horizon = shown_ms + int(self.settings.reward.horizon_s * 1000)
        first = row.first_event_offset if row.first_event_offset is not None else message.offset
        self.store.put_pending(
            PendingRow(cid, row.offset, row.served_ms, horizon, row.version, row.context, row.user, row.org, row.tokens,
                       row.payload, flags, edit, first, message.offset, shown_ms, row.signature)
        )

    # ---- opt-out ----

    def set_opt_out(self, opt_out: OptOutList) -> None:
        """A changed list: its users' pending and scored completions are dropped now (and deleted from the store),
        before any can reach a batch."""
        added_users, added_orgs = opt_out.users - self.opt_out.users, opt_out.orgs - self.opt_out.orgs
        self.opt_out = opt_out
        now = self.now_ms
        for cid, table in list(self.store.pending_of(added_users, added_orgs)):
            if table == "ready":
                offset, tokens, payload = self.store.ready_row(cid)
                self.store.drop_ready(cid)
                self._dropped(Reason.OPT_OUT, cid, now, offset=offset, tokens=tokens, version=decode(payload).policy_version)
                self.store.close_id(cid, now, opted_out=True)
            else:
                self._opt_out(cid, now, early=self.store.pending(cid))

    def _opt_out(self, cid: str, at_ms: int, *, offset: int = -1, tokens: int = 0, version: int | None = None, early: PendingRow | None) -> None:
        if early is not None:
            self.store.drop_pending(cid)
            offset = early.offset if early.offset is not None else offset
            tokens = early.tokens or tokens
            version = early.version if early.version is not None else version
            if early.first_event_offset is not None:
                self._event_dropped(Reason.OPT_OUT, cid, at_ms, early.first_event_offset)
        self._dropped(Reason.OPT_OUT, cid, at_ms, offset=offset, tokens=tokens, version=version)
        self.store.close_id(cid, at_ms, opted_out=True)

    # ---- time ----

    def advance(self, now_ms: int, latest_policy: int | None = None) -> None:
        """Decide every completion whose horizon is at or before `now_ms`, at its horizon, then pack."""
        while True:
            due = self.store.due(now_ms)
            if not due:
                break
            for row in due:
                self._flush_until(row.horizon_ms)
                self._set_now(row.horizon_ms)
                self._decide(row, latest_policy)
                self._pack(flush=False)
        self._flush_until(now_ms)
        self._set_now(now_ms)
        self.store.expire_closed(self.now_ms - int(self.settings.dedup_window_s * 1000))

    def _set_now(self, at_ms: int) -> None:
        if at_ms > self.now_ms:
            self.store.set("now_ms", at_ms)

    def _decide(self, row: PendingRow, latest_policy: int | None) -> None:
        now = self.now_ms
        self.store.drop_pending(row.cid)
        if row.payload is None:
            self._event_dropped(Reason.ORPHAN_REWARD, row.cid, now, row.first_event_offset)
            self.store.close_id(row.cid, now)
            return
        self.store.close_id(row.cid, now)
        version, where = row.version, dict(offset=row.offset, tokens=row.tokens, version=row.version)
        if self.opt_out.excludes(row.user, row.org):
            self.store.close_id(row.cid, now, opted_out=True)
            self._dropped(Reason.OPT_OUT, row.cid, now, **where)
            return
        latest = max(latest_policy if latest_policy is not None else version, self.store.get("max_version", version))
        lag = latest - version
        if self.limits.max_policy_lag is not None and lag > self.limits.max_policy_lag:
            self._dropped(Reason.STALE, row.cid, now, **where, lag_versions=lag, max_policy_lag=self.limits.max_policy_lag)
            return
        reward = evaluate(self.settings.reward, Features.from_bits(row.flags, row.edit))
        if reward is None:
            self._dropped(Reason.NO_SIGNAL, row.cid, now, **where)
            return
        self.store.count(version, "rewarded")
        advantage = self._advantage(row, reward, now)
        if advantage is None:
            self._dropped(Reason.BASELINE_WARMUP, row.cid, now, **where, reward=reward)
            return
        seq = self.store.get("next_seq", 0)
        self.store.set("next_seq", seq + 1)
        events = [o for o in (row.first_event_offset, row.last_event_offset) if o is not None]
        self.store.put_ready((
            row.cid, seq, row.tokens, advantage, self.settings.baseline.estimator, row.signature,
            row.payload, row.offset, json.dumps(events), now, row.horizon_ms, row.user, row.org,
        ))

    def _advantage(self, row: PendingRow, reward: float, now: int) -> float | None:
        """reward - baseline from the same context's earlier rewards (see `baselines`), then the baseline learns it;
        None while the key has fewer than `min_history` rewards."""
        settings = self.settings.baseline
        if settings.kind is BaselineKind.EMA:
            baseline, count = self.store.ema(row.context, row.version)
            self.store.set_ema(row.context, row.version, *ema_step(baseline, count, reward, settings.alpha))
            return None if count < settings.min_history else reward - baseline
        window = int(settings.window_s * 1000)
        others = self.store.recent(row.context, now - window)
        self.store.add_recent(row.context, now, row.cid, reward, now - window)
        return None if len(others) < settings.min_history else reward - loo_baseline(others)

    # ---- packing ----

    def _flush_until(self, at_ms: int) -> None:
        """Emit what waited `batches.max_wait_s`, at the log time it had waited that long, up to `at_ms`."""
        wait = int(self.limits.max_wait_s * 1000)
        while (head := self.store.ready_head()) is not None and head[1] + wait <= at_ms:
            self._set_now(head[1] + wait)
            self._pack(flush=True)

    def _pack(self, *, flush: bool) -> None:
        head = self.store.ready_head()
        if head is None or (not flush and head[0] < self.limits.min_fill * self.limits.token_budget):
            return
        rows = self.store.ready_rows()
        emit, _ = plan_batches([r[1] for r in rows], self.limits.token_budget, min_fill=self.limits.min_fill, flush=flush,
                               keys=[r[4] for r in rows])
        for members in emit:
            chosen = [rows[i] for i in members]
            scored = [ScoredRollout(decode(r[5]), float(np.float32(r[2]))) for r in chosen]
            served = [r[6] for r in chosen]
            events = [o for r in chosen for o in json.loads(r[7])]
            spans = [SourceOffset(self.topics[SERVED], self.shard, min(served), max(served) + 1)]
            if events:
                spans.append(SourceOffset(self.topics[EVENTS], self.shard, min(events), max(events) + 1))
            step = self.store.get("next_step", 0)
            self.store.set("next_step", step + 1)
            batch = build_train_batch(scored, step=step, source_offsets=spans, created_at_us=self.now_ms * 1000,
                                      advantage_estimators=[r[3] for r in chosen])
            self._batches.append(batch)
            for r, s in zip(chosen, scored):
                self.store.drop_ready(r[0])
                self.store.count(s.rollout.policy_version, "trained")
                self.horizon_to_batch_ms.append(self.now_ms - r[9])
            self._outcomes.append(
                Outcome("batch", Reason.BATCHED, self.shard, self.now_ms, tokens=batch.num_tokens,
                        detail={"batch_id": batch.batch_id, "step": step, "rollout_ids": list(batch.rollout_ids),
                                "estimators": dict(Counter(r[3] for r in chosen)), "versions": _version_counts(batch)})
            )

    # ---- checkpoint ----

    def checkpoint(self) -> ProductOutput:
        """Commit the store with this checkpoint's outputs in its outbox; the caller sends them to Kafka next,
        with `txn` and the input positions. A new txn only when there are outputs or the positions moved: exactly
        when the service has something to commit to Kafka, so Kafka is never more than one txn behind."""
        out = ProductOutput(0, self._batches, self._outcomes, self._rejected)
        positions = (self.store.get(f"pos.{SERVED}"), self.store.get(f"pos.{EVENTS}"))
        changed = bool(out.batches or out.outcomes) or positions != self._committed_positions
        out.txn = self.store.commit(out.outbox(), new_txn=changed)
        self._committed_positions = positions
        self._batches, self._outcomes, self._rejected = [], [], []
        return out

    def has_output(self) -> bool:
        return bool(self._batches or self._outcomes)

    def has_batches(self) -> bool:
        return bool(self._batches)

    def pending_count(self) -> int:
        return self.store.pending_count()
