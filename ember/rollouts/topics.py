"""The rollout ETL's Kafka topics, created idempotently with explicit settings."""

from __future__ import annotations

from dataclasses import dataclass

from kafka.admin import KafkaAdminClient
from kafka.errors import TopicAlreadyExistsError

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    retention_ms: int = 7 * 24 * 3600 * 1000
    compression: str = "zstd"
    min_insync_replicas: int = 1
    replication_factor: int = 1

    def configs(self) -> dict[str, str]:
        return {
            "retention.ms": str(self.retention_ms),
            "compression.type": self.compression,
            "min.insync.replicas": str(self.min_insync_replicas),
            "max.message.bytes": str(MAX_MESSAGE_BYTES),
        }


def default_topics(prefix: str = "ember", partitions: int = 6) -> dict[str, TopicSpec]:
    """Rollouts and rewards share a partition count so a group's rollouts and rewards co-partition.

    `etl-state` has one partition per rollouts partition (the ETL's crash-recovery snapshots) and
    `outcomes` is the ETL's ledger: one record per batch, per dropped rollout or reward, per dead letter.
    """
    return {
        "rollouts": TopicSpec(f"{prefix}.rollouts", partitions),
        "rewards": TopicSpec(f"{prefix}.rewards", partitions),
        "policy_versions": TopicSpec(f"{prefix}.policy-versions", 1, retention_ms=-1),
        "train_batches": TopicSpec(f"{prefix}.train-batches", 1),
        "dead_letter": TopicSpec(f"{prefix}.dead-letter", 1, retention_ms=30 * 24 * 3600 * 1000),
        "outcomes": TopicSpec(f"{prefix}.outcomes", 1, retention_ms=30 * 24 * 3600 * 1000),
        "etl_state": TopicSpec(f"{prefix}.etl-state", partitions),
    }


def ensure_topics(bootstrap: str, specs: list[TopicSpec]) -> dict[str, str]:
    """Create what is missing; returns each topic's outcome ('created' or 'exists')."""
    outcome: dict[str, str] = {}
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="ember-admin")
    try:
        existing = set(admin.list_topics())
        missing = [s for s in specs if s.name not in existing]
        for spec in specs:
            outcome[spec.name] = "exists"
        if missing:
            request = {
                s.name: {
                    "num_partitions": s.partitions,
                    "replication_factor": s.replication_factor,
                    "configs": s.configs(),
                }
                for s in missing
            }
            try:
                admin.create_topics(request, wait_for_metadata=True)
            except TopicAlreadyExistsError:
                pass
            for spec in missing:
                outcome[spec.name] = "created"
        return outcome
    finally:
        admin.close()


def describe_topics(bootstrap: str, names: list[str]) -> list[dict[str, object]]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="ember-admin")
    try:
        return [
            {
                "name": t["name"],
                "partitions": len(t["partitions"]),
                "error_code": t["error_code"],
            }
            for t in admin.describe_topics(names)
        ]
    finally:
        admin.close()
