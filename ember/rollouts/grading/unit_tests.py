"""The unit-test grader: run each completion against its task's tests in the bubblewrap sandbox.

HumanEval style: the completion continues the prompt's function, or answers with a ```python fenced block holding
a full `def` of the entry point (the prompt still goes first, for its imports and helpers). The task's `check` is
split into tests, one per top-level statement that asserts, so a grade carries the fraction passed, not only
pass/fail. The verdict comes from the harness's report channel, never from the exit code (see harness.py).
"""

from __future__ import annotations

import ast
import functools
import json
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ember.rollouts.grading.base import Grade, Task, Verdict
from ember.rollouts.grading.sandbox import STARTUP_S, Sandbox, SandboxLimits, SandboxRun

HARNESS = (Path(__file__).with_name("harness.py")).read_text()
_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


class TaskError(ValueError):
    """A task whose tests cannot be graded (no `check` function, not Python)."""


def build_program(task: Task, completion: str) -> str:
    """The program the sandbox runs: the prompt, then the completion's body or its fenced full definition."""
    defines = re.compile(rf"^\s*(async\s+)?def\s+{re.escape(task.entry_point)}\s*\(", re.MULTILINE)
    for block in _FENCE.findall(completion):
        if defines.search(block):
            return f"{task.prompt}\n{block}"
    return task.prompt + completion


@functools.lru_cache(maxsize=4096)
def instrument_tests(tests: str, task_id: str) -> str:
    """`check` with each top-level asserting statement wrapped so that the harness counts it as one test."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as error:
        raise TaskError(f"task {task_id}: tests are not Python: {error}") from error
    checks = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if not checks:
        raise TaskError(f"task {task_id}: tests define no check(candidate) function")
    check = checks[-1]
    body: list[ast.stmt] = []
    for statement in check.body:
        if not any(isinstance(node, ast.Assert) for node in ast.walk(statement)):
            body.append(statement)
            continue
        record = [ast.Expr(ast.Call(ast.Name("_ember_record", ast.Load()), [ast.Constant(ok)], []))
                  for ok in (False, True)]  # fmt: skip
        handler = ast.ExceptHandler(type=ast.Name("Exception", ast.Load()), name=None, body=[record[0]])
        body.append(ast.Try(body=[statement], handlers=[handler], orelse=[record[1]], finalbody=[]))
    check.body = body
    return ast.unparse(ast.fix_missing_locations(tree))


class UnitTestGrader:
    """A `Grader` that runs completions in the sandbox, `workers` at a time; close it (or use `with`) to release
    the sandbox's cgroups."""

    def __init__(
        self, name: str = "unit_tests", version: str = "1", limits: SandboxLimits | None = None, workers: int = 2
    ) -> None:
        if not name or not version:
            raise ValueError("a grader needs a non-empty name and version")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.name = name
        self.version = version
        self.limits = limits or SandboxLimits()
        self._sandbox = Sandbox(self.limits, slots=workers)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"grader-{name}")

    def __enter__(self) -> UnitTestGrader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown()
        self._sandbox.close()

    def grade_batch(self, items: Sequence[tuple[Task, str]]) -> list[Grade]:
        return list(self._pool.map(lambda item: self.grade(*item), items))

    def grade(self, task: Task, completion: str) -> Grade:
        try:
            tests = instrument_tests(task.tests, task.prompt_id)
        except TaskError as error:
            return Grade(Verdict.SANDBOX_ERROR, 0.0, {"tests_passed": 0.0}, str(error))
        job = {
            "program": build_program(task, completion),
            "entry_point": task.entry_point,
            "prompt": task.prompt,
            "tests": tests,
            "limits": self.limits.rlimits(),
        }
        run = self._sandbox.run(HARNESS, json.dumps(job).encode())
        return self._grade(run)

    def _grade(self, run: SandboxRun) -> Grade:
        """The report decides; without one, how the run ended does. Output past its cap overrides both."""
        if run.output_exceeded:
            return _grade(Verdict.OUTPUT_LIMIT, 0.0, f"stdout and stderr passed {self.limits.output_bytes} bytes")
        if run.report is not None:
            report = json.loads(run.report)
            fraction = report["passed"] / report["total"] if report["total"] else 0.0
            return _grade(Verdict(report["outcome"]), fraction, report["detail"])
        if not run.started:  # before the wall clock: an interpreter that never came up is not the completion's timeout
            tail = run.stderr.decode("utf-8", "replace").strip()[-300:]
            why = f"not within {max(STARTUP_S, self.limits.wall_s):.0f} s" if run.timed_out else f"exit {run.returncode}"
            return _grade(Verdict.SANDBOX_ERROR, 0.0, f"the sandbox did not start ({why}): {tail}")
        if run.timed_out:
            return _grade(Verdict.TIMEOUT, 0.0, f"still running after {self.limits.wall_s} s (wall clock)")
        return _grade(Verdict.CRASHED, 0.0, f"the harness was killed before it reported (exit {run.returncode})")


def _grade(verdict: Verdict, fraction: float, detail: str) -> Grade:
    score = 1.0 if verdict is Verdict.PASSED else 0.0
    return Grade(verdict, score, {"tests_passed": fraction}, detail)
