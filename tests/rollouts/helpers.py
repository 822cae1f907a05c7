"""Building blocks for engine tests: an input log with offsets and timestamps, fed without Kafka."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ember.rollouts.batching import resolve_from_log
from ember.rollouts.config import EtlConfig, parse_config
from ember.rollouts.engine import REWARDS, ROLLOUTS, InputMessage, ShardEngine, input_topics
from ember.rollouts.records import Outcome
from ember.rollouts.simulate import LARGE_VOCAB, synthetic_rollout
from ember.rollouts.topics import Topics
from ember.schemas import Reward, Rollout, encode

TOPICS = Topics("t")
VOCAB = LARGE_VOCAB


def config(**sections) -> EtlConfig:
    base = {
        "kafka": {"topic_prefix": TOPICS.prefix, "group_id": "t-etl"},
        "groups": {"size": 4, "timeout_s": 10},
        "rewards": {"timeout_s": 5, "orphan_timeout_s": 20},
        "filters": {"max_tokens": 4096, "truncated": "keep", "max_policy_lag": None, "vocab_size": VOCAB},
        "batches": {"token_budget": 4096, "min_fill": 0.01, "max_wait_s": 0},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return parse_config(base)


def rollout(group: str, index: int, tokens: int = 32, seed: int = 0, **kwargs) -> Rollout:
    rng = np.random.default_rng(hash((group, index, seed)) % 2**32)
    kwargs.setdefault("finish_reason", "stop")
    return synthetic_rollout(
        rng, group_id=group, prompt_id=group, num_tokens=tokens, prompt_tokens=4, layers=None,
        rollout_id=f"{group}-{index}", **kwargs,
    )


def reward(r: Rollout, score: float, grader: str = "unit-tests", **components: float) -> Reward:
    return Reward(r.rollout_id, r.group_id, grader, score, 0, components)


@dataclass
class Log:
    """An append-only two-partition log; `messages` keeps the interleaved delivery order."""

    messages: list[InputMessage] = field(default_factory=list)
    next_offset: dict[str, int] = field(default_factory=lambda: {ROLLOUTS: 0, REWARDS: 0})

    def add(self, record: Rollout | Reward, at_ms: int, *, raw: bytes | None = None, key: bytes | None = None) -> InputMessage:
        role = ROLLOUTS if isinstance(record, Rollout) else REWARDS
        offset = self.next_offset[role]
        self.next_offset[role] += 1
        message = InputMessage(
            input_topics(TOPICS)[role], 0, offset, at_ms, key if key is not None else record.group_id.encode(), raw if raw is not None else encode(record)
        )
        self.messages.append(message)
        return message


@dataclass
class Committed:
    """What a run made durable, as the Kafka transaction would."""

    batches: list = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    snapshot: object = None
    marks: dict = field(default_factory=dict)
    closed: list = field(default_factory=list)

    def commit(self, engine: ShardEngine, log: list[InputMessage] = ()) -> None:
        """Batches come out by reference; those whose rollouts are in `log` are resolved, as the trainer's reader does."""
        output, snapshot, marks = engine.checkpoint("test")
        values = {(m.topic, m.partition, m.offset): m.value for m in log}
        self.batches += [resolve_from_log(b.batch, values) if values else b.batch for b in output.batches]
        self.outcomes += output.outcomes
        self.snapshot, self.marks = snapshot, marks
        self.closed += list(snapshot.closed)

    @property
    def batched_ids(self) -> list[str]:
        return [r for b in self.batches for r in b.rollout_ids]

    def reasons(self, kind: str = "rollout_dropped") -> dict[str, int]:
        found: dict[str, int] = {}
        for o in self.outcomes:
            if o.kind == kind:
                found[o.reason] = found.get(o.reason, 0) + 1
        return found


def run(cfg: EtlConfig, messages: list[InputMessage], *, end_ms: int | None = None, policy: int | None = None) -> Committed:
    """Feed messages in log order, then advance to `end_ms` and commit."""
    engine = ShardEngine(cfg, 0, TOPICS)
    done = Committed()
    for message in messages:
        engine.ingest(message, latest_policy=policy)
    if end_ms is not None:
        engine.advance(end_ms, policy)
    done.commit(engine, messages)
    return done
