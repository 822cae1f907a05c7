"""RL records: `Rollout` (from inference workers), `Reward` (from graders), `TrainBatch` (to the trainer).

Per-token arrays are numpy arrays of fixed dtypes so they move through the wire codec and Arrow
without per-token Python work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ember.schemas.errors import FieldIssue, raise_if_issues
from ember.schemas.versioning import versioned_schema

ROLLOUT_SCHEMA_VERSION = 2  # 2: episode segments (episode_id ... summary_end); a version-1 rollout is a one-segment episode
REWARD_SCHEMA_VERSION = 1
TRAIN_BATCH_SCHEMA_VERSION = 1

TURN_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool", "summary")
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "tool_error", "abort", "timeout")
MAX_EXPERTS_UINT8 = 256
MAX_ID_CHARS = 256  # ids and names become Kafka keys and ledger fields: bounded, so one record stays small
INT64_MAX = 2**63 - 1
MAX_SEGMENTS = 4096  # segments of one episode: bounded, so a hostile index cannot make the ETL wait for millions


def routed_experts_dtype(num_experts: int) -> np.dtype:
    """uint8 while expert ids fit (<= 256 experts), else uint16: 488 B/token at 61 layers x top-8."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if num_experts <= MAX_EXPERTS_UINT8:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    raise ValueError(f"num_experts {num_experts} does not fit in uint16 expert ids")


@dataclass(frozen=True)
class Turn:
    """A span [start, end) of a rollout's tokens produced by one role."""

    role: str
    start: int
    end: int


def _array_issues(name: str, array: object, dtype: np.dtype, length: int | None) -> list[FieldIssue]:
    if not isinstance(array, np.ndarray):
        return [FieldIssue(name, f"must be a numpy array, got {type(array).__name__}")]
    issues = []
    if array.dtype != dtype:
        issues.append(FieldIssue(name, f"dtype {array.dtype} != {dtype}"))
    if length is not None and (array.ndim != 1 or len(array) != length):
        issues.append(FieldIssue(name, f"shape {array.shape} != ({length},) (one value per token)"))
    return issues


# Estimators of single-sample baselines (product completions): no group normalisation, so every loss normaliser
# may train their advantages, next to a group estimator's in one batch.
SINGLE_SAMPLE_ESTIMATOR_PREFIX = "product_"


def _name_issues(record: object, names: tuple[str, ...], *, required: bool = True) -> list[FieldIssue]:
    found = []
    for name in names:
        value = getattr(record, name)
        if required and not value:
            found.append(FieldIssue(name, "must be non-empty"))
        elif len(value) > MAX_ID_CHARS:
            found.append(FieldIssue(name, f"has {len(value)} characters (at most {MAX_ID_CHARS})"))
    return found


def _int64_issue(name: str, value: int, low: int = 0) -> list[FieldIssue]:
    if not low <= int(value) <= INT64_MAX:
        return [FieldIssue(name, f"must be in [{low}, 2**63 - 1], got {value}")]
    return []


@dataclass
class Rollout:
    rollout_id: str
    group_id: str
    prompt_id: str
    policy_version: int
    sampler: str
    region: str
    created_at_us: int
    tokens: np.ndarray
    loss_mask: np.ndarray
    sampler_logprobs: np.ndarray
    turns: list[Turn] = field(default_factory=list)
    routed_experts: np.ndarray | None = None
    finish_reason: str = "stop"
    truncated: bool = False
    prompt_tokens: int = 0
    # The policy version whose weights produced the last token (`policy_version`: the first). None: the record
    # predates the span (or its sampler never swaps mid-rollout), and it ended with the version it started with.
    policy_version_end: int | None = None
    # Episode segments (schema 2): a long-horizon episode is several rollouts, one per context, that share one
    # reward (sent with rollout_id = episode_id). `segments_total` is set on the last segment only (the sampler
    # learns the count when the episode ends); a segment that starts from the model's summary of the one before
    # names it (`summarises`) and where the summary lies in its tokens, [summary_start, summary_end).
    episode_id: str | None = None
    segment_index: int = 0
    segments_total: int | None = None
    summarises: str | None = None
    summary_start: int | None = None
    summary_end: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def episode_key(self) -> str:
        """The episode this rollout belongs to, and the rollout_id its reward is sent under."""
        return self.episode_id if self.episode_id is not None else self.rollout_id

    @property
    def last_policy_version(self) -> int:
        return self.policy_version if self.policy_version_end is None else self.policy_version_end

    def issues(self) -> list[FieldIssue]:
        found = _name_issues(self, ("rollout_id", "group_id", "prompt_id", "sampler"))
        found += _name_issues(self, ("region",), required=False)
        found += _int64_issue("policy_version", self.policy_version)
        if self.policy_version_end is not None:
            found += _int64_issue("policy_version_end", self.policy_version_end, low=min(self.policy_version, INT64_MAX))
        found += _int64_issue("created_at_us", self.created_at_us, low=-INT64_MAX)
        if self.finish_reason not in FINISH_REASONS:
            found.append(FieldIssue("finish_reason", f"{self.finish_reason[:40]!r} not in {FINISH_REASONS}"))
        found += _array_issues("tokens", self.tokens, np.dtype(np.uint32), None)
        if found:
            return found
        n = self.num_tokens
        found += _array_issues("loss_mask", self.loss_mask, np.dtype(np.uint8), n)
        found += _array_issues("sampler_logprobs", self.sampler_logprobs, np.dtype(np.float32), n)
        if not found:
            if np.any(self.loss_mask > 1):
                found.append(FieldIssue("loss_mask", "values must be 0 or 1"))
            if not np.all(np.isfinite(self.sampler_logprobs)):
                found.append(FieldIssue("sampler_logprobs", "must be finite on every token (prompt tokens carry 0)"))
            elif np.any(self.sampler_logprobs[self.loss_mask.astype(bool)] > 0):
                found.append(FieldIssue("sampler_logprobs", "policy tokens need log-probs <= 0"))
        if not 0 <= self.prompt_tokens <= n:
            found.append(FieldIssue("prompt_tokens", f"{self.prompt_tokens} outside [0, {n}]"))
        if self.routed_experts is not None:
            re = self.routed_experts
            if not isinstance(re, np.ndarray) or re.ndim != 3 or re.shape[0] != n:
                shape = getattr(re, "shape", None)
                found.append(FieldIssue("routed_experts", f"shape {shape} must be [tokens={n}, layers, top_k]"))
            elif re.dtype not in (np.uint8, np.uint16):
                found.append(FieldIssue("routed_experts", f"dtype {re.dtype} must be uint8 or uint16"))
        previous_end = 0
        for i, turn in enumerate(self.turns):  # only the first bad turn: a hostile rollout holds millions
            if turn.role not in TURN_ROLES:
                found.append(FieldIssue(f"turns[{i}].role", f"'{turn.role}' not in {TURN_ROLES}"))
                break
            if turn.start < previous_end:
                found.append(FieldIssue(f"turns[{i}]", f"[{turn.start}, {turn.end}) overlaps the turn ending at {previous_end}"))
                break
            if turn.start != previous_end or turn.end <= turn.start:
                found.append(FieldIssue(f"turns[{i}]", f"[{turn.start}, {turn.end}) must follow {previous_end}"))
                break
            if turn.role == "tool" and not found and self.loss_mask[turn.start : turn.end].any():
                found.append(FieldIssue(f"turns[{i}]", f"loss mask set on tool output [{turn.start}, {turn.end}): the policy did not write it"))
                break
            previous_end = turn.end
        else:
            if self.turns and previous_end != n:
                found.append(FieldIssue("turns", f"cover {previous_end} tokens of {n}"))
        return found + self._segment_issues()

    def _segment_issues(self) -> list[FieldIssue]:
        """A segment's place in its episode and its summary span (see the fields' comment)."""
        found: list[FieldIssue] = []
        index, total = self.segment_index, self.segments_total
        if self.episode_id is None:
            if index != 0 or total not in (None, 1) or self.summarises is not None:
                found.append(FieldIssue("episode_id", "segment_index, segments_total and summarises need an episode_id"))
            return found
        found += _name_issues(self, ("episode_id",))
        if not 0 <= index < MAX_SEGMENTS:
            found.append(FieldIssue("segment_index", f"{index} out of range [0, {MAX_SEGMENTS})"))
        elif total is not None and index >= total:
            found.append(FieldIssue("segment_index", f"{index} out of range [0, segments_total={total})"))
        elif total is not None and index != total - 1:
            found.append(FieldIssue("segments_total", f"{total} set on segment {index}: only the last segment ({total - 1}) carries it"))
        span = (self.summary_start, self.summary_end)
        if self.summarises is None:
            if span != (None, None):
                found.append(FieldIssue("summary_start", "a summary span needs summarises (the segment it summarises)"))
            return found
        found += _name_issues(self, ("summarises",))
        if index == 0:
            found.append(FieldIssue("summarises", "segment 0 starts the episode: it has no segment before it to summarise"))
        if None in span or not 0 <= span[0] < span[1] <= self.num_tokens:
            found.append(FieldIssue("summary_start", f"summary span [{span[0]}, {span[1]}) must be [start, end) inside the {self.num_tokens} tokens"))
        elif isinstance(self.loss_mask, np.ndarray) and len(self.loss_mask) == self.num_tokens and self.loss_mask[span[0] : span[1]].any():
            # the summary was trained in the segment that wrote it; here it is context, or its tokens count twice
            found.append(FieldIssue("loss_mask", f"set on the summary span [{span[0]}, {span[1]}): the summary is context in this segment"))
        return found

    def validate(self) -> "Rollout":
        raise_if_issues(f"Rollout {self.rollout_id or '<no id>'}", self.issues())
        return self


NO_JUDGEMENT_VERDICTS = frozenset({"malformed", "unavailable", "sandbox_error"})
"""Verdicts of a grader that reached no judgement of the completion (a judge's answer it could not parse, an endpoint
that never answered, a sandbox that could not start): their score is a placeholder, never a reward to train on."""


@dataclass
class Reward:
    rollout_id: str
    group_id: str
    grader: str
    score: float
    created_at_us: int
    components: dict[str, float] = field(default_factory=dict)
    grader_version: str | None = None  # added after v1: a reward written before it decodes with None
    verdict: str | None = None  # how the grading ended (passed, timeout, malformed, ...); None before it existed

    @property
    def judged(self) -> bool:
        """Whether `score` is the grader's judgement of the completion (see NO_JUDGEMENT_VERDICTS)."""
        return self.verdict not in NO_JUDGEMENT_VERDICTS

    def issues(self) -> list[FieldIssue]:
        found = _name_issues(self, ("rollout_id", "group_id", "grader"))
        found += _name_issues(self, tuple(n for n in ("grader_version", "verdict") if getattr(self, n) is not None))
        found += _int64_issue("created_at_us", self.created_at_us, low=-INT64_MAX)
        long_names = [n for n in self.components if len(n) > MAX_ID_CHARS]
        if long_names:
            found.append(FieldIssue("components", f"{len(long_names)} names longer than {MAX_ID_CHARS} characters"))
        if not np.isfinite(self.score):
            found.append(FieldIssue("score", f"must be finite, got {self.score}"))
        for name, value in self.components.items():  # only the first: a hostile reward holds millions
            if not np.isfinite(value):
                found.append(FieldIssue(f"components.{name}", f"must be finite, got {value}"))
                break
        return found

    def validate(self) -> "Reward":
        raise_if_issues(f"Reward for {self.rollout_id or '<no id>'}", self.issues())
        return self


@dataclass(frozen=True)
class SourceOffset:
    """Input range [start, end) of one topic partition that a batch consumed."""

    topic: str
    partition: int
    start: int
    end: int


ROLLOUT_DIGEST_BYTES = 32  # sha256 of a rollout message's value


@dataclass(frozen=True)
class RolloutRef:
    """Where a batch's rollout lives: the message at `topic[partition]@offset` whose value hashes to `sha256`.

    A claim-check TrainBatch carries these instead of the rollouts' tokens and routed experts; the trainer's
    reader fetches the messages and refuses one whose bytes are not the ones the ETL decided on."""

    topic: str
    partition: int
    offset: int
    sha256: bytes

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


@dataclass
class TrainBatch:
    """One packed training batch. Two forms on the wire:

    - inline: the per-token arrays (tokens, loss_mask, advantages, sampler_logprobs, routed_experts) in the record;
    - by reference (what the ETL writes): `rollout_refs` and per-sequence `sequence_advantages` instead of
      the per-token arrays (all None), so the rollouts' bytes cross the broker only on their way in and
      out; `ember.rollouts.batching.resolve_train_batch` rebuilds the inline form from the rollouts.
    """

    batch_id: str
    step: int
    tokens: np.ndarray | None
    loss_mask: np.ndarray | None
    advantages: np.ndarray | None
    sampler_logprobs: np.ndarray | None
    cu_seqlens: np.ndarray
    policy_versions: np.ndarray
    rollout_ids: list[str]
    source_offsets: list[SourceOffset] = field(default_factory=list)
    routed_experts: np.ndarray | None = None
    created_at_us: int = 0
    # The estimator that computed `advantages` (the ETL's advantages.estimator): the trainer refuses a
    # batch whose estimator is not the one its loss normaliser is paired with. None: not stated.
    advantage_estimator: str | None = None
    # By-reference form only: the rollouts in order, and each one's sequence advantage.
    rollout_refs: list[RolloutRef] = field(default_factory=list)
    sequence_advantages: np.ndarray | None = None
    # Each sequence's episode (its rollout's `episode_key`), so the trainer normalises an episode's segments
    # together; empty when every sequence is an episode of its own (what a batch without segments says).
    episode_ids: list[str] = field(default_factory=list)
    # Each sequence's estimator, so a batch can mix group advantages (grpo, ...) with product singles'
    # baselines (product_ema, ...); empty in batches written before it: every sequence's is `advantage_estimator`.
    advantage_estimators: list[str] = field(default_factory=list)

    @property
    def num_sequences(self) -> int:
        return len(self.rollout_ids)

    @property
    def by_reference(self) -> bool:
        return bool(self.rollout_refs)

    @property
    def sequence_estimators(self) -> list[str | None]:
        """Which estimator produced each sequence's advantage (the batch's one for batches without the column)."""
        return list(self.advantage_estimators) or [self.advantage_estimator] * self.num_sequences

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1]) if len(self.cu_seqlens) else 0

    def _reference_issues(self) -> list[FieldIssue]:
        found = [
            FieldIssue(name, "must be absent in a by-reference batch (the rollouts carry it)")
            for name in ("tokens", "loss_mask", "advantages", "sampler_logprobs", "routed_experts")
            if getattr(self, name) is not None
        ]
        if len(self.rollout_refs) != self.num_sequences:
            found.append(FieldIssue("rollout_refs", f"{len(self.rollout_refs)} references for {self.num_sequences} rollouts"))
        for i, ref in enumerate(self.rollout_refs):
            if ref.partition < 0 or not 0 <= ref.offset <= INT64_MAX or len(ref.sha256) != ROLLOUT_DIGEST_BYTES or not ref.topic:
                found.append(FieldIssue(f"rollout_refs[{i}]", f"{ref} needs a topic, offsets >= 0 and a {ROLLOUT_DIGEST_BYTES}-byte sha256"))
        found += _array_issues("sequence_advantages", self.sequence_advantages, np.dtype(np.float32), self.num_sequences)
        if not found and not np.all(np.isfinite(self.sequence_advantages)):
            found.append(FieldIssue("sequence_advantages", "must be finite"))
        return found

    def issues(self) -> list[FieldIssue]:
        if self.by_reference:
            found = self._reference_issues()
            n = self.num_tokens if isinstance(self.cu_seqlens, np.ndarray) and len(self.cu_seqlens) else 0
        else:
            found = _array_issues("tokens", self.tokens, np.dtype(np.uint32), None)
            if found:
                return found
            n = len(self.tokens)
            found += _array_issues("loss_mask", self.loss_mask, np.dtype(np.uint8), n)
            found += _array_issues("advantages", self.advantages, np.dtype(np.float32), n)
            found += _array_issues("sampler_logprobs", self.sampler_logprobs, np.dtype(np.float32), n)
            if self.sequence_advantages is not None:
                found.append(FieldIssue("sequence_advantages", "only a by-reference batch carries them"))
        found += _array_issues("cu_seqlens", self.cu_seqlens, np.dtype(np.int32), self.num_sequences + 1)
        found += _array_issues("policy_versions", self.policy_versions, np.dtype(np.int64), self.num_sequences)
        if not found:
            cu = self.cu_seqlens
            if cu[0] != 0 or cu[-1] != n or np.any(np.diff(cu) <= 0):
                found.append(FieldIssue("cu_seqlens", f"must rise strictly from 0 to {n}"))
            for name in ("advantages", "sampler_logprobs"):
                if not self.by_reference and not np.all(np.isfinite(getattr(self, name))):
                    found.append(FieldIssue(name, "must be finite on every token"))
            if np.any(self.policy_versions < 0):
                found.append(FieldIssue("policy_versions", "must be >= 0"))
        found += _int64_issue("step", self.step)
        if self.routed_experts is not None and (
            self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != n
        ):
            found.append(FieldIssue("routed_experts", f"shape {self.routed_experts.shape} must be [{n}, layers, top_k]"))
        if len(set(self.rollout_ids)) != len(self.rollout_ids):
            found.append(FieldIssue("rollout_ids", "a rollout appears twice in one batch"))
        if self.episode_ids and len(self.episode_ids) != self.num_sequences:
            found.append(FieldIssue("episode_ids", f"{len(self.episode_ids)} episode ids for {self.num_sequences} sequences"))
        elif self.episode_ids and len(set(self.episode_ids)) != sum(1 for i, e in enumerate(self.episode_ids) if i == 0 or e != self.episode_ids[i - 1]):
            found.append(FieldIssue("episode_ids", "an episode's segments must be consecutive sequences"))
        if self.advantage_estimator is not None:
            found += _name_issues(self, ("advantage_estimator",))
        if self.advantage_estimators and len(self.advantage_estimators) != self.num_sequences:
            found.append(FieldIssue("advantage_estimators", f"{len(self.advantage_estimators)} estimators for {self.num_sequences} sequences"))
        elif any(not name or len(name) > MAX_ID_CHARS for name in self.advantage_estimators):
            found.append(FieldIssue("advantage_estimators", f"each must be non-empty, at most {MAX_ID_CHARS} characters"))
        return found

    def validate(self) -> "TrainBatch":
        raise_if_issues(f"TrainBatch {self.batch_id or '<no id>'}", self.issues())
        return self


ROLLOUT_SCHEMA = versioned_schema(
    "Rollout",
    ROLLOUT_SCHEMA_VERSION,
    [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("sampler", pa.string(), nullable=False),
        pa.field("region", pa.string(), nullable=False),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("turn_roles", pa.list_(pa.string()), nullable=False),
        pa.field("turn_ends", pa.list_(pa.int32()), nullable=False),
        pa.field("tokens", pa.large_list(pa.uint32()), nullable=False),
        pa.field("loss_mask", pa.large_list(pa.uint8()), nullable=False),
        pa.field("sampler_logprobs", pa.large_list(pa.float32()), nullable=False),
        pa.field("routed_experts", pa.large_binary()),
        pa.field("routed_experts_dtype", pa.string()),
        pa.field("expert_layers", pa.int32()),
        pa.field("expert_top_k", pa.int32()),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("truncated", pa.bool_(), nullable=False),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("policy_version_end", pa.int64()),
        pa.field("episode_id", pa.string()),
        pa.field("segment_index", pa.int64()),
        pa.field("segments_total", pa.int64()),
        pa.field("summarises", pa.string()),
        pa.field("summary_start", pa.int64()),
        pa.field("summary_end", pa.int64()),
    ],
)

REWARD_SCHEMA = versioned_schema(
    "Reward",
    REWARD_SCHEMA_VERSION,
    [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("grader", pa.string(), nullable=False),
        pa.field("score", pa.float64(), nullable=False),
        pa.field("components", pa.map_(pa.string(), pa.float64()), nullable=False),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("grader_version", pa.string()),
        pa.field("verdict", pa.string()),
    ],
)

TRAIN_BATCH_SCHEMA = versioned_schema(
    "TrainBatch",
    TRAIN_BATCH_SCHEMA_VERSION,
    [
        pa.field("batch_id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("tokens", pa.large_list(pa.uint32()), nullable=False),
        pa.field("loss_mask", pa.large_list(pa.uint8()), nullable=False),
        pa.field("advantages", pa.large_list(pa.float32()), nullable=False),
        pa.field("sampler_logprobs", pa.large_list(pa.float32()), nullable=False),
        pa.field("cu_seqlens", pa.list_(pa.int32()), nullable=False),
        pa.field("policy_versions", pa.list_(pa.int64()), nullable=False),
        pa.field("rollout_ids", pa.list_(pa.string()), nullable=False),
        pa.field(
            "source_offsets",
            pa.list_(
                pa.struct(
                    [
                        pa.field("topic", pa.string()),
                        pa.field("partition", pa.int32()),
                        pa.field("start", pa.int64()),
                        pa.field("end", pa.int64()),
                    ]
                )
            ),
            nullable=False,
        ),
        pa.field("routed_experts", pa.large_binary()),
        pa.field("routed_experts_shape", pa.list_(pa.int32())),
        pa.field("routed_experts_dtype", pa.string()),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("advantage_estimator", pa.string()),
        pa.field("episode_ids", pa.list_(pa.string())),
        pa.field("advantage_estimators", pa.list_(pa.string())),
    ],
)


def _large_list(arrays: list[np.ndarray], dtype: np.dtype) -> pa.LargeListArray:
    """Builds a list column from per-row arrays with one concatenate, no per-element Python work."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


SEGMENT_FIELDS = ("episode_id", "segment_index", "segments_total", "summarises", "summary_start", "summary_end")


def rollouts_to_table(rollouts: list[Rollout]) -> pa.Table:
    experts = [r.routed_experts for r in rollouts]
    columns = {
        "rollout_id": pa.array([r.rollout_id for r in rollouts], pa.string()),
        "group_id": pa.array([r.group_id for r in rollouts], pa.string()),
        "prompt_id": pa.array([r.prompt_id for r in rollouts], pa.string()),
        "policy_version": pa.array([r.policy_version for r in rollouts], pa.int64()),
        "sampler": pa.array([r.sampler for r in rollouts], pa.string()),
        "region": pa.array([r.region for r in rollouts], pa.string()),
        "created_at": pa.array([r.created_at_us for r in rollouts], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        "turn_roles": pa.array([[t.role for t in r.turns] for r in rollouts], pa.list_(pa.string())),
        "turn_ends": pa.array([[t.end for t in r.turns] for r in rollouts], pa.list_(pa.int32())),
        "tokens": _large_list([r.tokens for r in rollouts], np.dtype(np.uint32)),
        "loss_mask": _large_list([r.loss_mask for r in rollouts], np.dtype(np.uint8)),
        "sampler_logprobs": _large_list([r.sampler_logprobs for r in rollouts], np.dtype(np.float32)),
        "routed_experts": pa.array([None if e is None else e.tobytes() for e in experts], pa.large_binary()),
        "routed_experts_dtype": pa.array([None if e is None else e.dtype.name for e in experts], pa.string()),
        "expert_layers": pa.array([None if e is None else e.shape[1] for e in experts], pa.int32()),
        "expert_top_k": pa.array([None if e is None else e.shape[2] for e in experts], pa.int32()),
        "finish_reason": pa.array([r.finish_reason for r in rollouts], pa.string()),
        "truncated": pa.array([r.truncated for r in rollouts], pa.bool_()),
        "prompt_tokens": pa.array([r.prompt_tokens for r in rollouts], pa.int32()),
        "policy_version_end": pa.array([r.policy_version_end for r in rollouts], pa.int64()),
        **{name: [getattr(r, name) for r in rollouts] for name in SEGMENT_FIELDS},
    }
    return pa.Table.from_pydict(columns, schema=ROLLOUT_SCHEMA)


def _list_values(column: pa.ChunkedArray, dtype: np.dtype) -> list[np.ndarray]:
    array = column.combine_chunks()
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(array))]


def table_to_rollouts(table: pa.Table) -> list[Rollout]:
    from ember.schemas.versioning import conform

    table = conform(table, ROLLOUT_SCHEMA)
    tokens = _list_values(table.column("tokens"), np.dtype(np.uint32))
    masks = _list_values(table.column("loss_mask"), np.dtype(np.uint8))
    logprobs = _list_values(table.column("sampler_logprobs"), np.dtype(np.float32))
    created = table.column("created_at").cast(pa.int64()).to_pylist()
    scalars = table.drop_columns(["tokens", "loss_mask", "sampler_logprobs", "created_at"]).to_pylist()
    rollouts = []
    for i, row in enumerate(scalars):
        experts = None
        if row["routed_experts"] is not None:
            experts = np.frombuffer(row["routed_experts"], dtype=row["routed_experts_dtype"]).reshape(
                len(tokens[i]), row["expert_layers"], row["expert_top_k"]
            )
        starts = [0] + list(row["turn_ends"][:-1])
        turns = [Turn(role, s, e) for role, s, e in zip(row["turn_roles"], starts, row["turn_ends"])]
        rollouts.append(
            Rollout(
                rollout_id=row["rollout_id"],
                group_id=row["group_id"],
                prompt_id=row["prompt_id"],
                policy_version=row["policy_version"],
                sampler=row["sampler"],
                region=row["region"],
                created_at_us=created[i],
                tokens=tokens[i],
                loss_mask=masks[i],
                sampler_logprobs=logprobs[i],
                turns=turns,
                routed_experts=experts,
                finish_reason=row["finish_reason"],
                truncated=row["truncated"],
                prompt_tokens=row["prompt_tokens"] or 0,
                policy_version_end=row["policy_version_end"],
                **{name: row[name] for name in SEGMENT_FIELDS if row[name] is not None},
            )
        )
    return rollouts


def rewards_to_table(rewards: list[Reward]) -> pa.Table:
    return pa.Table.from_pydict(
        {
            "rollout_id": [r.rollout_id for r in rewards],
            "group_id": [r.group_id for r in rewards],
            "grader": [r.grader for r in rewards],
            "score": [float(r.score) for r in rewards],
            "components": [list(r.components.items()) for r in rewards],
            "created_at": pa.array([r.created_at_us for r in rewards], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            "grader_version": [r.grader_version for r in rewards],
            "verdict": [r.verdict for r in rewards],
        },
        schema=REWARD_SCHEMA,
    )
