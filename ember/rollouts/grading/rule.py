"""The rule grader: a completion's code against the task's reference answer, without running anything.

It is real judgement for tasks whose answer is known text (a canonical solution, a final answer), and it is
what lets the grading service run end to end where no sandbox or judge is configured. The code is what a
fenced block holds (the first ```python block, else the first block), else the whole completion; both sides
are compared with trailing spaces and blank lines at the ends dropped, so formatting noise is not a miss.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from ember.configs import StrictModel
from ember.rollouts.grading.base import Grade, Task, Verdict

_FENCE = re.compile(r"^```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def extract_code(completion: str) -> str:
    """The code of a completion: a ```python fenced block, else the first fenced block, else all of it."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    python = [body for language, body in blocks if language.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[0]


def normalized(text: str) -> str:
    """Lines without trailing whitespace, without blank lines at either end; line endings as \\n."""
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n")).strip("\n")


class RuleSettings(StrictModel):
    """A `rule` grader's `settings`."""

    match: Literal["exact", "contains"] = Field(
        "exact", description="exact: the code is the reference; contains: the reference appears in the code"
    )


class RuleGrader:
    """Scores 1.0 (passed) when the completion's code matches the task's reference, else 0.0 (failed)."""

    needs_reference = True

    def __init__(self, name: str, version: str, settings: RuleSettings):
        self.name = name
        self.version = version
        self.settings = settings

    def grade(self, task: Task, completion: str) -> Grade:
        code, reference = normalized(extract_code(completion)), normalized(task.reference)
        hit = code == reference if self.settings.match == "exact" else reference in code
        score = 1.0 if hit else 0.0
        detail = "" if hit else f"{self.settings.match} match against the reference of {task.prompt_id} failed"
        return Grade(Verdict.PASSED if hit else Verdict.FAILED, score, {"match": score}, detail)

    def grade_batch(self, items: Sequence[tuple[Task, str]]) -> list[Grade]:
        return [self.grade(task, completion) for task, completion in items]
