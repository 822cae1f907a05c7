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
    timestamp_type: str = "CreateTime"
    cleanup_policy: str = "delete"

    def configs(self) -> dict[str, str]:
        return {
            **({"cleanup.policy": self.cleanup_policy} if self.cleanup_policy != "delete" else {}),
            "retention.ms": str(self.retention_ms),
            "compression.type": self.compression,
            "min.insync.replicas": str(self.min_insync_replicas),
            "max.message.bytes": str(MAX_MESSAGE_BYTES),
            "message.timestamp.type": self.timestamp_type,
        }


def timestamp_problem(topic: str, configs: dict[str, str], bootstrap: str = "BROKER") -> str | None:
    """Why the input topic `topic` cannot carry the ETL's deadlines, or None: with CreateTime a record carries its
    producer's clock, and a record stamped before a deadline can be appended after the ETL decided it, so a replay
    of the log would decide otherwise. One line, with the fix."""
    found = configs.get("message.timestamp.type", "CreateTime")
    if found == "LogAppendTime":
        return None
    return (
        f"{topic} uses message.timestamp.type={found}: the ETL's deadlines need the broker's append time, so that a "
        f"replay of the log decides what the live ETL did; fix: kafka-configs.sh --bootstrap-server {bootstrap} --alter "
        f"--entity-type topics --entity-name {topic} --add-config message.timestamp.type=LogAppendTime "
        "(topics made by `ember rollouts topics create` have it)"
    )


def reference_retention_problem(rollouts: dict[str, str], train_batches: dict[str, str]) -> str | None:
    """Why the rollouts topic may lose rollouts that train batches still reference, or None.

    Batches carry references to their rollouts (claim check), so a batch outlives its rollouts when the
    rollouts topic's `retention.ms` is shorter than the train-batches topic's, or when `retention.bytes`
    can delete rollouts early (its age bound is then no promise). Arguments: each topic's configs."""
    def ms(configs: dict[str, str]) -> float:
        value = int(configs.get("retention.ms", "-1"))
        return float("inf") if value < 0 else float(value)

    if ms(rollouts) < ms(train_batches):
        return (
            f"the rollouts topic keeps data {rollouts.get('retention.ms')} ms but train-batches "
            f"{train_batches.get('retention.ms')} ms: a batch would outlive the rollouts it references; "
            "set the rollouts topic's retention.ms at least as long (kafka-configs --alter --add-config retention.ms=...)"
        )
    if int(rollouts.get("retention.bytes", "-1")) >= 0:
        return (
            f"the rollouts topic has retention.bytes {rollouts['retention.bytes']}: size-based deletion can drop "
            "rollouts that committed batches still reference; set retention.bytes=-1 and bound it by retention.ms"
        )
    return None


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
    def events(self) -> str:
        """Product events (shown, accepted, ...) keyed by completion id: the `source: product` ETL's second input."""
        return f"{self.prefix}.events"

    @property
    def opt_out(self) -> str:
        """Opted-out user / org ids (compacted, keyed by id): the `source: product` ETL follows it while running."""
        return f"{self.prefix}.opt-out"

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

        Rollouts, rewards and events share a partition count so a group's rollouts and rewards, or a served
        completion and its product events, co-partition.
        `etl-state` has one partition per rollouts partition (the ETL's crash-recovery snapshots) and
        `outcomes` is the ETL's ledger: one record per batch, per dropped rollout or reward, per dead letter.
        Batches reference their rollouts, so the rollouts topic is kept at least as long as train-batches
        (`reference_retention_problem`). Rollouts, rewards and events are stamped by the broker (LogAppendTime), the clock
        the ETL's deadlines run on (`timestamp_problem`). Rollouts keep the producer's compression: they are close
        to incompressible and written uncompressed (`transport.ROLLOUT_COMPRESSION`).
        """
        month = 30 * 24 * 3600 * 1000
        return {
            "rollouts": TopicSpec(self.rollouts, partitions, compression="producer", timestamp_type="LogAppendTime"),
            "rewards": TopicSpec(self.rewards, partitions, timestamp_type="LogAppendTime"),
            "events": TopicSpec(self.events, partitions, timestamp_type="LogAppendTime"),
            "policy_versions": TopicSpec(self.policy_versions, 1, retention_ms=-1),
            "train_batches": TopicSpec(self.train_batches, 1),
            "dead_letter": TopicSpec(self.dead_letter, 1, retention_ms=month),
            "outcomes": TopicSpec(self.outcomes, 1, retention_ms=month),
            "etl_state": TopicSpec(self.etl_state, partitions),
            "opt_out": TopicSpec(self.opt_out, 1, retention_ms=-1, cleanup_policy="compact"),
        }
