"""The wire stage of `ember demo`: rollouts and rewards through the real broker with the codec.

Every record must come back equal, and a malformed message must be reported with its position, not crash the reader.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
from kafka import KafkaConsumer, KafkaProducer
from rich.console import Console

from ember.rollouts.admin import ensure_topics
from ember.rollouts.config import kafka_bootstrap
from ember.rollouts.simulate import synthetic_reward, synthetic_rollout
from ember.rollouts.topics import Topics
from ember.rollouts.transport import (
    BadMessage,
    RewardWriter,
    RolloutWriter,
    consumer_config,
    end_offsets,
    producer_config,
    read_messages,
)
from ember.schemas import Reward, Rollout

DEMO_PREFIX = "ember-demo"
Rows = list[tuple[str, str]]


def _fingerprint(record: Rollout | Reward) -> str:
    digest = hashlib.blake2b(digest_size=16)
    if isinstance(record, Rollout):
        for array in (record.tokens, record.loss_mask, record.sampler_logprobs, record.routed_experts):
            if array is not None:
                digest.update(np.ascontiguousarray(array).tobytes())
        digest.update(f"{record.policy_version}/{record.turns}".encode())
    else:
        digest.update(f"{record.score!r}/{sorted(record.components.items())}".encode())
    return f"{type(record).__name__}:{record.rollout_id}:{digest.hexdigest()}"


def wire_stage(console: Console, *, rollouts: int, group_size: int, tokens: int, layers: int) -> Rows:
    """Rollouts and rewards through the broker with the codec; every record must come back equal."""
    topics = Topics(DEMO_PREFIX)
    ensure_topics(kafka_bootstrap(), list(topics.specs().values()))
    names = [topics.rollouts, topics.rewards]
    start_offsets = end_offsets(names)
    rng = np.random.default_rng(int(time.time()))
    sent: set[str] = set()
    started = time.perf_counter()
    with console.status(f"wire: publishing {rollouts} rollouts and rewards..."):
        with RolloutWriter(DEMO_PREFIX) as rollout_writer, RewardWriter(DEMO_PREFIX) as reward_writer:
            for i in range(rollouts):
                rollout = synthetic_rollout(
                    rng,
                    group_id=f"demo-{time.time_ns()}-{i // group_size}",
                    prompt_id=f"prompt-{i // group_size}",
                    num_tokens=tokens,
                    layers=layers or None,
                )
                reward = synthetic_reward(rng, rollout)
                rollout_writer.write(rollout)
                reward_writer.write(reward)
                sent |= {_fingerprint(rollout), _fingerprint(reward)}
        poison = KafkaProducer(**producer_config())
        poison.send(topics.rollouts, key=b"demo-poison", value=b"\xff\xff\xff\xff this is not a rollout")
        poison.flush()
        poison.close()
    publish_s = time.perf_counter() - started

    stop_offsets = end_offsets(names)
    expected = sum(stop_offsets[tp] - start_offsets.get(tp, 0) for tp in stop_offsets)
    consumer = KafkaConsumer(**consumer_config(group_id=None))
    consumer.assign(list(stop_offsets))
    for tp in stop_offsets:
        consumer.seek(tp, start_offsets.get(tp, 0))
    received: list[str] = []
    bad: list[BadMessage] = []
    with console.status("wire: consuming read_committed and checking every record..."):
        for item in read_messages(consumer, limit=expected, idle_timeout_s=15):
            if isinstance(item, BadMessage):
                bad.append(item)
            else:
                received.append(_fingerprint(item.record))
    consumer.close()
    equal = len(sent & set(received)) if len(received) == len(set(received)) else 0
    return [
        ("kafka", f"{kafka_bootstrap()}: {expected} messages this run"),
        ("rollouts published", f"{rollout_writer.records} ({rollout_writer.bytes / 1e6:.1f} MB, {publish_s:.1f}s)"),
        ("wire bytes / token", f"{rollout_writer.bytes_per_token:.1f} (routed experts {layers} layers x top-8)"),
        ("rewards published", str(reward_writer.records)),
        ("records read back equal", f"{equal} / {len(sent)}"),
        ("malformed message reported", "; ".join(str(b)[:100] for b in bad) or "NOT REPORTED"),
    ]
