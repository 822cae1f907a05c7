"""Synthetic agent rollouts and rewards with realistic shapes, for the demo, tests and benchmarks.

A rollout is a multi-turn episode: prompt (user), then alternating assistant and tool turns; only
assistant tokens carry loss and sampler log-probs. `plan_workload` + `publish_workload` are the load
generator behind `ember rollouts simulate`: a fleet in several regions, graders, and the faults a real
run sees (late, missing and duplicate rewards, duplicate rollouts, stale policies, malformed bytes).
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

import numpy as np
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from ember.rollouts.records import PolicyVersion
from ember.rollouts.security import KafkaSecurity
from ember.rollouts.topics import Topics
from ember.rollouts.transport import consumer_config, producer_config
from ember.schemas.codec import encode
from ember.schemas.rollouts import Reward, Rollout, Turn, routed_experts_dtype

REGIONS = ("us-east", "eu-west", "ap-south")
LARGE_VOCAB = 151_000  # a production-sized vocabulary (Qwen's is 151,936): realistic traffic for benchmarks and the demo


EXPERT_SKEW = 1.0  # Zipf exponent of expert popularity: the most popular of 256 experts gets ~16% of first picks
_DRAW_SLOTS = 1 << 16  # a draw is one uint16 into a per-layer table: probabilities to 1/65536


@functools.lru_cache(maxsize=8)
def expert_popularity(layers: int, num_experts: int, skew: float = EXPERT_SKEW) -> np.ndarray:
    """[layers, num_experts] probabilities, Zipf-like over ranks, each layer with its own ranking of the experts.

    Fixed seed: popularity is a property of the model, the same in every rollout, as a trained router's is."""
    weights = np.arange(1, num_experts + 1, dtype=np.float64) ** -skew
    order = np.random.default_rng(0).permuted(np.tile(np.arange(num_experts), (layers, 1)), axis=1)
    popularity = np.empty((layers, num_experts))
    np.put_along_axis(popularity, order, weights / weights.sum(), axis=1)
    return popularity


@functools.lru_cache(maxsize=8)
def _draw_table(layers: int, num_experts: int, skew: float) -> np.ndarray:
    """[layers, 65536] expert ids, each expert on as many slots as its probability: a draw is one table lookup."""
    cdf = np.cumsum(expert_popularity(layers, num_experts, skew), axis=1)
    slots = (np.arange(_DRAW_SLOTS) + 0.5) / _DRAW_SLOTS
    return np.stack([np.searchsorted(row, slots, side="right").clip(max=num_experts - 1) for row in cdf]).astype(np.uint16)


def distinct_top_k(rng: np.random.Generator, shape: tuple[int, ...], top_k: int, num_experts: int,
                   skew: float = EXPERT_SKEW) -> np.ndarray:
    """Expert ids [*shape, top_k] (shape's last axis is the layer), distinct within each top-k set as a router's
    are, drawn without replacement from a skewed per-layer popularity (`expert_popularity`).

    Real routing is close to incompressible; a start and a stride per token (what this drew before) compressed
    2.2x at zstd-3 and made compression look free. Each pick redraws the sets where it repeats an earlier pick
    (sampling without replacement by rejection: vectorised, and cheap because a set holds < half the mass)."""
    if top_k > num_experts:
        raise ValueError(f"top_k must be <= num_experts, got {num_experts} experts, top-{top_k}")
    layers = shape[-1] if shape else 1
    table = _draw_table(layers, num_experts, skew).reshape(-1)
    count = int(np.prod(shape[:-1], dtype=np.int64)) if shape else 1
    base = np.tile(np.arange(layers, dtype=np.int32) * _DRAW_SLOTS, count)
    picks = np.empty((top_k, base.size), dtype=np.uint16)  # one contiguous row per pick: the compares stream
    for k in range(top_k):
        picks[k] = table[base + rng.integers(0, _DRAW_SLOTS, size=base.size, dtype=np.uint16)]
        rows = np.flatnonzero((picks[:k] == picks[k]).any(axis=0))
        while rows.size:
            picks[k, rows] = table[base[rows] + rng.integers(0, _DRAW_SLOTS, size=rows.size, dtype=np.uint16)]
            rows = rows[(picks[:k, rows] == picks[k, rows]).any(axis=0)]
    return np.ascontiguousarray(picks.astype(routed_experts_dtype(num_experts)).T).reshape(*shape, top_k)


def synthetic_rollout(
    rng: np.random.Generator,
    *,
    group_id: str,
    prompt_id: str,
    num_tokens: int = 8192,
    prompt_tokens: int = 512,
    turns: int = 4,
    vocab_size: int = LARGE_VOCAB,
    layers: int | None = 61,
    top_k: int = 8,
    num_experts: int = 256,
    policy_version: int = 0,
    rollout_id: str | None = None,
    finish_reason: str | None = None,
    region: str | None = None,
    created_at_us: int | None = None,
) -> Rollout:
    prompt_tokens = min(prompt_tokens, num_tokens - 1)
    remaining = num_tokens - prompt_tokens
    cut_points = np.sort(rng.choice(np.arange(1, remaining), size=min(turns - 1, remaining - 1), replace=False))
    bounds = [0, prompt_tokens, *(prompt_tokens + cut_points).tolist(), num_tokens]
    turn_list = [Turn("user", 0, prompt_tokens)]
    loss_mask = np.zeros(num_tokens, dtype=np.uint8)
    for i, (start, end) in enumerate(zip(bounds[1:-1], bounds[2:])):
        role = "assistant" if i % 2 == 0 else "tool"
        turn_list.append(Turn(role, start, end))
        if role == "assistant":
            loss_mask[start:end] = 1
    logprobs = np.where(loss_mask == 1, -rng.exponential(0.7, num_tokens), 0.0).astype(np.float32)
    experts = None
    if layers:
        experts = distinct_top_k(rng, (num_tokens, layers), top_k, num_experts)
    finish = finish_reason or ("length" if rng.random() < 0.05 else "stop")
    return Rollout(
        rollout_id=rollout_id or uuid.uuid4().hex,
        group_id=group_id,
        prompt_id=prompt_id,
        policy_version=policy_version,
        sampler="sglang-sim/0",
        region=region or str(rng.choice(REGIONS)),
        created_at_us=created_at_us if created_at_us is not None else time.time_ns() // 1000,
        tokens=rng.integers(0, vocab_size, size=num_tokens).astype(np.uint32),
        loss_mask=loss_mask,
        sampler_logprobs=logprobs,
        turns=turn_list,
        routed_experts=experts,
        finish_reason=finish,
        truncated=finish == "length",
        prompt_tokens=prompt_tokens,
    )


def synthetic_episode(
    rng: np.random.Generator,
    *,
    episode_id: str,
    segments: int,
    num_tokens: int,
    summary_tokens: int = 8,
    turns: int = 5,
    **rollout_kwargs,
) -> list[Rollout]:
    """A long-horizon agent episode over `segments` contexts of `num_tokens` each: segment 0 starts from the
    prompt, each later one from the summary the model wrote at the end of the one before (there the closing
    assistant turn, trained; here its first `summary_tokens`, context with no loss). Turns alternate assistant
    and tool, odd `turns` so every context ends with the model's own tokens. The reward goes to `episode_id`."""
    out: list[Rollout] = []
    for index in range(segments):
        rollout = synthetic_rollout(rng, num_tokens=num_tokens, turns=turns, rollout_id=f"{episode_id}-s{index}", **rollout_kwargs)
        fields: dict = {"episode_id": episode_id, "segment_index": index}
        if index == segments - 1:
            fields["segments_total"] = segments
        if index:
            span = min(summary_tokens, rollout.prompt_tokens)
            fields.update(summarises=out[-1].rollout_id, summary_start=0, summary_end=span)
            fields["turns"] = [Turn("summary", 0, span), *([Turn("user", span, rollout.prompt_tokens)] if span < rollout.prompt_tokens else []), *rollout.turns[1:]]
        out.append(replace(rollout, **fields))
    return out


def synthetic_reward(rng: np.random.Generator, rollout: Rollout, grader: str = "unit-tests") -> Reward:
    passed = float(rng.random() < 0.5)
    style = float(rng.uniform(0, 1))
    return Reward(
        rollout_id=rollout.rollout_id,
        group_id=rollout.group_id,
        grader=grader,
        score=0.9 * passed + 0.1 * style,
        created_at_us=time.time_ns() // 1000,
        components={"tests_passed": passed, "style": style},
    )


@dataclass(frozen=True)
class PolicyShape:
    """What a policy accepts, and so what a simulator feeding it may emit: token ids below `vocab_size`, routed
    experts [layers, top_k] of `num_experts`, rollouts of at most `max_tokens` (None: no limit).

    The defaults are the tiny RL example's policy (ember/midtrain/examples/rl_tiny_cpu.yaml), so `rollouts
    simulate` with no sizing option feeds that example and the ETL example as they are; a test keeps the three
    in agreement."""

    vocab_size: int = 512
    layers: int | None = 2
    top_k: int = 2
    num_experts: int = 4
    max_tokens: int | None = 64


VOCAB_KEY, MAX_TOKENS_KEY = "vocab_size", "max_tokens"


def fitted_shape(given: dict[str, int | None], config: PolicyShape | None, where: str = "",
                 keys: dict[str, str] | None = None) -> PolicyShape:
    """The shape to simulate: each value given (not None), else the config's (`where` names it) where it sets one,
    else the default (an ETL config sets no routing: `layers` None there leaves the routing to the defaults).

    A given value the config cannot take is a ValueError naming both sides, before anything is published: a
    rollout with a token id at or past the config's vocabulary is dead-lettered by the ETL (`token_out_of_vocab`)
    and refused by the trainer; routed experts of another shape cannot be replayed."""
    default = PolicyShape()

    def pick(key: str) -> int | None:
        for source in (given.get(key), None if config is None else getattr(config, key)):
            if source is not None:
                return source
        return getattr(default, key)

    shape = PolicyShape(**{key: pick(key) for key in PolicyShape.__dataclass_fields__})
    if shape.layers == 0:
        shape = replace(shape, layers=None)
    problems = []
    keys = keys or {}
    if config is not None:
        if shape.vocab_size > config.vocab_size:
            problems.append(f"the simulator would emit token ids up to {shape.vocab_size - 1:,}; "
                            f"{keys.get(VOCAB_KEY, VOCAB_KEY)} is {config.vocab_size:,} in {where}")
        if config.layers is not None and shape.layers is not None and (shape.layers, shape.top_k, shape.num_experts) != (
                config.layers, config.top_k, config.num_experts):
            problems.append(f"the simulator would route {shape.layers} layers x top-{shape.top_k} of {shape.num_experts} "
                            f"experts; {where} has {config.layers} x top-{config.top_k} of {config.num_experts}")
        if config.max_tokens is not None and (shape.max_tokens is None or shape.max_tokens > config.max_tokens):
            problems.append(f"the simulator's rollouts may be {'any length' if shape.max_tokens is None else f'{shape.max_tokens:,} tokens'}; "
                            f"{keys.get(MAX_TOKENS_KEY, MAX_TOKENS_KEY)} is {config.max_tokens:,} in {where}")
    if shape.layers and shape.top_k > shape.num_experts:
        problems.append(f"--num-experts must be >= --top-k, got {shape.num_experts} experts, top-{shape.top_k}")
    if problems:
        raise ValueError("; ".join(problems))
    return shape


@dataclass(frozen=True)
class WorkloadSpec:
    """What the simulated fleet does. Times are in simulated seconds; `publish` can compress them."""

    groups: int = 8
    group_size: int = 8
    tokens: int = 48
    length_sigma: float = 0.5
    shape: PolicyShape = field(default_factory=PolicyShape)
    regions: dict[str, float] = field(default_factory=lambda: {"us-east": 0.0, "eu-west": 0.4, "ap-south": 1.5})
    group_interval_s: float = 0.05
    episode_s: float = 0.5
    reward_delay_s: float = 0.5
    p_missing_reward: float = 0.0
    p_late_reward: float = 0.0
    late_delay_s: float = 60.0
    p_duplicate_reward: float = 0.0
    p_duplicate_rollout: float = 0.0
    p_truncated: float = 0.0
    p_malformed: float = 0.0
    policy_versions: int = 1
    first_version: int = 0
    p_stale: float = 0.0
    stale_lag: int = 10
    graders: tuple[str, ...] = ("unit-tests",)
    seed: int = 0
    group_prefix: str = "sim"
    # Long-horizon agents: with max_segments > 1 every sample is an episode of 1..max_segments segments (contexts
    # joined by the model's summaries, `synthetic_episode`), rewarded once at its end; 1 publishes plain rollouts.
    max_segments: int = 1
    p_missing_segment: float = 0.0
    p_late_segment: float = 0.0  # delayed by late_delay_s


@dataclass(frozen=True)
class Event:
    """One message the fleet publishes at simulated time `at_s`; `record` is None for malformed bytes.

    `role` is the `Topics` attribute naming its topic (`rollouts`, `rewards`, `policy_versions`).
    """

    at_s: float
    role: str
    key: bytes
    record: Rollout | Reward | PolicyVersion | None = None
    raw: bytes = b""
    note: str = ""


def _lengths(rng: np.random.Generator, spec: WorkloadSpec) -> np.ndarray:
    cap = spec.shape.max_tokens or 4 * spec.tokens
    raw = spec.tokens * rng.lognormal(0.0, spec.length_sigma, size=spec.group_size) if spec.length_sigma else np.full(spec.group_size, spec.tokens)
    return np.clip(raw.astype(np.int64), 16, cap)


def _malformed(rng: np.random.Generator, good: bytes) -> tuple[bytes, str]:
    kind = int(rng.integers(0, 3))
    if kind == 0:
        return good[: max(1, len(good) // 2)], "truncated encoding"
    if kind == 1:
        return b'{"rollout_id": "json is not the wire format"}', "not ember"
    return bytes(rng.integers(0, 256, size=64, dtype=np.uint8)), "random bytes"


def plan_workload(spec: WorkloadSpec) -> list[Event]:
    """Every message of a simulated run, in publish order: rollouts delayed by region, rewards late,
    missing or duplicated, rollouts duplicated, stale policy versions, and some malformed messages.

    Announced versions start at `first_version` (a run on an existing prefix continues after the
    latest announced one, or the ETL would drop every new rollout as stale); with `p_stale`, at least at
    `stale_lag`, so a stale rollout (`stale_lag` behind the version current at its start) is always
    distinguishable from a fresh one.
    """
    rng = np.random.default_rng(spec.seed)
    regions = list(spec.regions)
    version_period = (spec.groups * spec.group_interval_s) / max(1, spec.policy_versions)
    first = max(spec.first_version, spec.stale_lag if spec.p_stale else 0)
    events = [
        Event(v * version_period, "policy_versions", b"policy", PolicyVersion(first + v, 0))
        for v in range(spec.policy_versions)
    ]
    base_us = time.time_ns() // 1000
    for g in range(spec.groups):
        group_id = f"{spec.group_prefix}-{spec.seed}-{g}"
        key = group_id.encode()
        start = g * spec.group_interval_s
        version = first + (min(spec.policy_versions - 1, int(start / version_period)) if version_period > 0 else 0)
        for i, length in enumerate(_lengths(rng, spec)):
            region = regions[int(rng.integers(0, len(regions)))]
            if spec.max_segments > 1:
                sample = dict(group_id=group_id, prompt_id=f"prompt-{g}", policy_version=version, region=region)
                events += _episode_events(rng, spec, f"{group_id}-{i}", int(length), start, base_us, sample)
                continue
            finished = start + float(rng.exponential(spec.episode_s))
            lag = spec.stale_lag if rng.random() < spec.p_stale else 0
            truncated = rng.random() < spec.p_truncated
            rollout = synthetic_rollout(
                rng,
                group_id=group_id,
                prompt_id=f"prompt-{g}",
                num_tokens=int(length),
                prompt_tokens=max(1, int(length) // 4),
                vocab_size=spec.shape.vocab_size,
                layers=spec.shape.layers,
                top_k=spec.shape.top_k,
                num_experts=spec.shape.num_experts,
                policy_version=max(0, version - lag),
                rollout_id=f"{group_id}-{i}",
                finish_reason="length" if truncated else "stop",
                region=region,
                created_at_us=base_us + int(finished * 1e6),
            )
            events += _rollout_events(rng, spec, finished + spec.regions[region], key, rollout)
            if rng.random() < spec.p_missing_reward:
                continue
            for grader in spec.graders:
                at = finished + float(rng.exponential(spec.reward_delay_s))
                if rng.random() < spec.p_late_reward:
                    at += spec.late_delay_s
                reward = synthetic_reward(rng, rollout, grader=grader)
                events.append(Event(at, "rewards", key, reward))
                if rng.random() < spec.p_duplicate_reward:
                    events.append(Event(at + 0.01, "rewards", key, reward, note="duplicate"))
    events.sort(key=lambda e: e.at_s)
    return events


def _rollout_events(rng: np.random.Generator, spec: WorkloadSpec, published: float, key: bytes, rollout: Rollout) -> list[Event]:
    """One rollout (or segment) as published: sometimes sent twice, sometimes followed by a malformed message."""
    events = [Event(published, "rollouts", key, rollout)]
    if rng.random() < spec.p_duplicate_rollout:
        events.append(Event(published + 0.01, "rollouts", key, rollout, note="duplicate"))
    if rng.random() < spec.p_malformed:
        raw, why = _malformed(rng, encode(rollout))
        events.append(Event(published + 0.005, "rollouts", key, raw=raw, note=why))
    return events


def _episode_events(
    rng: np.random.Generator, spec: WorkloadSpec, episode_id: str, length: int, start: float, base_us: int, sample: dict
) -> list[Event]:
    """One episode's segments, each published as its context ends (some late, missing or sent twice, as
    `spec` says), and its one reward after the last: the messages of a long-horizon agent."""
    shape = spec.shape
    segments = synthetic_episode(
        rng, episode_id=episode_id, segments=int(rng.integers(1, spec.max_segments + 1)), num_tokens=length,
        prompt_tokens=max(1, length // 4), summary_tokens=max(1, length // 8), vocab_size=shape.vocab_size,
        layers=shape.layers, top_k=shape.top_k, num_experts=shape.num_experts, finish_reason="stop",
        created_at_us=base_us + int(start * 1e6), **sample,
    )
    key = sample["group_id"].encode()
    delay = spec.regions[sample["region"]]
    events, ended = [], start
    for segment in segments:
        ended += float(rng.exponential(spec.episode_s))
        published = ended + delay + (spec.late_delay_s if rng.random() < spec.p_late_segment else 0.0)
        if rng.random() < spec.p_missing_segment:
            continue
        events += _rollout_events(rng, spec, published, key, segment)
    if rng.random() < spec.p_missing_reward:
        return events
    for grader in spec.graders:
        at = ended + float(rng.exponential(spec.reward_delay_s)) + (spec.late_delay_s if rng.random() < spec.p_late_reward else 0.0)
        reward = replace(synthetic_reward(rng, segments[-1], grader=grader), rollout_id=episode_id)
        events.append(Event(at, "rewards", key, reward))
        if rng.random() < spec.p_duplicate_reward:
            events.append(Event(at + 0.01, "rewards", key, reward, note="duplicate"))
    return events


def latest_policy_version(
    topic: str, security: KafkaSecurity | None = None, bootstrap: str | None = None, timeout_s: float = 30.0
) -> int | None:
    """The highest version announced on a policy-versions topic (the ETL's notion of "latest"), None when empty."""
    brokers = {"bootstrap_servers": bootstrap} if bootstrap else {}
    consumer = KafkaConsumer(**consumer_config(security, group_id=None, **brokers))
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        end = consumer.end_offsets([tp])[tp]
        latest = None
        deadline = time.monotonic() + timeout_s
        while consumer.position(tp) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {topic} to offset {end} within {timeout_s}s")
            for messages in consumer.poll(timeout_ms=500).values():
                for message in messages:
                    try:
                        version = PolicyVersion.decode(message.value).policy_version
                    except ValueError:
                        continue  # the ETL ignores such records too
                    latest = version if latest is None else max(latest, version)
        return latest
    finally:
        consumer.close()


@dataclass
class PublishStats:
    counts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0

    def add(self, role: str, size: int) -> None:
        self.counts[role] = self.counts.get(role, 0) + 1
        self.bytes[role] = self.bytes.get(role, 0) + size


def publish_workload(
    events: list[Event],
    topics: Topics,
    *,
    time_scale: float = 1.0,
    security: KafkaSecurity | dict[str, KafkaSecurity] | None = None,
    bootstrap: str | None = None,
    stop: threading.Event | None = None,
) -> PublishStats:
    """Publish events at their simulated times divided by `time_scale` (inf: as fast as possible).

    Malformed events go out as raw bytes, everything else through the wire codec, keyed by group_id;
    the first send the broker refused is raised once everything is flushed.
    `security` is one setting for every event, or one per role (`rollouts`, `rewards`,
    `policy_versions`) so each is written by its own principal, as the inference fleet, the graders
    and the trainer do. `bootstrap` defaults to $EMBER_KAFKA_BOOTSTRAP.
    """
    roles = sorted({event.role for event in events})
    brokers = {"bootstrap_servers": bootstrap} if bootstrap else {}
    if isinstance(security, dict):
        producers = {role: KafkaProducer(**producer_config(security[role], **brokers)) for role in roles}
        own = list(producers.values())
    else:
        own = [KafkaProducer(**producer_config(security, **brokers))]
        producers = {role: own[0] for role in roles}
    stats = PublishStats()
    futures = []
    started = time.monotonic()
    try:
        for event in events:
            if stop is not None and stop.is_set():
                break
            if time_scale != float("inf"):
                delay = started + event.at_s / time_scale - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            if isinstance(event.record, PolicyVersion):
                value = PolicyVersion.now(event.record.policy_version).encode()
            elif event.record is not None:
                value = encode(event.record)
            else:
                value = event.raw
            if isinstance(event.record, Rollout) and not event.note:
                stats.tokens += event.record.num_tokens
            futures.append(producers[event.role].send(getattr(topics, event.role), key=event.key, value=value))
            stats.add(event.role if not event.raw else "malformed", len(value))
        for producer in own:
            producer.flush()
        failed = next((f for f in futures if f.failed()), None)
        if failed is not None:
            raise failed.exception  # e.g. a principal without WRITE on the topic: flush() alone would hide it
    finally:
        for producer in own:
            producer.close()
    stats.seconds = time.monotonic() - started
    return stats
