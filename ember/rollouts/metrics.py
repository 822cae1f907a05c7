"""Prometheus metrics of one ETL process: is data flowing, what is dropped and why, how stale it is.

Each service owns its registry (several ETLs can run in one test process); `serve` exposes it.
Counters move only after a transaction commits, so a crash never counts anything twice. Label values
come from closed sets (topic names of the config, `Reason`), never from message content: what a
message said goes to the ledger and the dead-letter headers. `source` names an input by where it comes from
(`rollouts`, or `us.rollouts` for region us's mirrored copy): throughput and lag per region. Replication lag comes
from `RegionProofs` (MM2's committed source positions against each region's own end offsets; see `ember.rollouts.mirror`).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from ember.rollouts.mirror import ReplicationLag

_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
_VERSIONS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
_SPREAD = (-3, -2, -1, -0.5, -0.1, 0, 0.1, 0.5, 1, 2, 3)

OBSERVATION_HISTOGRAMS = {
    "reward_join_latency_s": ("ember_etl_reward_join_latency_seconds", "Rollout arrival to reward arrival", _SECONDS),
    "group_completion_s": ("ember_etl_group_completion_seconds", "First rollout of a group to its decision", _SECONDS),
    "staleness_versions": ("ember_etl_staleness_versions", "Policy versions behind the latest, batched rollouts", _VERSIONS),
    "staleness_seconds": ("ember_etl_staleness_seconds", "Rollout age when batched", _SECONDS),
    "reward": ("ember_etl_reward", "Combined reward of batched rollouts", _SPREAD),
    "advantage": ("ember_etl_advantage", "Advantage of batched rollouts", _SPREAD),
}


class EtlMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.messages = Counter("ember_etl_messages", "Input messages consumed", ["topic", "source"], registry=r)
        self.replay_skipped = Counter("ember_etl_replay_skipped", "Messages skipped on recovery (already in output)", registry=r)
        self.rewards_clipped = Counter("ember_etl_rewards_clipped", "Combined rewards clipped to rewards.clip", registry=r)
        self.outcomes = Counter("ember_etl_outcomes", "Ledger outcomes committed", ["kind", "reason"], registry=r)
        self.batches = Counter("ember_etl_batches", "TrainBatches committed", registry=r)
        self.batch_rollouts = Counter("ember_etl_batched_rollouts", "Rollouts in committed batches", registry=r)
        self.batch_tokens = Counter("ember_etl_batched_tokens", "Tokens in committed batches", registry=r)
        self.dropped_tokens = Counter("ember_etl_dropped_tokens", "Tokens of dropped rollouts", ["reason"], registry=r)
        self.transactions = Counter("ember_etl_transactions", "Kafka transactions", ["result"], registry=r)
        self.recoveries = Counter("ember_etl_recoveries", "Times the ETL rebuilt its clients and state", registry=r)
        self.lag = Gauge("ember_etl_consumer_lag", "End offset minus committed offset", ["topic", "source", "partition"], registry=r)
        self.replication_lag = Gauge(
            "ember_etl_replication_lag_records", "A region's committed records MirrorMaker 2 has not copied into central",
            ["region", "topic", "partition"], registry=r,
        )
        self.replication_lag_seconds = Gauge(
            "ember_etl_replication_lag_seconds", "Since a region last held nothing MirrorMaker 2 had not copied",
            ["region", "topic", "partition"], registry=r,
        )
        self.pending = Gauge("ember_etl_pending_messages", "Input messages held in memory", ["shard"], registry=r)
        self.open_groups = Gauge("ember_etl_open_groups", "Groups waiting for rollouts or rewards", ["shard"], registry=r)
        self.policy_version = Gauge("ember_etl_latest_policy_version", "Latest policy version seen", registry=r)
        self.batch_latency = Histogram(
            "ember_etl_last_reward_to_commit_seconds", "Last reward of a batch's groups to its commit", buckets=_SECONDS, registry=r
        )
        self.histograms = {
            key: Histogram(name, doc, buckets=buckets, registry=r) for key, (name, doc, buckets) in OBSERVATION_HISTOGRAMS.items()
        }

    def observe(self, name: str, value: float) -> None:
        if name == "replay_skipped":
            self.replay_skipped.inc(value)
        elif name == "rewards_clipped":
            self.rewards_clipped.inc(value)
        else:
            self.histograms[name].observe(value)

    def show_replication(self, lags: Iterable[ReplicationLag]) -> None:
        for lag in lags:
            labels = (lag.region, lag.topic, str(lag.partition))
            self.replication_lag.labels(*labels).set(lag.records)
            self.replication_lag_seconds.labels(*labels).set(lag.seconds)

    def serve(self, port: int, bind: str = "127.0.0.1") -> int:
        """Start the /metrics endpoint on `bind` (loopback unless a scraper elsewhere needs it); port 0 picks a free one. Returns the port."""
        server, _thread = start_http_server(port, addr=bind, registry=self.registry)
        return int(server.server_port)
