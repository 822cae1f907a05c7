"""The ETL's processing core for one shard (rollouts partition p + rewards partition p), free of Kafka.

It is a deterministic function of the messages fed in, in log order (`LogClock`), and the policy
versions passed with them: every decision happens at a log time (a message's timestamp, a deadline, a
batch's flush time) and sees exactly the messages stamped before it, however the messages are grouped
into calls and however often `advance` is called. The live service feeds it from Kafka as `LogClock`
releases messages, `replay` feeds it the retained log through the same merge, unit tests feed it directly.

Every input message ends in exactly one place: a batch, an `Outcome` (dropped, late, duplicate, dead
letter), or still pending in memory. Pending offsets are reported so the service commits input
offsets only up to the oldest one; a group's messages stay pending until its batches are emitted, so
a crash can always rebuild the whole group from uncommitted input.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ember.rollouts.advantages import (
    combine_reward,
    group_advantages,
    is_zero_variance,
    overlong_penalty,
    staleness,
)
from ember.rollouts.batching import (
    ScoredRollout,
    build_train_batch,
    expert_signature,
    plan_batches,
)
from ember.rollouts.config import EtlConfig, TruncatedPolicy
from ember.rollouts.episodes import episode_chunks, known_total, refusal
from ember.rollouts.records import ClosedGroup, Outcome, Reason, ShardSnapshot, offsets_to_ranges, ranges_to_offsets
from ember.rollouts.topics import Topics
from ember.schemas import DecodeError, Reward, Rollout, RolloutRef, SourceOffset, TrainBatch, decode
from ember.schemas.errors import InvalidRecord

ROLLOUTS, REWARDS = "rollouts", "rewards"
MAX_DETAIL_CHARS = 1000  # free text from a message (decoder errors, keys) is cut to this in the ledger and headers

log = logging.getLogger("ember.etl")


def input_topics(topics: Topics, source: str = "groups", regions: Iterable[str] = ()) -> dict[str, str]:
    """A shard's input topics by source: the local rollouts and rewards (with `source: product` the events topic,
    user events keyed by completion id, in the rewards' role), then each region's copies that MirrorMaker 2 makes in
    central (`<region>.<prefix>.rollouts`, source `<region>.rollouts`). Sources key positions, committed marks and
    snapshots; MM2 keeps partition numbers, so partition p of every source is shard p."""
    sources = {ROLLOUTS: topics.rollouts, REWARDS: topics.events if source == "product" else topics.rewards}
    for region in regions:
        sources[f"{region}.{ROLLOUTS}"] = f"{region}.{topics.rollouts}"
        sources[f"{region}.{REWARDS}"] = f"{region}.{topics.rewards}"
    return sources


def source_kind(source: str) -> str:
    """ROLLOUTS or REWARDS: what a source's records are (`us.rewards` -> rewards)."""
    return source.rsplit(".", 1)[-1]


def mirrored_sources(sources: Iterable[str]) -> list[str]:
    """The sources a region sends through the mirror: judged by their region's log time (see `LogClock`)."""
    return [s for s in sources if "." in s]


@dataclass(frozen=True)
class InputMessage:
    """One consumed record, transport-free: where it came from, when, and its raw bytes."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True)
class DeadLetter:
    source: InputMessage
    reason: Reason
    detail: str
    payload_kept: bool


def short(text: str) -> str:
    """Free text safe for a ledger record or a Kafka header: valid UTF-8, at most MAX_DETAIL_CHARS."""
    return text.encode("utf-8", errors="backslashreplace").decode("utf-8")[:MAX_DETAIL_CHARS]


class _Refused(Exception):
    """Why a message goes to the dead-letter topic instead of into a group."""

    def __init__(self, reason: Reason, detail: str, keep: bool = True):
        super().__init__(detail)
        self.reason, self.detail, self.keep = reason, detail, keep


@dataclass
class _RewardHold:
    reward: Reward
    source: str
    offset: int
    timestamp_ms: int


@dataclass
class _Segment:
    rollout: Rollout
    source: str
    offset: int
    timestamp_ms: int
    ref: RolloutRef  # where its batch will say it lives (the trainer reads it there)


@dataclass
class _Member:
    """One sample of a group: an episode, whose segments (a plain rollout is its only one) share its rewards."""

    segments: dict[int, _Segment]
    rewards: dict[str, _RewardHold] = field(default_factory=dict)

    @property
    def ordered(self) -> list[_Segment]:
        return [self.segments[i] for i in sorted(self.segments)]

    @property
    def rollout(self) -> Rollout:
        """The first segment's rollout: what names the episode in the ledger."""
        return self.segments[min(self.segments)].rollout

    @property
    def timestamp_ms(self) -> int:
        """When its latest segment arrived: the reward of an episode comes after its last segment."""
        return max(s.timestamp_ms for s in self.segments.values())

    @property
    def complete(self) -> bool:
        return known_total({i: s.rollout for i, s in self.segments.items()}) == len(self.segments)


@dataclass
class _Group:
    group_id: str
    members: dict[str, _Member] = field(default_factory=dict)
    early: dict[str, dict[str, _RewardHold]] = field(default_factory=dict)
    first_rollout_ms: int | None = None
    first_reward_ms: int | None = None


@dataclass
class _Finished:
    """A group past its decision, waiting to be packed; its messages stay pending until then."""

    group_id: str
    sequences: list[ScoredRollout]
    positions: dict[str, tuple[tuple[str, int], tuple[tuple[str, int], ...]]]  # rollout id -> (source, offset) of it, its rewards
    outcomes: list[Outcome]
    held: dict[str, list[int]]
    rollout_ids: tuple[str, ...]
    rewarded: tuple[tuple[str, str], ...]  # (rollout id, grader) of every reward the group consumed
    finished_at_ms: int
    last_reward_ms: int
    tokens: int
    signature: tuple | None


@dataclass(frozen=True)
class EmittedBatch:
    batch: TrainBatch
    group_ids: tuple[str, ...]
    last_reward_ms: int


@dataclass
class ShardOutput:
    """Everything produced since the last checkpoint; the service writes it in one transaction."""

    batches: list[EmittedBatch] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    observations: list[tuple[str, float]] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.batches or self.outcomes or self.dead_letters)


class StateMismatch(RuntimeError):
    """The committed offsets and the ETL state snapshot disagree: the state topic was tampered with."""


def _weighable(holds: list[_RewardHold], weights: Mapping[str, float]) -> dict[str, float]:
    """Every grader's components under `<grader>.<name>`, and under the bare name when one grader alone gives it.

    Two graders may name a component alike (both say `score`): a weight on the bare name is then ambiguous and
    raises KeyError naming the qualified names to weight instead, rather than silently taking one grader's."""
    components: dict[str, float] = {}
    givers: dict[str, list[str]] = {}
    for hold in holds:
        for name, value in hold.reward.components.items():
            components[f"{hold.reward.grader}.{name}"] = value
            givers.setdefault(name, []).append(hold.reward.grader)
    ambiguous = sorted(n for n in weights if len(givers.get(n, [])) > 1)
    if ambiguous:
        name = ambiguous[0]
        raise KeyError(
            f"reward component {name!r} is given by graders {givers[name]}: weight "
            f"{' or '.join(repr(f'{g}.{name}') for g in givers[name])} instead"
        )
    components.update({name: components[f"{graders[0]}.{name}"] for name, graders in givers.items() if len(graders) == 1})
    return components


class ShardEngine:
    def __init__(
        self,
        config: EtlConfig,
        shard: int,
        topics: Topics,
        *,
        snapshot: ShardSnapshot | None = None,
        committed: dict[str, int] | None = None,
        closed: list[ClosedGroup] = (),
        now_ms: int = 0,
    ):
        """`topics` names the shard's inputs (`rollouts`, `rewards`); the rest restores a crashed shard."""
        self.config = config
        self.shard = shard
        self.topics = topics
        self.inputs = input_topics(topics, config.source, config.kafka.regions)
        self._roles = {name: source for source, name in self.inputs.items()}
        self.positions: dict[str, int] = {}
        self._replay: dict[str, tuple[int, set[int]]] = {}
        self.next_step = 0
        self.groups: dict[str, _Group] = {}
        self.finishing: dict[str, _Finished] = {}
        self.ready: list[_Finished] = []
        self.closed: OrderedDict[str, ClosedGroup] = OrderedDict()
        self._closed_delta: list[ClosedGroup] = []
        self.held: dict[str, set[int]] = {source: set() for source in self.inputs}
        self._owners: dict[str, str] = {}  # rollout_id -> group of every open or finishing group's members
        self._deadlines: list[tuple[int, str]] = []
        self._dirty: set[str] = set()
        self.now_ms = 0  # log time: the latest message timestamp or deadline decided
        self._out = ShardOutput()
        self._restore(snapshot, committed or {}, closed, now_ms)

    def _restore(self, snapshot: ShardSnapshot | None, committed: dict[str, int], closed: list[ClosedGroup], now_ms: int) -> None:
        for role, offset in committed.items():
            self.positions[role] = offset
        for group in sorted(closed, key=lambda c: c.closed_at_ms):
            self._remember_closed(group)
        self._expire_closed(now_ms)
        if snapshot is None:
            return
        self.next_step = snapshot.next_step
        for role, frontier in snapshot.positions.items():
            pending = ranges_to_offsets(snapshot.pending.get(role, []))
            start = committed.get(role)
            if start is None or start > frontier or (pending and min(pending) < start):
                raise StateMismatch(
                    f"shard {self.shard} {role}: committed offset {start} does not match the state snapshot "
                    f"(frontier {frontier}, oldest pending {min(pending) if pending else None}); "
                    "reset the ETL group's offsets and state topic together, never one alone"
                )
            if frontier > start:
                self._replay[role] = (frontier, pending)

    # ---- ingest ------------------------------------------------------------------------------

    def ingest(self, message: InputMessage, *, latest_policy: int | None = None) -> None:
        """Feed the next message in log order: what falls due before its timestamp is decided first, and a group
        it completes is decided at its timestamp, before the next message."""
        self.advance(message.timestamp_ms, latest_policy)
        self._accept(message, self.now_ms)
        due, self._dirty = self._dirty, set()
        self._decide(due, latest_policy)

    def _accept(self, message: InputMessage, now_ms: int) -> None:
        role = self._roles[message.topic]
        if message.offset < self.positions.get(role, -1):
            return
        self.positions[role] = message.offset + 1
        replay = self._replay.get(role)
        if replay is not None:
            frontier, pending = replay
            if message.offset + 1 >= frontier:
                del self._replay[role]
            if message.offset < frontier and message.offset not in pending:
                self._out.observations.append(("replay_skipped", 1.0))
                return
        try:
            record = self._admit(message, source_kind(role))
        except _Refused as refused:
            self._dead_letter(message, refused.reason, refused.detail, keep=refused.keep)
            return
        except Exception as exc:  # an input no check foresaw costs this one message, never the partition
            log.exception("shard %d: %s@%d could not be admitted", self.shard, message.topic, message.offset)
            self._dead_letter(message, Reason.INTERNAL_ERROR, repr(exc), keep=True)
            return
        if source_kind(role) == ROLLOUTS:
            self._ingest_rollout(message, record, now_ms)
        else:
            self._ingest_reward(message, record, now_ms)

    def _admit(self, message: InputMessage, role: str) -> Rollout | Reward:
        """The message's record if it may join a group, else `_Refused`; changes no state."""
        limit = self.config.dead_letter.max_message_bytes
        size = len(message.value or b"")
        if size > limit:
            raise _Refused(Reason.OVERSIZED, f"{size} bytes > dead_letter.max_message_bytes {limit}", keep=False)
        try:
            record = decode(message.value or b"")
        except InvalidRecord as exc:
            raise _Refused(Reason.INVALID_RECORD, str(exc)) from None
        except DecodeError as exc:
            raise _Refused(Reason.MALFORMED, str(exc)) from None
        expected = Rollout if role == ROLLOUTS else Reward
        if not isinstance(record, expected):
            raise _Refused(Reason.WRONG_TOPIC, f"{type(record).__name__} on the {role} topic")
        if message.key != record.group_id.encode("utf-8"):
            raise _Refused(Reason.KEY_MISMATCH, f"key {message.key!r} is not the group_id {record.group_id!r}")
        vocab = self.config.filters.vocab_size
        if isinstance(record, Rollout) and record.num_tokens and int(record.tokens.max()) >= vocab:
            position = int(np.argmax(record.tokens >= vocab))
            raise _Refused(
                Reason.TOKEN_OUT_OF_VOCAB,
                f"token id {int(record.tokens[position])} at position {position} >= filters.vocab_size {vocab}",
            )
        return record

    def _dead_letter(self, message: InputMessage, reason: Reason, detail: str, *, keep: bool) -> None:
        detail = short(detail)
        self._out.dead_letters.append(DeadLetter(message, reason, detail, keep))
        self._out.outcomes.append(
            Outcome(
                "dead_letter",
                reason,
                self.shard,
                message.timestamp_ms,
                topic=message.topic,
                partition=message.partition,
                offset=message.offset,
                detail={"error": detail},
            )
        )

    def _is_closed(self, group_id: str) -> _Finished | ClosedGroup | None:
        """The decided group (being packed, or closed within the dedup window), if `group_id` is one."""
        return self.finishing.get(group_id) or self.closed.get(group_id)

    def _open_group(self, group_id: str) -> _Group:
        group = self.groups.get(group_id)
        if group is None:
            group = self.groups[group_id] = _Group(group_id)
        return group

    def _rollout_outcome(self, reason: Reason, rollout: Rollout, at: tuple[str, int], at_ms: int, **detail: object) -> Outcome:
        """`at`: the (topic, offset) the rollout was read at."""
        return Outcome(
            "rollout_dropped",
            reason,
            self.shard,
            at_ms,
            group_id=rollout.group_id,
            rollout_id=rollout.rollout_id,
            topic=at[0],
            partition=self.shard,
            offset=at[1],
            tokens=rollout.num_tokens,
            detail=dict(detail),
        )

    def _reward_outcome(self, reason: Reason, reward: Reward, at: tuple[str, int], at_ms: int, **detail: object) -> Outcome:
        return Outcome(
            "reward_dropped",
            reason,
            self.shard,
            at_ms,
            group_id=reward.group_id,
            rollout_id=reward.rollout_id,
            topic=at[0],
            partition=self.shard,
            offset=at[1],
            detail={"grader": reward.grader, **detail},
        )

    def _ingest_rollout(self, message: InputMessage, rollout: Rollout, now_ms: int) -> None:
        closed = self._is_closed(rollout.group_id)
        if closed is not None:
            reason = Reason.DUPLICATE if rollout.rollout_id in closed.rollout_ids else Reason.LATE_ROLLOUT
            self._out.outcomes.append(self._rollout_outcome(reason, rollout, (message.topic, message.offset), now_ms))
            return
        owner = self._owners.get(rollout.rollout_id)
        if owner is not None and owner != rollout.group_id:
            # two groups sharing a rollout id could meet in one batch: ids must be unique there
            self._out.outcomes.append(
                self._rollout_outcome(Reason.ROLLOUT_ID_CONFLICT, rollout, (message.topic, message.offset), now_ms, other_group=owner)
            )
            return
        group = self._open_group(rollout.group_id)
        member = group.members.get(rollout.episode_key)
        refused = refusal({} if member is None else {i: s.rollout for i, s in member.segments.items()}, rollout)
        if refused is not None and refused[0] is Reason.SEGMENT_OUT_OF_RANGE:
            self._dead_letter(message, refused[0], refused[1], keep=True)
            return
        if refused is not None:
            detail = {} if refused[0] is Reason.DUPLICATE else {"error": refused[1]}
            self._out.outcomes.append(self._rollout_outcome(refused[0], rollout, (message.topic, message.offset), now_ms, **detail))
            return
        if member is None and len(group.members) >= self.config.groups.size:
            self._out.outcomes.append(
                self._rollout_outcome(Reason.GROUP_OVERFLOW, rollout, (message.topic, message.offset), now_ms, size=self.config.groups.size)
            )
            return
        digest = hashlib.sha256(message.value or b"").digest()
        source = self._roles[message.topic]
        segment = _Segment(rollout, source, message.offset, message.timestamp_ms, RolloutRef(message.topic, message.partition, message.offset, digest))
        self._owners[rollout.rollout_id] = rollout.group_id
        self.held[source].add(message.offset)
        self._schedule(message.timestamp_ms + self.config.rewards.timeout_s * 1000, group.group_id)
        self._dirty.add(group.group_id)
        if group.first_rollout_ms is None or message.timestamp_ms < group.first_rollout_ms:
            group.first_rollout_ms = message.timestamp_ms
            self._schedule(group.first_rollout_ms + self.config.groups.timeout_s * 1000, group.group_id)
        if member is not None:
            member.segments[rollout.segment_index] = segment
            return
        member = group.members[rollout.episode_key] = _Member({rollout.segment_index: segment})
        for grader, hold in group.early.pop(rollout.episode_key, {}).items():
            if hold.timestamp_ms >= self._reward_deadline(member):
                self.held[hold.source].discard(hold.offset)
                self._out.outcomes.append(self._reward_outcome(Reason.LATE_REWARD, hold.reward, self._at(hold), now_ms))
            else:
                member.rewards[grader] = hold
        for hold in member.rewards.values():
            self._out.observations.append(("reward_join_latency_s", max(0, hold.timestamp_ms - message.timestamp_ms) / 1e3))

    def _ingest_reward(self, message: InputMessage, reward: Reward, now_ms: int) -> None:
        graders = self.config.rewards.graders
        if graders and reward.grader not in graders:
            self._out.outcomes.append(self._reward_outcome(Reason.UNKNOWN_GRADER, reward, (message.topic, message.offset), now_ms))
            return
        closed = self._is_closed(reward.group_id)
        if closed is not None:
            repeat = (reward.rollout_id, reward.grader) in closed.rewarded
            reason = Reason.DUPLICATE_REWARD if repeat else Reason.LATE_REWARD
            self._out.outcomes.append(self._reward_outcome(reason, reward, (message.topic, message.offset), now_ms))
            return
        group = self._open_group(reward.group_id)
        member = group.members.get(reward.rollout_id)
        target = member.rewards if member is not None else group.early.setdefault(reward.rollout_id, {})
        if reward.grader in target:
            self._out.outcomes.append(self._reward_outcome(Reason.DUPLICATE_REWARD, reward, (message.topic, message.offset), now_ms))
            return
        if member is not None and message.timestamp_ms >= self._reward_deadline(member):
            self._out.outcomes.append(self._reward_outcome(Reason.LATE_REWARD, reward, (message.topic, message.offset), now_ms))
            return
        source = self._roles[message.topic]
        target[reward.grader] = _RewardHold(reward, source, message.offset, message.timestamp_ms)
        self.held[source].add(message.offset)
        if member is not None:
            latency = max(0, message.timestamp_ms - member.timestamp_ms) / 1e3
            self._out.observations.append(("reward_join_latency_s", latency))
        if group.first_reward_ms is None:
            group.first_reward_ms = message.timestamp_ms
            self._schedule(message.timestamp_ms + self.config.rewards.orphan_timeout_s * 1000, group.group_id)
        self._dirty.add(group.group_id)

    def _schedule(self, at_ms: float, group_id: str) -> None:
        heapq.heappush(self._deadlines, (math.ceil(at_ms), group_id))  # never before the deadline it stands for

    def _reward_deadline(self, member: _Member) -> int:
        return member.timestamp_ms + math.ceil(self.config.rewards.timeout_s * 1000)

    def _rewarded(self, member: _Member) -> bool:
        graders = self.config.rewards.graders
        if graders:
            return all(g in member.rewards for g in graders)
        return bool(member.rewards)

    # ---- decisions ---------------------------------------------------------------------------

    def advance(self, now_ms: int, latest_policy: int | None) -> None:
        """Move log time on to `now_ms`, the caller's proof that every message stamped before it has been fed:
        each deadline and batch flush up to it is decided at its own time, in time order."""
        while (at := self._next_event_ms()) is not None and at <= now_ms:
            self.now_ms = max(self.now_ms, at)
            due = set()
            while self._deadlines and self._deadlines[0][0] <= self.now_ms:
                due.add(heapq.heappop(self._deadlines)[1])
            self._decide(due, latest_policy)
        self.now_ms = max(self.now_ms, now_ms)
        self._expire_closed(self.now_ms)

    def _next_event_ms(self) -> int | None:
        times = [self._deadlines[0][0]] if self._deadlines else []
        if self.ready:
            times.append(self._flush_at_ms())
        return min(times, default=None)

    def waiting_on(self) -> tuple[int, str] | None:
        """The next decision only the passing of time can bring, as (log ms, what it is and which setting sets it),
        or None: what an ETL with all its input read is waiting for. Each open group is decided by time at its
        group timeout, or once full, when its last unrewarded member's reward timeout is up; a group of rewards
        alone (their rollouts never came) at the orphan timeout."""
        times = []
        if self.ready:
            times.append((self._flush_at_ms(), "a partly filled batch (batches.max_wait_s)"))
        size = self.config.groups.size
        for group_id, group in self.groups.items():
            if not group.members:
                at_ms = (group.first_reward_ms or 0) + math.ceil(self.config.rewards.orphan_timeout_s * 1000)
                times.append((at_ms, f"rewards of group {group_id} whose rollouts never came (rewards.orphan_timeout_s)"))
                continue
            deadline = (group.first_rollout_ms or 0) + math.ceil(self.config.groups.timeout_s * 1000)
            waiting = [self._reward_deadline(m) for m in group.members.values() if not self._rewarded(m)]
            incomplete = sum(1 for m in group.members.values() if not m.complete)
            if incomplete and len(group.members) == size:
                times.append((deadline, f"group {group_id}, {incomplete} of its episodes missing segments (groups.timeout_s)"))
            elif len(group.members) < size or not waiting or max(waiting) >= deadline:
                times.append((deadline, f"group {group_id}, {len(group.members)} of its {size} rollouts in (groups.timeout_s)"))
            else:
                times.append((max(waiting), f"the rewards of group {group_id} (rewards.timeout_s)"))
        return min(times, default=None)

    def _flush_at_ms(self) -> int:
        """When the oldest packed-but-waiting group's `batches.max_wait_s` is up."""
        return self.ready[0].finished_at_ms + math.ceil(self.config.batches.max_wait_s * 1000)

    def _decide(self, group_ids: set[str], latest_policy: int | None) -> None:
        for group_id in sorted(group_ids):
            group = self.groups.get(group_id)
            if group is not None:
                self._evaluate(group, self.now_ms, latest_policy)
        self._pack(self.now_ms, latest_policy)

    def _evaluate(self, group: _Group, now_ms: int, latest_policy: int | None) -> None:
        if not group.members:
            if now_ms >= (group.first_reward_ms or 0) + self.config.rewards.orphan_timeout_s * 1000:
                self._finalize(group, now_ms, latest_policy)
            return
        complete = len(group.members) == self.config.groups.size and all(
            m.complete and (self._rewarded(m) or now_ms >= self._reward_deadline(m)) for m in group.members.values()
        )
        deadline = group.first_rollout_ms + self.config.groups.timeout_s * 1000
        if complete or now_ms >= deadline:
            self._finalize(group, now_ms, latest_policy)

    def _filter(self, member: _Member, now_ms: int, latest_policy: int | None) -> tuple[Reason | None, dict]:
        """Why the episode is dropped whole (a reason of one segment drops every segment), or (None, {})."""
        if not member.complete:
            total = known_total({i: s.rollout for i, s in member.segments.items()})
            return Reason.EPISODE_INCOMPLETE, {"segments": sorted(member.segments), "segments_total": total}
        filters = self.config.filters
        if filters.drop_empty and not any(s.rollout.loss_mask.any() for s in member.segments.values()):
            return Reason.EMPTY, {}
        for segment in member.ordered:
            reason, detail = self._segment_filter(segment.rollout, now_ms, latest_policy)
            if reason is not None:
                return reason, {**detail, "segment_index": segment.rollout.segment_index} if len(member.segments) > 1 else detail
        tokens = sum(s.rollout.num_tokens for s in member.segments.values())
        if tokens > self.config.batches.token_budget:  # never split across steps, never sent over budget
            return Reason.EPISODE_OVER_BUDGET, {"tokens": tokens, "token_budget": self.config.batches.token_budget}
        if not self._rewarded(member):
            return Reason.UNREWARDED, {"graders": sorted(member.rewards)}
        unjudged = {g: h.reward.verdict for g, h in sorted(member.rewards.items()) if not h.reward.judged}
        if unjudged:  # a placeholder score is not a reward: the rollout is dropped, never trained on as a 0
            return Reason.UNGRADED, {"verdicts": unjudged}
        return None, {}

    def _segment_filter(self, rollout: Rollout, now_ms: int, latest_policy: int | None) -> tuple[Reason | None, dict]:
        filters = self.config.filters
        if rollout.finish_reason in filters.drop_finish_reasons:
            return Reason.finish(rollout.finish_reason), {}
        if rollout.num_tokens > filters.max_tokens:
            return Reason.OVERLONG, {"max_tokens": filters.max_tokens}
        if rollout.truncated and filters.truncated is TruncatedPolicy.DROP:
            return Reason.TRUNCATED, {}
        lag, age_s = staleness(rollout.policy_version, latest_policy, rollout.created_at_us, now_ms * 1000)
        if filters.max_policy_lag is not None and lag > filters.max_policy_lag:
            return Reason.STALE, {"lag_versions": lag, "age_s": round(age_s, 3), "max_policy_lag": filters.max_policy_lag}
        return None, {}

    def _reward_value(self, member: _Member) -> float:
        holds = [member.rewards[g] for g in sorted(member.rewards)]
        weights = self.config.rewards.weights
        if weights:
            value = combine_reward(_weighable(holds, weights), weights)
        else:
            value = float(sum(h.reward.score for h in holds))
        rollouts = [s.rollout for s in member.segments.values()]
        if any(r.truncated for r in rollouts) and self.config.filters.truncated is TruncatedPolicy.PENALIZE:
            value += self.config.filters.truncated_penalty
        penalty = self.config.advantages.length_penalty
        if penalty is not None:  # on the longest context: each segment is one generation under the budget
            longest = max(r.num_tokens for r in rollouts)
            value += penalty.coefficient * overlong_penalty(longest, penalty.max_tokens, penalty.cache_tokens)
        return value

    def _finalize(self, group: _Group, now_ms: int, latest_policy: int | None) -> None:
        del self.groups[group.group_id]
        valid, outcomes, held, signature = self._judge_members(group, now_ms, latest_policy)
        sequences = self._score(valid, outcomes, now_ms, latest_policy)
        if group.first_rollout_ms is not None:
            self._out.observations.append(("group_completion_s", max(0, now_ms - group.first_rollout_ms) / 1e3))
        kept = {s.rollout.rollout_id for s in sequences}
        reward_times = [h.timestamp_ms for m in group.members.values() for h in m.rewards.values()]
        finished = _Finished(
            group_id=group.group_id,
            sequences=sequences,
            positions={
                s.rollout.rollout_id: ((s.source, s.offset), tuple((h.source, h.offset) for h in m.rewards.values()))
                for m in group.members.values()
                for s in m.segments.values()
                if s.rollout.rollout_id in kept
            },
            outcomes=outcomes,
            held=held,
            rollout_ids=tuple(s.rollout.rollout_id for m in group.members.values() for s in m.ordered),
            rewarded=tuple(
                (h.reward.rollout_id, h.reward.grader)
                for holds in [*(m.rewards for m in group.members.values()), *group.early.values()]
                for h in holds.values()
            ),
            finished_at_ms=now_ms,
            last_reward_ms=max(reward_times, default=now_ms),
            tokens=sum(s.rollout.num_tokens for s in sequences),
            signature=None if signature == "unset" else signature,
        )
        if sequences:
            self.finishing[group.group_id] = finished
            self.ready.append(finished)
        else:
            self._close(finished, now_ms)

    def _judge_members(self, group: _Group, now_ms: int, latest_policy: int | None):
        """Each member kept (with its reward) or dropped with a reason; the offsets the group holds; its expert signature."""
        outcomes: list[Outcome] = []
        held: dict[str, list[int]] = {source: [] for source in self.inputs}
        valid: list[tuple[_Member, float]] = []
        signature: tuple | None | str = "unset"
        for member in group.members.values():
            for segment in member.segments.values():
                held[segment.source].append(segment.offset)
            for hold in member.rewards.values():
                held[hold.source].append(hold.offset)
            reason, detail = self._filter(member, now_ms, latest_policy)
            value = 0.0
            if reason is None:
                try:
                    value = self._reward_value(member)
                except KeyError as exc:
                    reason, detail = Reason.REWARD_INCOMPLETE, {"error": short(str(exc))}
                else:
                    if not math.isfinite(value):
                        reason, detail = Reason.REWARD_NOT_FINITE, {"reward": str(value)}
            for segment in member.ordered if reason is None else ():
                mine = expert_signature(segment.rollout)
                if signature == "unset":
                    signature = mine
                elif mine != signature:
                    reason, detail = Reason.ROUTED_EXPERTS_MISMATCH, {"expected": str(signature), "got": str(mine)}
                    break
            if reason is None:
                valid.append((member, value))
            else:
                outcomes += self._episode_outcomes(reason, member, now_ms, **detail)
        for holds in group.early.values():
            for hold in holds.values():
                held[hold.source].append(hold.offset)
                outcomes.append(self._reward_outcome(Reason.ORPHAN_REWARD, hold.reward, self._at(hold), now_ms))
        return valid, outcomes, held, signature

    def _score(
        self, valid: list[tuple[_Member, float]], outcomes: list[Outcome], now_ms: int, latest_policy: int | None
    ) -> list[ScoredRollout]:
        """The group's advantages, or every valid member dropped (below quorum, zero variance) into `outcomes`."""
        if not valid:
            return []
        if len(valid) < self.config.groups.min_samples:
            for member, _ in valid:
                outcomes += self._episode_outcomes(
                    Reason.BELOW_QUORUM, member, now_ms, usable=len(valid), quorum=self.config.groups.min_samples
                )
            return []
        raw = np.array([v for _, v in valid], dtype=np.float64)
        clip = self.config.rewards.clip
        rewards = np.clip(raw, -clip, clip)
        clipped = int(np.count_nonzero(rewards != raw))
        if clipped:
            self._out.observations.append(("rewards_clipped", float(clipped)))
        settings = self.config.advantages
        if settings.drop_zero_variance and is_zero_variance(rewards):
            for member, value in valid:
                outcomes += self._episode_outcomes(Reason.ZERO_VARIANCE, member, now_ms, reward=value)
            return []
        advantages = group_advantages(rewards, settings.estimator, settings.epsilon).astype(np.float32)
        if not np.all(np.isfinite(advantages)):
            for member, value in valid:
                outcomes += self._episode_outcomes(Reason.ADVANTAGE_NOT_FINITE, member, now_ms, reward=value)
            return []
        for (member, _), value, advantage in zip(valid, rewards.tolist(), advantages):
            lag, age_s = staleness(member.rollout.policy_version, latest_policy, member.rollout.created_at_us, now_ms * 1000)
            self._out.observations += [
                ("reward", value),
                ("advantage", float(advantage)),
                ("staleness_versions", float(lag)),
                ("staleness_seconds", age_s),
            ]
        # the episode's advantage on every segment: one outcome, one advantage, whatever the contexts
        return [ScoredRollout(s.rollout, float(a), s.ref) for (m, _), a in zip(valid, advantages) for s in m.ordered]

    def _episode_outcomes(self, reason: Reason, member: _Member, now_ms: int, **detail: object) -> list[Outcome]:
        """One ledger record per segment (each is a message to account for), all with the episode's reason."""
        if member.rollout.episode_id is not None:
            detail = {**detail, "episode_id": member.rollout.episode_id}
        return [self._rollout_outcome(reason, s.rollout, self._at(s), now_ms, **detail) for s in member.ordered]

    def _at(self, held: _Segment | _RewardHold) -> tuple[str, int]:
        return self.inputs[held.source], held.offset

    def _close(self, finished: _Finished, now_ms: int) -> None:
        self._out.outcomes.extend(finished.outcomes)
        for role, offsets in finished.held.items():
            self.held[role].difference_update(offsets)
        self.finishing.pop(finished.group_id, None)
        for rollout_id in finished.rollout_ids:
            if self._owners.get(rollout_id) == finished.group_id:
                del self._owners[rollout_id]
        if finished.rollout_ids:
            closed = ClosedGroup(finished.group_id, now_ms, finished.rollout_ids, finished.rewarded)
            self._remember_closed(closed)
            self._closed_delta.append(closed)

    def _remember_closed(self, closed: ClosedGroup) -> None:
        self.closed.pop(closed.group_id, None)
        self.closed[closed.group_id] = closed

    def _expire_closed(self, now_ms: int) -> None:
        horizon = now_ms - self.config.filters.dedup_window_s * 1000
        while self.closed:
            group_id, oldest = next(iter(self.closed.items()))
            if oldest.closed_at_ms >= horizon:
                break
            del self.closed[group_id]

    # ---- packing -----------------------------------------------------------------------------

    def _pack(self, now_ms: int, latest_policy: int | None) -> None:
        if not self.ready:
            return
        settings = self.config.batches
        flush = now_ms >= self._flush_at_ms()
        emit, waiting = plan_batches(
            [f.tokens for f in self.ready],
            settings.token_budget,
            min_fill=settings.min_fill,
            flush=flush,
            keys=[f.signature for f in self.ready],
        )
        for bin_ in emit:
            groups = [self.ready[i] for i in bin_]
            sequences = [s for g in groups for s in g.sequences]
            positions = {k: v for g in groups for k, v in g.positions.items()}
            chunks = episode_chunks(sequences, settings.token_budget)
            for chunk in chunks:
                chosen = [sequences[i] for i in chunk]
                batch = build_train_batch(
                    chosen,
                    step=self.next_step,
                    source_offsets=self._source_offsets([positions[s.rollout.rollout_id] for s in chosen]),
                    created_at_us=now_ms * 1000,
                    advantage_estimator=self.config.advantages.estimator.value,
                )
                self.next_step += 1
                ids = {s.rollout.group_id for s in chosen}
                self._out.batches.append(
                    EmittedBatch(batch, tuple(sorted(ids)), max(g.last_reward_ms for g in groups if g.group_id in ids))
                )
                sources = Counter(positions[s.rollout.rollout_id][0][0] for s in chosen)
                self._out.outcomes.append(self._batch_outcome(batch, sorted(ids), now_ms, latest_policy, sources))
            for group in groups:
                self._close(group, now_ms)
        self.ready = [self.ready[i] for i in waiting]

    def _source_offsets(self, positions: list[tuple[tuple[str, int], tuple[tuple[str, int], ...]]]) -> list[SourceOffset]:
        """One span per source the batch read from, in the sources' order (rollouts, rewards, then each region's)."""
        offsets: dict[str, list[int]] = {}
        for rollout, rewards in positions:
            for source, offset in (rollout, *rewards):
                offsets.setdefault(source, []).append(offset)
        return [
            SourceOffset(topic, self.shard, min(offsets[source]), max(offsets[source]) + 1)
            for source, topic in self.inputs.items() if source in offsets
        ]

    def _batch_outcome(
        self, batch: TrainBatch, group_ids: list[str], now_ms: int, latest_policy: int | None, sources: Counter
    ) -> Outcome:
        """The ledger's batch record; with regions, how many of its rollouts each source sent (`stats` per region)."""
        versions = batch.policy_versions
        return Outcome(
            "batch",
            Reason.BATCHED,
            self.shard,
            now_ms,
            tokens=batch.num_tokens,
            detail={
                "batch_id": batch.batch_id,
                "step": batch.step,
                "rollout_ids": list(batch.rollout_ids),
                "group_ids": group_ids,
                "policy_versions": [int(versions.min()), int(versions.max())],
                "latest_policy": latest_policy,
                **({"episodes": len(set(batch.episode_ids))} if batch.episode_ids else {}),
                **({"sources": dict(sorted(sources.items()))} if self.config.kafka.regions else {}),
            },
        )

    # ---- checkpoints -------------------------------------------------------------------------

    def pending_offsets(self, role: str) -> set[int]:
        pending = set(self.held[role])
        replay = self._replay.get(role)
        if replay is not None:
            position = self.positions.get(role, -1)
            pending |= {o for o in replay[1] if o >= position}
        return pending

    def watermarks(self) -> dict[str, int]:
        """Offsets safe to commit: everything below is in committed output (or will be with this one)."""
        marks = {}
        for role, position in self.positions.items():
            pending = self.pending_offsets(role)
            marks[role] = min(pending) if pending else position
        return marks

    def has_output(self) -> bool:
        return not self._out.empty()

    def has_batches(self) -> bool:
        return bool(self._out.batches)

    def pending_count(self) -> int:
        return sum(len(self.pending_offsets(source)) for source in self.inputs)

    def checkpoint(self, etl_instance: str = "") -> tuple[ShardOutput, ShardSnapshot, dict[str, int]]:
        """Hand over the outputs since the last checkpoint with the snapshot and offsets that go with them."""
        output, self._out = self._out, ShardOutput()
        positions = {}
        for role, position in self.positions.items():
            replay = self._replay.get(role)
            positions[role] = max(position, replay[0]) if replay else position
        snapshot = ShardSnapshot(
            shard=self.shard,
            positions=positions,
            pending={role: offsets_to_ranges(list(self.pending_offsets(role))) for role in positions},
            next_step=self.next_step,
            closed=tuple(self._closed_delta),
            etl_instance=etl_instance,
        )
        self._closed_delta = []
        return output, snapshot, self.watermarks()

    def finish(self, latest_policy: int | None) -> None:
        """The end of the log (a replay's range): time runs on past every deadline and batch flush, as it does
        live when nothing more is appended, so every group is decided and packed."""
        while (at := self._next_event_ms()) is not None:
            self.advance(at, latest_policy)
