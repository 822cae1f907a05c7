"""What every grader shares: the task it grades against, the verdict it reaches, and the one call the
grading service makes. No Kafka, Beam or torch here: a grader is pure judgement over text, so the sandboxed
unit-test grader and the LLM judge can be run, tested and benchmarked without a broker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class Verdict(StrEnum):
    """How one grading ended; every outcome has a name, so none is ever guessed or silently scored 0."""

    PASSED = "passed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    OUTPUT_LIMIT = "output_limit"
    CRASHED = "crashed"
    FORBIDDEN = "forbidden"
    SANDBOX_ERROR = "sandbox_error"
    SCORED = "scored"
    MALFORMED = "malformed"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Task:
    """One prompt of a task set: what the policy was asked, and what checks its answer."""

    prompt_id: str
    prompt: str
    tests: str = ""
    entry_point: str = ""
    reference: str = ""  # a known-good answer (HumanEval's canonical solution): the judge's swap check and rule graders compare with it


@dataclass(frozen=True)
class Grade:
    """A grader's judgement of one completion. `score` is what the reward carries; `components` are named
    parts of it (tests passed, judge score, ...) kept for the ETL's weighted join and for operators."""

    verdict: Verdict
    score: float
    components: dict[str, float] = field(default_factory=dict)
    detail: str = ""


class Grader(Protocol):
    """A named, versioned judge of completions. The service hands it a batch so that it can run the batch
    concurrently (sandboxes in parallel, judge requests under its rate limits); grades come back in order."""

    name: str
    version: str

    def grade_batch(self, items: Sequence[tuple[Task, str]]) -> list[Grade]: ...
