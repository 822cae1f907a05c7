"""`ember rollouts sample` config: typed, validated at the edge, every key named in its error."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from ember import configs
from ember.configs import ConfigError, StrictModel
from ember.inference.http_backend import OpenAIHTTPSettings
from ember.rollouts.config import kafka_bootstrap
from ember.rollouts.security import KafkaSecurity
from ember.tokenize.config import TokenizerConfig


class SamplerConfigError(ConfigError):
    """An `ember rollouts sample` config that cannot be used."""


class SamplerKafka(StrictModel):
    bootstrap: str = Field(default_factory=kafka_bootstrap, description="host:port of the brokers")
    topic_prefix: str = Field(..., min_length=1, description="required: rollouts go to <prefix>.rollouts, versions come from <prefix>.policy-versions")
    security: KafkaSecurity = Field(default_factory=KafkaSecurity, description="TLS / SASL settings; keys left out come from EMBER_KAFKA_*")


class PolicySource(StrictModel):
    """Which weights: `follow` the announced versions (the highest one carrying weights, swapped as new ones
    arrive), or one pinned export (`uri` + `sha256` of its export.json, `version` to stamp on rollouts)."""

    follow: bool = Field(True, description="sample the latest announced version and swap to newer ones between batches")
    uri: str | None = Field(None, description="a pinned export directory (file://...), with sha256; needs follow: false")
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="sha256 of the pinned export's export.json")
    version: int = Field(0, ge=0, description="the policy version a pinned export's rollouts carry")
    wait_s: float = Field(60.0, ge=0, description="with follow: how long to wait for a first announced version")
    max_groups_per_version: int | None = Field(
        None, ge=1, description="with follow: a batch starts only while fewer groups than this came from the version in "
        "use, else the sampler waits for a newer one (how far sampling may run ahead of training, as AReaL's "
        "max_head_offpolicyness); null: never wait")

    @model_validator(mode="after")
    def _one_source(self) -> "PolicySource":
        pinned = self.uri is not None or self.sha256 is not None
        if self.follow == pinned:
            raise ValueError("set follow: true, or follow: false with uri and sha256 (a pinned export)")
        if pinned and (self.uri is None or self.sha256 is None):
            raise ValueError("a pinned export needs both uri and sha256")
        if pinned and self.max_groups_per_version is not None:
            raise ValueError("max_groups_per_version waits for newer announced versions: it needs follow: true")
        return self


class GenerationSettings(StrictModel):
    group_size: Annotated[int, configs.at_most(4096, "a group is held whole by the ETL")] = Field(8, ge=1, description="completions per prompt (G)")
    temperature: float = Field(1.0, gt=0, le=100, description="logits are divided by this before top-p")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus: sample among the most likely tokens holding this probability")
    max_new_tokens: Annotated[int, configs.at_most(1 << 20, "a rollout is one Kafka message")] = Field(256, ge=1)
    max_prompt_tokens: Annotated[int, configs.at_most(1 << 20, "a rollout is one Kafka message")] = Field(
        2048, ge=1, description="a longer prompt is rejected (counted, named), not cut")
    batch_size: Annotated[int, configs.at_most(65536, "one batch's sequences are generated at once")] = Field(
        32, ge=1, description="sequences generated together; a multiple of group_size keeps groups whole")
    seed: int = Field(0, ge=0, description="the sampling generator's seed: the same config and weights give the same rollouts")
    swap_every_tokens: int = Field(
        0, ge=0, description="also look for a newer policy every this many decode steps within a batch (its rollouts then "
        "span two versions); 0: only between batches")

    @model_validator(mode="after")
    def _groups_fit(self) -> "GenerationSettings":
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size}): groups are generated whole")
        return self


class SamplerConfig(StrictModel):
    kafka: SamplerKafka
    tasks: Path = Field(..., description="the task set: JSONL with prompt_id (or id) and prompt, e.g. `ember corpus benchmarks fetch humaneval`")
    tokenizer: TokenizerConfig = Field(..., description="the policy's tokenizer (as midtrain and tokenize name it); its eos ends a completion")
    backend: Literal["transformers", "openai_http"] = Field(
        "transformers", description="transformers: the announced export, in this process, routed experts recorded; "
        "openai_http: a vLLM / SGLang server (`http`), no routed experts")
    http: OpenAIHTTPSettings | None = Field(None, description="the server, with backend: openai_http")
    policy: PolicySource = Field(default_factory=PolicySource)
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    epochs: int = Field(1, ge=1, description="passes over the task set")
    sampler: str = Field("ember-transformers", min_length=1, max_length=256, description="the Rollout.sampler name")
    region: str = Field("local", max_length=256, description="the Rollout.region")
    run_id: str = Field("run", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                        description="part of every group id: a second run over the same tasks must differ, or the ETL drops it as duplicates")

    @model_validator(mode="after")
    def _backend_settings(self) -> "SamplerConfig":
        if self.backend == "openai_http":
            if self.http is None:
                raise ValueError("backend: openai_http needs an `http` section (base_url, model)")
            if "policy" in self.model_fields_set:
                raise ValueError("policy: the openai_http backend samples the weights its server holds; "
                                 "stamp their version with http.policy_version")
            if self.generation.swap_every_tokens:
                raise ValueError("generation.swap_every_tokens: the openai_http backend cannot swap the server's weights")
        elif self.http is not None:
            raise ValueError("http: only read with backend: openai_http")
        return self


def load_config(path: str | Path) -> SamplerConfig:
    """The validated config; a relative `tasks` path is the config file's neighbour, wherever the command runs."""
    data = configs.read_yaml_mapping(path, SamplerConfigError)
    config = configs.validate(SamplerConfig, data, str(path), SamplerConfigError)
    return config.model_copy(update={"tasks": Path(path).parent / config.tasks})
