"""`ember rollouts grade`'s YAML configuration: Kafka, the task set, the policy's tokenizer and the graders.

Typed and strict like the ETL's (`ember.rollouts.config`): an unknown key fails at start with its dotted path.
Kafka settings and security are the ETL's own models, so a grader is pointed at a deployment the same way.
Each grader names its kind and the kind's own settings; `build_graders` imports a kind's module only when a
config uses it, so the judge's HTTP client or the sandbox costs nothing to a deployment that does not run them.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, IPvAnyAddress, ValidationError, model_validator

from ember import configs
from ember.configs import GraderConfigError, StrictModel, error_lines
from ember.rollouts.config import KafkaSettings
from ember.rollouts.grading.base import Grader, Task
from ember.rollouts.grading.rule import RuleGrader, RuleSettings
from ember.tokenize.config import TokenizerConfig

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


class UnitTestSettings(StrictModel):
    """A `unit_tests` grader's `settings`."""

    workers: int = Field(2, ge=1, le=256, description="completions run in this many sandboxes at once")
    limits: dict[str, float] = Field(
        default_factory=dict, description="sandbox limits by name (wall_s, cpu_s, memory_mb, ...: SandboxLimits); others default"
    )


@dataclass(frozen=True)
class BuiltGrader:
    """A configured grader, and what the service stamps on its rewards: the config's name, and the config's version
    followed by the grader's own when it keeps one (the judge's names its rubric: `1/judge-1+3fa2...`)."""

    spec: GraderSpec
    grader: Grader
    version: str
    keyed: bool  # its grade_batch takes `keys` (the judge caches grades under each rollout's sha256)

    def close(self) -> None:
        close = getattr(self.grader, "close", None)
        if close is not None:
            close()


def _make(spec: GraderSpec) -> Grader:
    if spec.kind == "rule":
        return RuleGrader(spec.name, spec.version, RuleSettings.model_validate(spec.settings))
    if spec.kind == "judge":
        from ember.rollouts.grading.judge import JudgeError, JudgeSettings, LLMJudge

        settings = JudgeSettings.model_validate(spec.settings)
        try:
            return LLMJudge(settings)
        except JudgeError as exc:  # its key cannot be read: the message names the source, never the key
            raise ValueError(str(exc)) from None
    from dataclasses import fields

    from ember.rollouts.grading.sandbox import SandboxLimits
    from ember.rollouts.grading.unit_tests import UnitTestGrader

    settings = UnitTestSettings.model_validate(spec.settings)
    known = {f.name for f in fields(SandboxLimits)}
    if unknown := sorted(set(settings.limits) - known):
        raise ValueError(f"unknown sandbox limit {', '.join(unknown)}: one of {', '.join(sorted(known))}")
    return UnitTestGrader(spec.name, spec.version, SandboxLimits(**settings.limits), settings.workers)


def build_graders(config: GraderConfig, tasks: Mapping[str, Task]) -> list[BuiltGrader]:
    """Each configured grader, built with its kind's settings; bad settings, or a grader that needs what the task set
    lacks, are a GraderConfigError naming the grader."""
    built = []
    for i, spec in enumerate(config.graders):
        where = f"graders.{i}.settings ({spec.kind} grader {spec.name!r})"
        try:
            grader = _make(spec)
        except ValidationError as exc:
            raise GraderConfigError(f"{where}: {'; '.join(error_lines(exc))}") from None
        except (ValueError, TypeError) as exc:  # a limit the sandbox refuses, a judge key that cannot be read
            raise GraderConfigError(f"{where}: {exc}") from None
        if getattr(grader, "needs_reference", False):
            lacking = sorted(p for p, t in tasks.items() if not t.reference)
            if lacking:
                raise GraderConfigError(
                    f"graders.{i} ({spec.kind} grader {spec.name!r}) compares with each task's reference, but "
                    f"{len(lacking)} tasks of {config.tasks.path} have none (e.g. {lacking[0]!r}; tasks.fields.reference "
                    f"is {config.tasks.fields.reference!r})"
                )
        own = str(getattr(grader, "version", spec.version))
        version = spec.version if own == spec.version else f"{spec.version}/{own}"
        built.append(BuiltGrader(spec, grader, version, "keys" in inspect.signature(grader.grade_batch).parameters))
    return built
