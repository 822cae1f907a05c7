"""`ember rollouts grade`'s YAML configuration: Kafka, the task set, the policy's tokenizer and the graders.

Typed and strict like the ETL's (`ember.rollouts.config`): an unknown key fails at start with its dotted path.
Kafka settings and security are the ETL's own models, so a grader is pointed at a deployment the same way.
Each grader names its kind; the kind's class is imported by name only when the service builds it
(`grader_class`), so a grader whose dependencies are not installed costs nothing to those who do not run it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, IPvAnyAddress, ValidationError, model_validator

from ember import configs
from ember.configs import GraderConfigError, StrictModel, error_lines
from ember.rollouts.grading.base import Grader, Task
from ember.rollouts.config import KafkaSettings
from ember.tokenize.config import TokenizerConfig

GRADER_KINDS = {
    "unit_tests": ("ember.rollouts.grading.unit_tests", "UnitTestGrader"),
    "judge": ("ember.rollouts.grading.judge", "LLMJudge"),
    "rule": ("ember.rollouts.grading.rule", "RuleGrader"),
}
"""kind -> (module, class). Each class builds itself with `from_settings(name, version, settings)`."""

EXAMPLE_HINT = "check the spelling; see ember/rollouts/grade.example.yaml"
_NAME = r"^[A-Za-z0-9_.-]+$"


class TaskFields(StrictModel):
    """Which record keys hold a task's id (the rollouts' prompt_id), prompt, tests, entry point and reference
    answer (null: the file has none). The defaults read `ember corpus benchmarks fetch humaneval`'s file."""

    id: str = Field("id", min_length=1)
    prompt: str = Field("prompt", min_length=1)
    tests: str | None = Field("tests", min_length=1)
    entry_point: str | None = Field("entry_point", min_length=1)
    reference: str | None = Field("solution", min_length=1, description="a known-good answer, for `rule` graders")


class TaskSetSettings(StrictModel):
    path: Path = Field(..., description="required: JSONL (.jsonl, .jsonl.gz) or Parquet; relative to the config's directory")
    format: Literal["jsonl", "parquet"] | None = Field(None, description="default: from the file's suffix")
    fields: TaskFields = Field(default_factory=TaskFields)


class GraderSpec(StrictModel):
    """One grader the service runs on every rollout; its name and version go on each Reward it publishes."""

    name: str = Field(..., min_length=1, max_length=128, pattern=_NAME, description="the ETL's rewards.graders lists it")
    version: str = Field(..., min_length=1, max_length=128, description="bump it when the grading changes")
    kind: Literal["unit_tests", "judge", "rule"]
    settings: dict[str, Any] = Field(default_factory=dict, description="the kind's own settings (see its class)")


class GraderMetricsSettings(StrictModel):
    port: int | None = Field(None, ge=0, le=65535, description="Prometheus endpoint port; null: no endpoint")
    bind: IPvAnyAddress = Field("127.0.0.1", description="address the endpoint listens on")
    status_interval_s: float = Field(10.0, ge=0, description="seconds between one-line status logs; 0: none")


class GraderConfig(StrictModel):
    kafka: KafkaSettings
    tasks: TaskSetSettings
    tokenizer: TokenizerConfig = Field(..., description="the policy's tokenizer: rollouts carry token ids, graders read text")
    graders: list[GraderSpec] = Field(..., min_length=1, description="every one grades every rollout")
    metrics: GraderMetricsSettings = Field(default_factory=GraderMetricsSettings)

    @model_validator(mode="after")
    def _distinct_and_no_topics(self) -> "GraderConfig":
        problems: list[str | tuple[str, str]] = []
        names = [g.name for g in self.graders]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            problems.append(("graders", f"names {repeated} repeat: the ETL keeps one reward per grader name"))
        if self.kafka.create_topics:
            problems.append(("kafka.create_topics", "the grader creates no topics; `ember rollouts topics create` makes them"))
        configs.check(problems)
        return self


def grader_class(kind: str) -> type:
    """The class of grader `kind`, imported now; a kind whose module is not installed is a config error."""
    module, name = GRADER_KINDS[kind]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise GraderConfigError(f"grader kind {kind!r} needs {module}.{name}, which cannot be imported: {exc}") from None


def parse_config(data: Any, source: str = "config", base: Path | None = None) -> GraderConfig:
    """The validated config; relative task set and tokenizer paths resolve against `base` (the config's directory)."""
    if data is None or data == {}:
        raise GraderConfigError(
            f"{source} is empty; a grader config needs at least kafka.topic_prefix, kafka.group_id, tasks.path, "
            "tokenizer and graders (see ember/rollouts/grade.example.yaml)"
        )
    config = configs.validate(GraderConfig, data, source, GraderConfigError, hint_unknown=EXAMPLE_HINT)
    if base is None:
        return config
    tasks = config.tasks if config.tasks.path.is_absolute() else config.tasks.model_copy(update={"path": base / config.tasks.path})
    return config.model_copy(update={"tasks": tasks, "tokenizer": config.tokenizer.resolved_against(base)})


def load_config(path: str | Path) -> GraderConfig:
    return parse_config(configs.read_yaml_mapping(path, GraderConfigError), str(path), Path(path).parent)


@dataclass(frozen=True)
class BuiltGrader:
    spec: GraderSpec
    grader: Grader


def build_graders(config: GraderConfig, tasks: Mapping[str, Task]) -> list[BuiltGrader]:
    """Each configured grader, built by its kind's class; a grader that needs what the task set lacks is refused."""
    built = []
    for i, spec in enumerate(config.graders):
        cls = grader_class(spec.kind)
        try:
            grader = cls.from_settings(spec.name, spec.version, spec.settings)
        except ValidationError as exc:
            raise GraderConfigError(f"graders.{i}.settings ({spec.kind} grader {spec.name!r}): {'; '.join(error_lines(exc))}") from None
        if getattr(cls, "needs_reference", False):
            lacking = sorted(p for p, t in tasks.items() if not t.reference)
            if lacking:
                raise GraderConfigError(
                    f"graders.{i} ({spec.kind} grader {spec.name!r}) compares with each task's reference, but "
                    f"{len(lacking)} tasks of {config.tasks.path} have none (e.g. {lacking[0]!r}; tasks.fields.reference "
                    f"is {config.tasks.fields.reference!r})"
                )
        built.append(BuiltGrader(spec, grader))
    return built
