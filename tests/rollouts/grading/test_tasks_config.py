"""Task sets, the grader config and the rule grader, without a broker: HumanEval as the fetch command writes it,
other field names mapped, bad rows named by file:line, and config errors that name the key."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from ember.configs import GraderConfigError
from ember.rollouts.cli import app
from ember.rollouts.grading.base import Task, Verdict
from ember.rollouts.grading.config import build_graders, load_config, parse_config
from ember.rollouts.grading.rule import RuleGrader, RuleSettings, extract_code
from ember.rollouts.grading.tasks import TaskSetError, load_tasks
from tests.rollouts.etl_support import REPO
from tests.rollouts.grading.support import fenced, fetch_humaneval

DEFAULT_FIELDS = {"id": "id", "prompt": "prompt", "tests": "tests", "entry_point": "entry_point", "reference": "solution"}


@pytest.fixture(scope="module")
def humaneval(tmp_path_factory):
    return fetch_humaneval(tmp_path_factory.mktemp("benchmarks"))


def _minimal(path: str, **extra) -> dict:
    return {
        "kafka": {"topic_prefix": "p", "group_id": "p-grader"},
        "tasks": {"path": path},
        "tokenizer": {"name": "cl100k_base"},
        "graders": [{"name": "match", "version": "1", "kind": "rule"}],
        **extra,
    }


def test_humaneval_as_fetched_loads_with_the_default_fields(humaneval):
    tasks = load_tasks(humaneval, DEFAULT_FIELDS)
    assert len(tasks) == 164
    first = tasks["HumanEval/0"]
    assert first.entry_point == "has_close_elements" and "def check(candidate)" in first.tests
    assert first.prompt.lstrip().startswith("from typing import List") and "return False" in first.reference


def test_other_field_names_are_mapped_and_parquet_reads_alike(tmp_path):
    rows = [{"task_id": 7, "text": "add two numbers", "test_list": ["assert f(1, 2) == 3", "assert f(0, 0) == 0"], "code": "def f(a, b): return a + b"}]
    fields = {"id": "task_id", "prompt": "text", "tests": "test_list", "entry_point": None, "reference": "code"}
    jsonl = tmp_path / "mbpp.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "mbpp.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    expected = Task("7", "add two numbers", "assert f(1, 2) == 3\nassert f(0, 0) == 0", "", "def f(a, b): return a + b")
    assert load_tasks(jsonl, fields) == {"7": expected}
    assert load_tasks(parquet, fields) == {"7": expected}


@pytest.mark.parametrize(
    "lines, error",
    [
        (['{"id": "a", "prompt": "p"}', "{not json"], r"bad.jsonl:2: not a JSON object"),
        (['{"id": "a", "prompt": "p"}', '["a list"]'], r"bad.jsonl:2: expected a JSON object, got list"),
        (['{"prompt": "p"}'], r"bad.jsonl:1: no id field 'id'"),
        (['{"id": "a"}'], r"bad.jsonl:1: no prompt field 'prompt'"),
        (['{"id": "a", "prompt": "p"}', "", '{"id": "a", "prompt": "q"}'], r"bad.jsonl:3: task id 'a' repeats"),
        (['{"id": "a", "prompt": "p", "tests": {"x": 1}}'], r"bad.jsonl:1: field 'tests' holds dict"),
        ([], r"bad.jsonl: the task set holds no task"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_and_line(tmp_path, lines, error):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TaskSetError, match=error) as caught:
        load_tasks(path, DEFAULT_FIELDS)
    assert "\n" not in str(caught.value)


def test_example_config_parses_and_errors_name_the_key(tmp_path):
    example = load_config(REPO / "ember" / "rollouts" / "grade.example.yaml")
    assert example.tasks.path == REPO / "ember" / "rollouts" / "benchmarks" / "humaneval.jsonl"
    assert [g.kind for g in example.graders] == ["rule"] and example.kafka.group_id == "ember-grader"
    with pytest.raises(GraderConfigError, match=r"graders\.0\.kind"):
        parse_config(_minimal("t.jsonl", graders=[{"name": "x", "version": "1", "kind": "vibes"}]))
    with pytest.raises(GraderConfigError, match=r"tasks\.feilds.*grade\.example\.yaml"):
        parse_config(_minimal("t.jsonl", tasks={"path": "t.jsonl", "feilds": {}}))
    twice = [{"name": "x", "version": "1", "kind": "rule"}] * 2
    with pytest.raises(GraderConfigError, match=r"names \['x'\] repeat"):
        parse_config(_minimal("t.jsonl", graders=twice))
    with pytest.raises(GraderConfigError, match="the grader creates no topics"):
        parse_config(_minimal("t.jsonl", kafka={"topic_prefix": "p", "group_id": "g", "create_topics": True}))
    with pytest.raises(GraderConfigError, match="is empty"):
        parse_config({})


def test_the_rule_grader_needs_references_and_valid_settings(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "prompt": "p", "solution": "x = 1"}\n{"id": "b", "prompt": "q"}\n')
    config = parse_config(_minimal(str(path)))
    with pytest.raises(GraderConfigError, match=r"graders\.0 .*1 tasks of .* have none \(e\.g\. 'b'"):
        build_graders(config, load_tasks(path, DEFAULT_FIELDS))
    bad = parse_config(_minimal(str(path), graders=[{"name": "m", "version": "1", "kind": "rule", "settings": {"match": "fuzzy"}}]))
    with pytest.raises(GraderConfigError, match=r"graders\.0\.settings \(rule grader 'm'\): match: "):
        build_graders(bad, {})
    sandboxed = parse_config(_minimal(str(path), graders=[{"name": "t", "version": "1", "kind": "unit_tests", "settings": {"workers": 0}}]))
    with pytest.raises(GraderConfigError, match=r"graders\.0\.settings \(unit_tests grader 't'\): workers: "):
        build_graders(sandboxed, {})


def test_a_judge_is_built_from_its_settings_and_its_rubric_goes_into_the_stamped_version(tmp_path, monkeypatch):
    """The judge's own version names its rubric: the rewards carry the config's version and the judge's, so a
    rubric edit is visible on every reward without anyone bumping `version`."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "prompt": "p"}\n')
    monkeypatch.setenv("JUDGE_KEY", "not-a-real-key")
    judge = {"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key_env": "JUDGE_KEY", "rubric": "Rate {completion} for {prompt}: 0-10"}
    config = parse_config(_minimal(str(path), graders=[{"name": "style", "version": "4", "kind": "judge", "settings": judge}]))
    (built,) = build_graders(config, load_tasks(path, DEFAULT_FIELDS))
    try:
        assert built.version.startswith("4/") and built.version.endswith(built.grader.rubric_hash[:12])
        assert built.keyed, "the judge caches under each rollout's sha256: the service must hand it the keys"
    finally:
        built.close()
    other = {**judge, "rubric": "Score {completion} given {prompt}, 0 to 10"}
    (rebuilt,) = build_graders(parse_config(_minimal(str(path), graders=[{"name": "style", "version": "4", "kind": "judge", "settings": other}])), {})
    rebuilt.close()
    assert rebuilt.version != built.version
    missing = {**judge, "api_key_env": "NO_SUCH_JUDGE_KEY_VARIABLE"}
    with pytest.raises(GraderConfigError, match=r"graders\.0\.settings \(judge grader 'style'\): .*NO_SUCH_JUDGE_KEY_VARIABLE"):
        build_graders(parse_config(_minimal(str(path), graders=[{"name": "style", "version": "4", "kind": "judge", "settings": missing}])), {})


def test_rule_grader_passes_the_canonical_solution_and_fails_a_changed_one(humaneval):
    tasks = load_tasks(humaneval, DEFAULT_FIELDS)
    exact = RuleGrader("exact", "1", RuleSettings(match="exact"))
    items = [(t, fenced(t.reference)) for t in tasks.values()]
    assert {g.verdict for g in exact.grade_batch(items)} == {Verdict.PASSED}
    wrong = [(t, fenced(t.reference.replace("return ", "return not ", 1))) for t in tasks.values() if "return " in t.reference]
    grades = exact.grade_batch(wrong)
    assert len(grades) > 150 and {(g.verdict, g.score, g.components["match"]) for g in grades} == {(Verdict.FAILED, 0.0, 0.0)}
    contains = RuleGrader("contains", "1", RuleSettings(match="contains"))
    task = tasks["HumanEval/0"]
    assert contains.grade(task, "```\nimport math\n" + task.reference + "\n# done\n```").verdict is Verdict.PASSED


def test_extract_code_prefers_a_python_block():
    assert extract_code("no fences at all") == "no fences at all"
    assert extract_code("```text\nnot code\n```\nthen\n```python\nx = 1\n```") == "x = 1\n"
    assert extract_code("```\ny = 2\n```") == "y = 2\n"


def test_cli_config_errors_exit_2_with_one_line(tmp_path, humaneval):
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump(_minimal(str(tmp_path / "nowhere.jsonl"))))
    result = CliRunner().invoke(app, ["grade", str(missing)])
    assert result.exit_code == 2 and "nowhere.jsonl: task set not found" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(_minimal(str(humaneval), tokenizer={"name": "no-such-tokenizer-anywhere"})))
    result = CliRunner().invoke(app, ["grade", str(typo)])
    assert result.exit_code == 2 and "no-such-tokenizer-anywhere" in result.output, result.output
