"""The ETL's YAML configuration: typed, validated, and loud about typos; no Kafka client here.

Every section forbids unknown keys, so a misspelt setting fails at start-up with the path of the key
and what it should be, instead of silently running with a default. The engine reads these settings,
so this module stays importable without kafka-python.
"""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, IPvAnyAddress, StringConstraints, model_validator

from ember import configs
from ember.configs import StrictModel
from ember.rollouts.advantages import Estimator
from ember.rollouts.product.config import ProductSettings
from ember.rollouts.security import KafkaSecurity
from ember.rollouts.topics import Topics

DEFAULT_BOOTSTRAP = "127.0.0.1:19092"


def kafka_bootstrap() -> str:
    """The brokers every client and config defaults to: $EMBER_KAFKA_BOOTSTRAP, else the local dev broker."""
    return os.environ.get("EMBER_KAFKA_BOOTSTRAP", DEFAULT_BOOTSTRAP)


class KafkaSettings(StrictModel):
    bootstrap: str = Field(default_factory=kafka_bootstrap, description="host:port of the brokers")
    topic_prefix: str = Field(..., min_length=1, description="required: topics are <prefix>.rollouts, <prefix>.rewards, ...")
    partitions: Annotated[int, configs.at_most(4096, "more partitions only spread the same groups thinner; each costs the broker files and every ETL process state")] = Field(6, ge=1, description="partitions of the rollouts/rewards topics when the ETL creates them")
    create_topics: bool = Field(
        False, description="create missing topics at start; off: a prefix without topics is refused (a typo forks nothing)"
    )
    group_id: str = Field(..., min_length=1, description="required: consumer group shared by every ETL process")
    session_timeout_ms: int = Field(10_000, ge=6_000, description="how fast a dead ETL process loses its partitions")
    heartbeat_interval_ms: int = Field(1_000, ge=100)
    transaction_timeout_ms: int = Field(30_000, ge=1_000, description="a dead process's open transaction aborts after this")
    poll_timeout_ms: int = Field(100, ge=1, le=10_000)
    max_poll_records: Annotated[int, configs.at_most(100_000, "one poll's records are all held in memory at once")] = Field(200, ge=1)
    security: KafkaSecurity = Field(
        default_factory=KafkaSecurity, description="TLS / SASL settings; keys left out come from EMBER_KAFKA_* (see ember.rollouts.security)"
    )
    regions: dict[Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9-]*$")], str] = Field(
        default_factory=dict,
        description="region -> host:port of its cluster, for regions MirrorMaker 2 copies into this one: also read "
        "<region>.<prefix>.rollouts and .rewards, judged by the region's log time; the region's cluster is asked "
        "what the mirror has not copied yet, with kafka.security (secured regions share the central cluster's role "
        "users and CA) (docs/guides/regions.md)",
    )

    @model_validator(mode="after")
    def _regions_not_central(self) -> "KafkaSettings":
        if "central" in self.regions:
            raise ValueError("regions: 'central' is the training cluster's alias in the regions, not a region")
        return self

    @model_validator(mode="after")
    def _heartbeat_below_session(self) -> "KafkaSettings":
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be at most a third of "
                f"session_timeout_ms ({self.session_timeout_ms})"
            )
        return self

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)


class GroupSettings(StrictModel):
    size: Annotated[int, configs.at_most(4096, "a group's rollouts are held in memory until the group is judged")] = Field(
        8, ge=1, description="samples per prompt group (N)"
    )
    quorum: int | None = Field(None, ge=1, description="rewarded samples needed after the timeout; default: size")
    timeout_s: float = Field(600.0, gt=0, description="from the group's first rollout until it is cut at quorum")

    @model_validator(mode="after")
    def _quorum_fits(self) -> "GroupSettings":
        if self.quorum is not None and self.quorum > self.size:
            raise ValueError(f"quorum ({self.quorum}) cannot exceed size ({self.size})")
        return self

    @property
    def min_samples(self) -> int:
        return self.quorum if self.quorum is not None else self.size


class RewardSettings(StrictModel):
    graders: list[str] = Field(
        default_factory=list, description="graders that must all report before a rollout is rewarded; empty: any one"
    )
    weights: dict[str, float] = Field(
        default_factory=dict,
        description="component weights for the combined reward (a name two graders give: <grader>.<name>); empty: sum of grader scores",
    )
    timeout_s: float = Field(900.0, gt=0, description="a rollout without its rewards this long after it arrived is unrewarded")
    orphan_timeout_s: float = Field(3600.0, gt=0, description="a reward whose rollout never arrives is dropped after this")
    clip: float = Field(
        1e6, gt=0, le=1e30,
        description="combined rewards are clipped to [-clip, clip] before advantages (finite extremes cannot overflow them)",
    )


class TruncatedPolicy(str, Enum):
    DROP = "drop"
    PENALIZE = "penalize"
    KEEP = "keep"


class FilterSettings(StrictModel):
    vocab_size: int = Field(
        ..., ge=1, le=2**32, description="required: the policy's vocabulary; a rollout with a token id >= this is dead-lettered"
    )
    max_policy_lag: int | None = Field(8, ge=0, description="drop rollouts this many versions behind the latest; null: never")
    max_tokens: Annotated[int, configs.at_most(1 << 24, "a rollout longer than 16M tokens cannot fit one TrainBatch message")] = Field(
        65_536, ge=1, description="longer rollouts are dropped as overlong"
    )
    truncated: TruncatedPolicy = Field(TruncatedPolicy.DROP, description="what to do with truncated rollouts")
    truncated_penalty: float = Field(-1.0, description="added to the reward of a truncated rollout when truncated=penalize")
    drop_empty: bool = Field(True, description="drop rollouts with no policy tokens (loss_mask all 0)")
    drop_finish_reasons: list[str] = Field(default_factory=lambda: ["tool_error"], description="e.g. failed tool episodes")
    dedup_window_s: float = Field(3600.0, gt=0, description="how long a finished group's ids are remembered for dedup")


class LengthPenalty(StrictModel):
    max_tokens: int = Field(..., ge=1)
    cache_tokens: int = Field(..., ge=0)
    coefficient: float = Field(1.0, ge=0)

    @model_validator(mode="after")
    def _cache_fits(self) -> "LengthPenalty":
        if self.cache_tokens > self.max_tokens:
            raise ValueError(f"cache_tokens ({self.cache_tokens}) cannot exceed max_tokens ({self.max_tokens})")
        return self


class AdvantageSettings(StrictModel):
    estimator: Estimator = Field(Estimator.GRPO, description="grpo, dr_grpo or rloo")
    epsilon: float = Field(1e-6, gt=0)
    drop_zero_variance: bool = Field(True, description="DAPO dynamic sampling: drop groups whose rewards are all equal")
    length_penalty: LengthPenalty | None = Field(None, description="DAPO soft overlong punishment added to rewards")


class BatchSettings(StrictModel):
    token_budget: Annotated[int, configs.at_most(1 << 24, "a TrainBatch is one Kafka message and one trainer step's tokens")] = Field(
        65_536, ge=1, description="tokens per TrainBatch"
    )
    min_fill: float = Field(0.9, gt=0, le=1, description="emit a batch once it holds this fraction of the budget")
    max_wait_s: float = Field(5.0, ge=0, description="emit a partial batch once its oldest group waited this long")


class CommitSettings(StrictModel):
    interval_ms: int = Field(200, ge=0, description="commit at most this often when there is no batch to emit")


class MetricsSettings(StrictModel):
    port: int | None = Field(None, ge=0, le=65535, description="Prometheus endpoint port; null: no endpoint")
    bind: IPvAnyAddress = Field("127.0.0.1", description="address the endpoint listens on; 0.0.0.0 lets a scraper on another host in")
    status_interval_s: float = Field(10.0, ge=0, description="seconds between one-line status logs (rates, lag, drops); 0: none")


class DeadLetterSettings(StrictModel):
    max_message_bytes: Annotated[int, configs.at_most(1 << 30, "a consumer holds a whole message in memory; Kafka refuses records near 2 GiB")] = Field(
        48 * 1024 * 1024, ge=1024, description="larger input messages are dead-lettered")


class EtlConfig(StrictModel):
    source: Literal["groups", "product"] = Field(
        "groups", description="groups: simulated RL (rollouts + rewards); product: served completions + user events (issue 34)"
    )
    product: ProductSettings = Field(default_factory=ProductSettings, description="used when source: product")
    kafka: KafkaSettings
    groups: GroupSettings = Field(default_factory=GroupSettings)
    rewards: RewardSettings = Field(default_factory=RewardSettings)
    filters: FilterSettings
    advantages: AdvantageSettings = Field(default_factory=AdvantageSettings)
    batches: BatchSettings = Field(default_factory=BatchSettings)
    commit: CommitSettings = Field(default_factory=CommitSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    dead_letter: DeadLetterSettings = Field(default_factory=DeadLetterSettings)

    @model_validator(mode="after")
    def _estimator_needs_pairs(self) -> "EtlConfig":
        problems = []
        if self.kafka.regions and self.source == "product":
            problems.append("kafka.regions is read by source: groups only (served completions are not mirrored from regions)")
        if self.advantages.estimator is Estimator.RLOO and self.groups.min_samples < 2:
            problems.append("advantages.estimator=rloo needs groups.quorum (or size) >= 2")
        if self.filters.max_tokens > self.batches.token_budget:
            problems.append(
                f"filters.max_tokens ({self.filters.max_tokens}) exceeds batches.token_budget "
                f"({self.batches.token_budget}): such a rollout could never be packed"
            )
        configs.check(problems)
        return self

    def with_overrides(self, **sections: dict[str, Any]) -> "EtlConfig":
        """A copy with some fields of some sections replaced, validated again (for replay ablations)."""
        data = self.model_dump(mode="json")
        for section, values in sections.items():
            if section not in data:
                raise configs.EtlConfigError(f"override section '{section}' does not exist (sections: {', '.join(data)})")
            data[section] = {**data[section], **values}
        return parse_config(data, "overridden config")


EXAMPLE_HINT = "check the spelling; see ember/rollouts/etl.example.yaml"
REQUIRED_KEYS = ("kafka.topic_prefix", "kafka.group_id", "filters.vocab_size")


def parse_config(data: Any, source: str = "config") -> EtlConfig:
    """The validated config; an empty one is refused, since defaults for topics and group would join a stranger's."""
    if data is None or data == {}:
        raise configs.EtlConfigError(
            f"{source} is empty; an ETL config needs at least {', '.join(REQUIRED_KEYS)} "
            "(see ember/rollouts/etl.example.yaml)"
        )
    return configs.validate(EtlConfig, data, source, configs.EtlConfigError, hint_unknown=EXAMPLE_HINT)


def load_config(path: str | Path) -> EtlConfig:
    return parse_config(configs.read_yaml_mapping(path, configs.EtlConfigError), str(path))


class _RLModelShape(BaseModel):
    model_config = ConfigDict(extra="ignore")
    vocab_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    seq_len: int = Field(gt=1)


class _RLMoEShape(BaseModel):
    model_config = ConfigDict(extra="ignore")
    num_experts: int = Field(gt=0)
    router_topk: int = Field(gt=0)


class _RLRolloutsShape(BaseModel):
    model_config = ConfigDict(extra="ignore")
    topic_prefix: str = Field(min_length=1)


class RLPolicyShape(BaseModel):
    """The keys of a `midtrain rl` config that say what its policy takes: vocabulary, MoE layers and routing, sequence
    length. Only these are read here (the rest is the trainer's to check: rollouts sits below midtrain), so a
    simulator can be sized for the policy it feeds."""

    model_config = ConfigDict(extra="ignore")
    model: _RLModelShape
    moe: _RLMoEShape
    rollouts: _RLRolloutsShape
