"""The rollout ETL's topic names and settings: one rule, built from a prefix, no Kafka client here.

`Topics(prefix)` is the only place a topic name is spelled; topics, writers, the ETL, the reader,
replay, stats and the RL trainer's config all take their names from it.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_PARTITIONS = 6


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


@dataclass(frozen=True)
class Topics:
    """The names of one deployment's topics: `<prefix>.rollouts`, `<prefix>.rewards`, ..."""

    prefix: str = "ember"

    @property
    def rollouts(self) -> str:
        return f"{self.prefix}.rollouts"

    @property
    def rewards(self) -> str:
        return f"{self.prefix}.rewards"

    @property
    def policy_versions(self) -> str:
        return f"{self.prefix}.policy-versions"

    @property
    def train_batches(self) -> str:
        return f"{self.prefix}.train-batches"

    @property
    def dead_letter(self) -> str:
        return f"{self.prefix}.dead-letter"

    @property
    def outcomes(self) -> str:
        return f"{self.prefix}.outcomes"

    @property
    def etl_state(self) -> str:
        return f"{self.prefix}.etl-state"

    def specs(self, partitions: int = DEFAULT_PARTITIONS) -> dict[str, TopicSpec]:
        """Every topic's settings by role.

        Rollouts and rewards share a partition count so a group's rollouts and rewards co-partition.
        `etl-state` has one partition per rollouts partition (the ETL's crash-recovery snapshots) and
        `outcomes` is the ETL's ledger: one record per batch, per dropped rollout or reward, per dead letter.
        """
        month = 30 * 24 * 3600 * 1000
        return {
            "rollouts": TopicSpec(self.rollouts, partitions),
            "rewards": TopicSpec(self.rewards, partitions),
            "policy_versions": TopicSpec(self.policy_versions, 1, retention_ms=-1),
            "train_batches": TopicSpec(self.train_batches, 1),
            "dead_letter": TopicSpec(self.dead_letter, 1, retention_ms=month),
            "outcomes": TopicSpec(self.outcomes, 1, retention_ms=month),
            "etl_state": TopicSpec(self.etl_state, partitions),
        }
