"""The rollout stage of `ember demo`: simulate a fleet -> run the ETL -> read batches as the trainer.

Publishes a small simulated run with every kind of fault, and one group of long-horizon agent episodes (1-3
segments joined by summaries, tool turns, one reward each), runs one ETL process in-process until it has
decided everything, reads the committed batches with `RolloutBatchReader`, and checks the books: every
published rollout is either in exactly one batch or in the ledger with the reason it was dropped, and every
episode is trained whole, in one batch with one advantage, or dropped whole.

It is a newcomer's first contact with Kafka, often on a broker formatted seconds before: it first waits,
bounded and saying so, for the topics' leaders and the group and transaction coordinators.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import replace

import numpy as np

from kafka import KafkaConsumer, TopicPartition
from rich.console import Console

from ember.rollouts.admin import wait_until_ready
from ember.rollouts.config import kafka_bootstrap, parse_config
from ember.rollouts.etl import EtlService, prepare_topics
from ember.rollouts.reader import RolloutBatchReader
from ember.rollouts.records import Outcome
from ember.rollouts.simulate import LARGE_VOCAB, PolicyShape, WorkloadSpec, plan_workload, publish_workload
from ember.rollouts.transport import consumer_config, end_offsets


def _outcomes_since(topic: str, start: int, timeout_s: float = 60.0) -> list[Outcome]:
    consumer = KafkaConsumer(**consumer_config(group_id=None))
    tp = TopicPartition(topic, 0)
    try:
        consumer.assign([tp])
        consumer.seek(tp, start)
        end = consumer.end_offsets([tp])[tp]
        found = []
        deadline = time.monotonic() + timeout_s
        while consumer.position(tp) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read the ledger {topic} from offset {start} to {end} within {timeout_s:.0f}s")
            for records in consumer.poll(timeout_ms=1000).values():
                found += [Outcome.decode(r.value) for r in records if r.offset < end]
        return found
    finally:
        consumer.close()


def _counts(counter: Counter) -> str:
    return ", ".join(f"{reason}: {n}" for reason, n in counter.most_common()) or "none"


def _episodes_whole(batch, seen: dict[str, str]) -> bool:
    """Each episode of `batch` has one advantage on all its trained tokens and is in no other batch (`seen`)."""
    whole = True
    for episode in dict.fromkeys(batch.episode_ids):
        rows = [i for i, e in enumerate(batch.episode_ids) if e == episode]
        trained = np.concatenate([
            batch.advantages[batch.cu_seqlens[i] : batch.cu_seqlens[i + 1]][batch.loss_mask[batch.cu_seqlens[i] : batch.cu_seqlens[i + 1]] == 1]
            for i in rows
        ])
        whole = whole and len(np.unique(trained)) <= 1 and seen.setdefault(episode, batch.batch_id) == batch.batch_id
    return whole


def run(console: Console, prefix: str, rollouts: int, group_size: int, tokens: int) -> list[tuple[str, str]]:
    """Returns (stage, result) rows for the demo table; the last row says whether the books balance."""
    config = parse_config(
        {
            "kafka": {"bootstrap": kafka_bootstrap(), "topic_prefix": prefix, "partitions": 2, "group_id": f"{prefix}-etl"},
            "groups": {"size": group_size, "quorum": max(2, math.ceil(group_size / 2)), "timeout_s": 3},
            "rewards": {"graders": ["unit-tests"], "timeout_s": 1.5, "orphan_timeout_s": 3},
            "filters": {"max_policy_lag": 3, "max_tokens": 2 * tokens, "vocab_size": LARGE_VOCAB},
            "batches": {"token_budget": max(2 * tokens, group_size * tokens), "min_fill": 0.8, "max_wait_s": 0.5},
        }
    )
    topics = prepare_topics(config, create=True)
    service = EtlService(config, instance="demo")
    with console.status("waiting for the broker's group and transaction coordinators (a new broker creates them on first use)..."):
        wait_until_ready(
            config.kafka.bootstrap,
            topics=[topics.rollouts, topics.rewards, topics.train_batches, topics.outcomes],
            group_id=config.kafka.group_id,
            transactional_id=service.member_id,
            who="demo rollout stage",
        )
    batches_start = {tp.partition: o for tp, o in end_offsets([topics.train_batches]).items()}
    outcomes_start = {tp.partition: o for tp, o in end_offsets([topics.outcomes]).items()}
    spec = WorkloadSpec(
        groups=max(1, math.ceil(rollouts / group_size)),
        group_size=group_size,
        tokens=tokens,
        length_sigma=0.3,
        shape=PolicyShape(vocab_size=LARGE_VOCAB, layers=4, top_k=8, num_experts=256, max_tokens=2 * tokens),
        regions={"us-east": 0.0, "eu-west": 0.2, "ap-south": 0.5},
        group_interval_s=0.02,
        episode_s=0.2,
        reward_delay_s=0.2,
        p_missing_reward=0.05,
        p_late_reward=0.05,
        late_delay_s=3.0,
        p_duplicate_reward=0.05,
        p_duplicate_rollout=0.05,
        p_truncated=0.05,
        p_malformed=0.03,
        policy_versions=3,
        p_stale=0.05,
        seed=int(time.time()),
        group_prefix=f"demo-{time.time_ns()}",
    )
    agents = replace(spec, groups=1, max_segments=3, p_missing_segment=0.1, group_prefix=f"{spec.group_prefix}-agents")
    events = plan_workload(spec) + [e for e in plan_workload(agents) if e.role != "policy_versions"]
    with console.status(f"simulating {spec.groups} groups x {group_size} rollouts and {group_size} agent episodes across 3 regions..."):
        published = publish_workload(sorted(events, key=lambda e: e.at_s), topics)
    started = time.perf_counter()
    with console.status("running the ETL until every group is decided..."):
        service.run(until_idle_s=1.5)
    etl_s = time.perf_counter() - started

    outcomes = _outcomes_since(topics.outcomes, outcomes_start.get(0, 0))
    dropped = Counter(o.reason for o in outcomes if o.kind == "rollout_dropped")
    rewards_dropped = Counter(o.reason for o in outcomes if o.kind == "reward_dropped")
    dead = Counter(o.reason[:48] for o in outcomes if o.kind == "dead_letter")
    ledger_ids = Counter(r for o in outcomes if o.kind == "batch" for r in o.detail["rollout_ids"])

    state = {"topic": topics.train_batches, "offsets": {str(p): o for p, o in batches_start.items()}}
    read_ids: Counter = Counter()
    read_tokens = 0
    shapes = ""
    trained_episodes: dict[str, str] = {}
    episodes_whole = True
    with RolloutBatchReader(topics.train_batches, group_id=f"{prefix}-trainer", state=state, idle_timeout_s=3) as reader:
        for item in reader:
            episodes_whole = _episodes_whole(item.batch, trained_episodes) and episodes_whole
            read_ids.update(item.batch.rollout_ids)
            read_tokens += len(item.batch.tokens)
            shapes = ", ".join(f"{k} {getattr(item.batch, k).shape}" for k in ("tokens", "loss_mask", "advantages"))
            reader.commit()
    rollout_messages = published.counts.get("rollouts", 0)
    accounted = sum(read_ids.values()) + sum(dropped.values())
    dropped_episodes = {o.detail["episode_id"] for o in outcomes if o.kind == "rollout_dropped" and "episode_id" in o.detail}
    episodes_whole = episodes_whole and not dropped_episodes & set(trained_episodes)
    trained_agents = [e for e in trained_episodes if e.startswith(agents.group_prefix)]  # a batch may hold plain rollouts too
    segments = sum(1 for e in events if e.role == "rollouts" and e.record is not None and e.record.episode_id and not e.note)
    balanced = read_ids == ledger_ids and max(read_ids.values(), default=1) == 1 and accounted == rollout_messages and episodes_whole
    return [
        ("rollouts simulated", f"{rollout_messages} messages ({published.counts.get('rewards', 0)} rewards, "
         f"{published.counts.get('malformed', 0)} malformed, {published.counts.get('policy_versions', 0)} policy versions)"),
        ("ETL", f"{len(ledger_ids)} rollouts in {sum(1 for o in outcomes if o.kind == 'batch')} batches, "
         f"{service.transactions} transactions, {etl_s:.1f}s"),
        ("rollouts dropped", _counts(dropped)),
        ("rewards dropped", _counts(rewards_dropped)),
        ("dead letters", _counts(dead)),
        ("trainer read", f"{sum(read_ids.values())} rollouts, {read_tokens} tokens; {shapes}"),
        ("agent episodes", f"{group_size} sent as {segments} segments; {len(trained_agents)} trained whole (one batch, one "
         f"advantage each: {'yes' if episodes_whole else 'NO'}), {len(dropped_episodes)} dropped whole"),
        ("books balance", f"{'yes' if balanced else 'NO'}: {accounted} batched + dropped of {rollout_messages} published"),
    ]
