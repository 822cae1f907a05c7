"""`ember rollouts stats`: is data flowing, what is dropped and why, how stale it is — from Kafka alone.

Everything comes from durable state, so it is right even when no ETL process is running: input end
offsets against the ETL group's committed offsets (lag), and the outcomes ledger, which the ETL
writes in the same transactions as its batches (so it counts exactly what the trainer can read).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from kafka import KafkaConsumer, TopicPartition

from ember.rollouts.config import EtlConfig
from ember.rollouts.engine import input_topics
from ember.rollouts.records import Outcome, PolicyVersion
from ember.rollouts.transport import TopicUnavailable, consumer_config, listed_offsets


@dataclass
class PartitionLag:
    topic: str
    partition: int
    end: int
    committed: int | None

    @property
    def lag(self) -> int:
        return self.end - (self.committed or 0)


@dataclass
class EtlStats:
    window_s: float
    partitions: list[PartitionLag] = field(default_factory=list)
    batches: int = 0
    batched_rollouts: int = 0
    batched_by_source: Counter = field(default_factory=Counter)  # with kafka.regions: `us.rollouts` -> rollouts batched
    batched_tokens: int = 0
    last_batch_age_s: float | None = None
    dropped: Counter = field(default_factory=Counter)
    dropped_tokens: Counter = field(default_factory=Counter)
    rewards_dropped: Counter = field(default_factory=Counter)
    dead_letters: Counter = field(default_factory=Counter)
    latest_policy: int | None = None
    max_staleness: int | None = None
    oldest_version_batched: int | None = None
    unreadable: int = 0
    # Episodes (a plain rollout is one of one segment) in batches that hold segments, and the segmented episodes
    # dropped, by reason: each of their segments is a ledger record, the episode counts once.
    episodes_batched: int = 0
    episodes_dropped: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    versions: dict[int, Counter] = field(default_factory=lambda: defaultdict(Counter))  # product path: served/rewarded/trained

    @property
    def rollouts_per_s(self) -> float:
        return self.batched_rollouts / self.window_s if self.window_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.batched_tokens / self.window_s if self.window_s else 0.0


def _read_from(consumer: KafkaConsumer, tp: TopicPartition, start_ms: int | None, timeout_s: float = 60.0) -> list:
    consumer.assign([tp])
    end = consumer.end_offsets([tp])[tp]
    if start_ms is None:
        consumer.seek_to_beginning(tp)
    else:
        found = consumer.offsets_for_times({tp: start_ms}).get(tp)
        consumer.seek(tp, found.offset if found is not None else end)
    messages = []
    deadline = time.monotonic() + timeout_s
    while consumer.position(tp) < end:
        if time.monotonic() > deadline:
            raise TimeoutError(f"could not read {tp.topic}[{tp.partition}] to offset {end} within {timeout_s}s")
        for records in consumer.poll(timeout_ms=1000).values():
            messages.extend(r for r in records if r.offset < end)
    return messages


def collect_stats(config: EtlConfig, window_s: float = 300.0) -> EtlStats:
    """Lag per input partition, and the ledger of the last `window_s` seconds (0: everything)."""
    kafka = config.kafka
    topics = kafka.topics
    stats = EtlStats(window_s=window_s)
    now_ms = int(time.time() * 1000)
    start_ms = None if window_s <= 0 else now_ms - int(window_s * 1000)
    group = KafkaConsumer(**consumer_config(kafka.security, bootstrap_servers=kafka.bootstrap, group_id=kafka.group_id))
    reader = KafkaConsumer(**consumer_config(kafka.security, bootstrap_servers=kafka.bootstrap, group_id=None))
    try:
        inputs = []
        for topic in input_topics(topics, config.source, kafka.regions).values():  # with regions, each region's mirrored topics too
            inputs += [TopicPartition(topic, p) for p in sorted(group.partitions_for_topic(topic) or [])]
        if not inputs:  # a typo'd prefix: named now, not a read timeout later (one visible topic lets the broker judge)
            raise TopicUnavailable(
                f"topics {topics.rollouts} and {topics.rewards} do not exist, or {kafka.security.describe()} may not read "
                "them (is the topic prefix right? does this role read them: `ember rollouts acls`?)"
            )
        ends = listed_offsets(group.end_offsets, inputs)
        for tp in inputs:
            stats.partitions.append(PartitionLag(tp.topic, tp.partition, ends[tp], group.committed(tp)))
        policy_tp = TopicPartition(topics.policy_versions, 0)
        for message in _read_from(reader, policy_tp, None):
            try:
                version = PolicyVersion.decode(message.value).policy_version
            except ValueError:
                continue
            stats.latest_policy = version if stats.latest_policy is None else max(stats.latest_policy, version)
        last_batch_ms = None
        for message in _read_from(reader, TopicPartition(topics.outcomes, 0), start_ms):
            try:
                outcome = Outcome.decode(message.value)
            except ValueError:
                stats.unreadable += 1
                continue
            _add(stats, outcome)
            if outcome.kind == "batch":
                last_batch_ms = max(last_batch_ms or 0, message.timestamp)
        if last_batch_ms is not None:
            stats.last_batch_age_s = max(0.0, (now_ms - last_batch_ms) / 1000)
    finally:
        group.close(autocommit=False)
        reader.close()
    return stats


def _add(stats: EtlStats, outcome: Outcome) -> None:
    if outcome.kind == "batch":
        stats.batches += 1
        stats.batched_rollouts += len(outcome.detail.get("rollout_ids", []))
        stats.batched_by_source.update(outcome.detail.get("sources", {}))
        stats.batched_tokens += outcome.tokens
        stats.episodes_batched += outcome.detail.get("episodes", 0)
        low, _high = outcome.detail.get("policy_versions", [None, None])
        latest = outcome.detail.get("latest_policy")
        if low is not None:
            stats.oldest_version_batched = low if stats.oldest_version_batched is None else min(stats.oldest_version_batched, low)
            if latest is not None:
                lag = latest - low
                stats.max_staleness = lag if stats.max_staleness is None else max(stats.max_staleness, lag)
        for version, n in outcome.detail.get("versions", {}).items():  # product batches count their versions
            stats.versions[int(version)].update({"served": n, "rewarded": n, "trained": n})
    elif outcome.kind == "rollout_dropped":
        stats.dropped[outcome.reason] += 1
        stats.dropped_tokens[outcome.reason] += outcome.tokens
        if "episode_id" in outcome.detail:
            stats.episodes_dropped[outcome.reason].add(f"{outcome.group_id}\x1f{outcome.detail['episode_id']}")
        if "policy_version" in outcome.detail:  # a product completion: served, and rewarded if it earned one
            counts = stats.versions[int(outcome.detail["policy_version"])]
            counts.update({"served": 1, "rewarded": int("reward" in outcome.detail)})
    elif outcome.kind == "reward_dropped":
        stats.rewards_dropped[outcome.reason] += 1
    else:
        stats.dead_letters[outcome.topic] += 1


def render_stats(stats: EtlStats, console) -> None:
    for table in stats_tables(stats):
        console.print(table)


def watch_stats(config: EtlConfig, console, *, window_s: float, interval_s: float, count: int | None = None) -> None:
    """Collect and show the stats every `interval_s` until interrupted (or `count` times): redrawn in place on a
    terminal, printed one after another (each under a time stamp) when piped to a file or a pager."""
    from rich.console import Group
    from rich.live import Live

    def view() -> Group:
        stamp = time.strftime("%H:%M:%S")
        title = f"{stamp} {config.kafka.topics.prefix}: every {interval_s:g}s, Ctrl-C to stop"
        return Group(title, *stats_tables(collect_stats(config, window_s)))

    shown = 0
    if console.is_terminal:
        with Live(view(), console=console, auto_refresh=False) as live:
            shown += 1
            while count is None or shown < count:
                time.sleep(interval_s)
                live.update(view(), refresh=True)
                shown += 1
        return
    while count is None or shown < count:
        if shown:
            time.sleep(interval_s)
        console.print(view())
        shown += 1


def stats_tables(stats: EtlStats) -> list:
    from rich.table import Table

    flow = Table("flow", "value", title="rollout ETL")
    window = f"last {stats.window_s:.0f}s" if stats.window_s else "all time"
    flow.add_row("batches committed", f"{stats.batches} ({window})")
    flow.add_row("rollouts batched", f"{stats.batched_rollouts} ({stats.rollouts_per_s:.1f}/s)" if stats.window_s else str(stats.batched_rollouts))
    flow.add_row("tokens batched", f"{stats.batched_tokens} ({stats.tokens_per_s:.0f}/s)" if stats.window_s else str(stats.batched_tokens))
    for source, n in sorted(stats.batched_by_source.items()):
        rate = f" ({n / stats.window_s:.1f}/s)" if stats.window_s else ""
        flow.add_row(f"  from {source}", f"{n}{rate}")
    age = "never" if stats.last_batch_age_s is None else f"{stats.last_batch_age_s:.1f}s ago"
    flow.add_row("last batch", age)
    flow.add_row("latest policy version", str(stats.latest_policy))
    flow.add_row("max staleness in batches", "-" if stats.max_staleness is None else f"{stats.max_staleness} versions")
    flow.add_row("dead letters", str(sum(stats.dead_letters.values())))
    if stats.episodes_batched or stats.episodes_dropped:
        dropped = sum(len(ids) for ids in stats.episodes_dropped.values())
        flow.add_row("episodes", f"{stats.episodes_batched} batched whole, {dropped} segmented dropped whole")
    if stats.unreadable:
        flow.add_row("unreadable ledger records", str(stats.unreadable))

    lag = Table("topic", "partition", "end offset", "committed", "lag", title="input lag (ETL group)")
    for p in stats.partitions:
        lag.add_row(p.topic, str(p.partition), str(p.end), str(p.committed), str(p.lag))

    drops = Table("dropped", "count", "tokens", "mean tokens", title="what was dropped and why")
    mean_batched = stats.batched_tokens / stats.batched_rollouts if stats.batched_rollouts else 0.0
    drops.add_row("(batched, for comparison)", str(stats.batched_rollouts), str(stats.batched_tokens), f"{mean_batched:.0f}")
    for reason, count in stats.dropped.most_common():
        tokens = stats.dropped_tokens[reason]
        drops.add_row(f"rollout: {reason}", str(count), str(tokens), f"{tokens / count:.0f}")
    for reason, ids in sorted(stats.episodes_dropped.items()):
        drops.add_row(f"episode: {reason}", str(len(ids)), "-", "-")
    for reason, count in stats.rewards_dropped.most_common():
        drops.add_row(f"reward: {reason}", str(count), "-", "-")
    for topic, count in stats.dead_letters.most_common():
        drops.add_row(f"dead letter from {topic}", str(count), "-", "-")
    tables = [flow, lag, drops]
    if stats.versions:
        versions = Table("policy version", "served", "rewarded", "trained", title="product completions per policy version")
        for version, counts in sorted(stats.versions.items()):
            versions.add_row(str(version), str(counts["served"]), str(counts["rewarded"]), str(counts["trained"]))
        tables.append(versions)
    return tables


def per_reason(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """Outcome counts grouped by kind then reason (for the demo's summary rows)."""
    table: dict[str, dict[str, int]] = defaultdict(dict)
    for outcome in outcomes:
        table[outcome.kind][outcome.reason] = table[outcome.kind].get(outcome.reason, 0) + 1
    return dict(table)
