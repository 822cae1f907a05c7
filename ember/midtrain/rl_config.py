"""The `midtrain rl` run config: model sections shared with mid-training, plus rollouts and RL sections.

Validated before anything is built, every section forbids unknown keys and errors name the dotted key.
The model, moe and optimizer sections are the mid-training ones, so the policy checkpoint a
mid-training run wrote loads into the RL trainer unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from ember import configs
from ember.configs import MidtrainConfigError, StrictModel, at_most
from ember.midtrain.config import (
    SEED_WHY, ModelConfig, MoEConfig, OptimizerConfig, ParallelConfig, RunDirectory, memory_problems,
)

MAX_POLICY_VERSION = 2**63 - 1
"""Policy versions travel as int64 in every TrainBatch and policy announcement."""
from ember.rollouts.security import KafkaSecurity
from ember.rollouts.topics import Topics


class RolloutsConfig(StrictModel):
    topic_prefix: str = Field(min_length=1, description="batches come from <prefix>.train-batches; versions go to <prefix>.policy-versions")
    group_id: str = Field(default="ember-trainer", min_length=1, description="the trainer's consumer group")
    bootstrap: str | None = Field(default=None, description="Kafka brokers; default: EMBER_KAFKA_BOOTSTRAP or 127.0.0.1:19092")
    idle_timeout_s: float | None = Field(
        default=None, gt=0, description="checkpoint and exit when no batch arrives for this long; null: wait forever"
    )
    security: KafkaSecurity = Field(
        default_factory=KafkaSecurity, description="TLS / SASL as the trainer principal; keys left out come from EMBER_KAFKA_*"
    )

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)

    @property
    def batches_topic(self) -> str:
        return self.topics.train_batches


class RLSettings(StrictModel):
    steps: Annotated[int, at_most(10**9, "more than any run takes; a larger number is a typo")] = Field(
        gt=0, description="batches to train on (one optimizer step each, times updates_per_batch)"
    )
    replay: Literal["off", "replay"] = Field(default="replay", description="force the sampler's routed experts (router replay)")
    correction: Literal["none", "tis", "mis", "seq_geo"] = Field(default="tis", description="train/inference mismatch correction")
    tis_cap: float = Field(default=2.0, gt=0, description="C in min(rho, C)")
    alpha: float = Field(default=0.5, gt=0, description="lower bound on rho for mis / seq_geo (and the reported fraction outside)")
    beta: float = Field(default=2.0, gt=0, description="upper bound on rho for mis / seq_geo")
    old_policy: Literal["sampler", "recompute"] = Field(
        default="recompute", description="PPO ratio against the sampler's log-probs or the trainer's own before the update"
    )
    clip_low: float = Field(default=0.2, ge=0, lt=1, description="ratio clipped below at 1 - clip_low")
    clip_high: float = Field(default=0.28, ge=0, description="ratio clipped above at 1 + clip_high")
    estimator: Literal["grpo", "dr_grpo", "rloo"] = Field(
        default="grpo",
        description="the advantage estimator of the ETL that writes the batches (its advantages.estimator, checked on "
        "every batch); it picks the loss normaliser: dr_grpo the constant one, the others token_mean",
    )
    aggregation: Literal["token_mean", "seq_mean", "constant"] = Field(
        default="token_mean",
        description="loss normaliser, when left out the estimator's: token_mean | seq_mean (grpo, rloo), constant = sum / (max_generation_tokens x "
        "sequences) (dr_grpo only)",
    )
    max_generation_tokens: int | None = Field(
        default=None, gt=0, description="dr_grpo: the sampler's generation budget, the constant the loss divides by"
    )
    updates_per_batch: Annotated[int, at_most(64, "PPO epochs on one batch; more only overfits it")] = Field(
        default=1, gt=0, description="optimizer updates on each batch (PPO epochs)"
    )
    seed: Annotated[int, at_most(2**31 - 1, SEED_WHY)] = Field(default=1234, ge=0)
    save_interval: int = Field(default=1, ge=0, description="steps between checkpoints; 0: only at the end and on signal")
    keep_checkpoints: Annotated[int, at_most(1000, "each one is a full model and optimizer state on disk")] = Field(default=2, gt=0)
    initial_policy_version: int = Field(default=0, ge=0, description="the version of the starting weights; step k is this + k")
    publish_interval: int | None = Field(
        default=None, gt=0,
        description="steps between announced policy versions, each exported (safetensors + config.json) and announced "
        "with its URI and sha256; a multiple of save_interval, so only checkpointed weights are announced and a resume "
        "never retrains an announced version. null: every checkpoint. The starting and the final version are always announced",
    )
    keep_versions: Annotated[int, at_most(1000, "each one is a full copy of the weights on disk")] = Field(
        default=4, gt=0, description="exported versions kept under run_dir/versions; older ones are removed"
    )

    @model_validator(mode="before")
    @classmethod
    def _aggregation_from_estimator(cls, data: object) -> object:
        """An unset aggregation is the estimator's: Dr.GRPO's constant normaliser, else token_mean."""
        if isinstance(data, dict) and data.get("aggregation") is None:
            data = {**data, "aggregation": "constant" if data.get("estimator") == "dr_grpo" else "token_mean"}
        return data

    @model_validator(mode="after")
    def _bounds(self) -> "RLSettings":
        problems = []
        if self.estimator == "dr_grpo" and self.aggregation != "constant":
            problems.append((
                "aggregation",
                f"estimator dr_grpo needs aggregation constant, got {self.aggregation}: Dr.GRPO's loss divides by a "
                "constant, not by rollout or batch lengths (leave aggregation out to get it)",
            ))
        if self.aggregation == "constant" and self.estimator != "dr_grpo":
            problems.append((
                "estimator",
                f"aggregation constant is Dr.GRPO's normaliser, but estimator is {self.estimator}: set estimator: "
                "dr_grpo (and advantages.estimator: dr_grpo in the ETL config) or another aggregation",
            ))
        if self.aggregation == "constant" and self.max_generation_tokens is None:
            problems.append(("max_generation_tokens", "aggregation constant needs it: the sampler's generation budget"))
        if self.estimator != "dr_grpo" and self.aggregation != "constant" and self.max_generation_tokens is not None:
            problems.append(
                ("max_generation_tokens", f"only aggregation constant (dr_grpo) uses it, aggregation is {self.aggregation}")
            )
        if self.alpha >= self.beta:
            problems.append(f"alpha {self.alpha} must be below beta {self.beta}")
        if self.initial_policy_version + self.steps > MAX_POLICY_VERSION:
            problems.append(
                f"initial_policy_version + steps exceeds {MAX_POLICY_VERSION:,}, the largest int64 policy version "
                "a TrainBatch or policy announcement can carry"
            )
        if self.publish_interval is not None and (not self.save_interval or self.publish_interval % self.save_interval):
            saves = f"every {self.save_interval} steps" if self.save_interval else "only at the end: save_interval 0"
            problems.append((
                "publish_interval",
                f"{self.publish_interval} announces versions that are not checkpointed (saves happen "
                f"{saves}): a restart would retrain them with other weights. Set publish_interval to a multiple of "
                "save_interval, or null to announce every checkpoint",
            ))
        configs.check(problems)
        return self

    def announces(self, step: int) -> bool:
        """Whether the version reached at `step` is announced (besides the run's first and last)."""
        interval = self.publish_interval or self.save_interval
        return interval > 0 and step % interval == 0


class RLConfig(RunDirectory, StrictModel):
    run_dir: Path = Field(description="checkpoints/, metrics.jsonl are written here")
    init_checkpoint: Path | None = Field(
        default=None, description="a midtrain/RL checkpoint directory (step_*) whose model weights start the run"
    )
    model: ModelConfig
    moe: MoEConfig
    parallel: ParallelConfig = ParallelConfig()
    optimizer: OptimizerConfig
    rollouts: RolloutsConfig
    rl: RLSettings

    @property
    def versions_dir(self) -> Path:
        """Announced policy versions, exported as Hugging Face safetensors (version_<N>/)."""
        return self.run_dir / "versions"

    @model_validator(mode="after")
    def _layout(self) -> "RLConfig":
        p = self.parallel
        problems = memory_problems(self.model, self.moe, self.parallel, tokens=0)
        if (p.tensor, p.pipeline) != (1, 1):
            problems.append((
                "parallel", "the RL step runs each batch share as one micro-batch through the whole model: "
                "tensor and pipeline must be 1 (data- and expert-parallel ranks are supported)",
            ))
        if p.expert > 1 and self.moe.token_dispatcher == "allgather":
            problems.append((
                "moe.token_dispatcher", "expert-parallel RL needs alltoall or flex: each rank's share of a batch has "
                "its own token count, which the allgather dispatcher cannot exchange",
            ))
        configs.check(problems)
        return self


def parse_rl_config(data: dict, base: Path, where: str = "config") -> RLConfig:
    data = dict(data)
    for key in ("run_dir", "init_checkpoint"):
        if isinstance(data.get(key), str):
            data[key] = str((base / data[key]).resolve())
    return configs.validate(RLConfig, data, where, MidtrainConfigError)


def load_rl_config(path: str | Path) -> RLConfig:
    path = Path(path)
    data = configs.read_yaml_mapping(path, MidtrainConfigError, sections="model, moe, rollouts, rl, ...")
    return parse_rl_config(data, path.resolve().parent, str(path))
