"""The LLM judge against a real OpenAI-compatible server (`transformers serve`, tests/rollouts/grading/judge_server.py)."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from ember import configs
from ember.rollouts.grading.base import Task, Verdict
from ember.rollouts.grading.judge import JudgeError, JudgeSettings, LLMJudge, parse_score
from tests.rollouts.grading.judge_server import JudgeServer

KEY = "sk-ember-judge-test-9f8e7d6c5b4a"
KEY_ENV = "EMBER_TEST_JUDGE_KEY"
RUBRIC = "Rate the answer from 0 to 10. Reply with the number only.\nQuestion: {prompt}\nAnswer: {completion}\nScore:"
SWAP = "Which answer is better, 0 (second) to 10 (first)?\nQuestion: {prompt}\nFirst: {first}\nSecond: {second}\nScore:"
pytestmark = pytest.mark.xdist_group("judge_server")  # one server (a minute of CPU to start) for all of these

TASKS = [Task(f"p{i}", f"def add{i}(a, b):", reference="    return a + b") for i in range(6)]


@pytest.fixture(autouse=True)
def judge_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


def settings(server: JudgeServer, **overrides: object) -> JudgeSettings:
    values: dict = dict(
        base_url=server.url, model=str(server.model_dir), api_key_env=KEY_ENV, rubric=RUBRIC, max_tokens=1,
        requests_per_minute=60_000, backoff_s=0.0, backoff_max_s=0.0, retries=2, timeout_s=30,
    )  # fmt: skip
    return JudgeSettings(**(values | overrides))


def shaped(server: JudgeServer, *digits: str) -> dict[int, float]:
    """A logit bias that makes the tiny model answer with one of `digits` (a well-formed score)."""
    return {server.token_id(d): 100.0 for d in digits}


def test_settings_refuse_bad_templates_and_never_show_the_key() -> None:
    base = dict(base_url="http://127.0.0.1:1/v1", model="m", api_key_env=KEY_ENV)
    cases = {
        "placeholders ['{completion}', '{prompt}']; missing ['completion']": dict(rubric="{prompt} only"),
        "unknown ['answer']": dict(rubric="{prompt} {completion} {answer}"),
        "not a valid template": dict(rubric="{prompt} {completion} {"),
        "exactly one key source": dict(rubric=RUBRIC, api_key_file="/k"),
        "swap_rubric must use exactly": dict(rubric=RUBRIC, swap_rubric="{prompt} {first}"),
        "score_min (5) must be below score_max (5)": dict(rubric=RUBRIC, score_min=5, score_max=5),
        "api_key cannot be given in a config": dict(rubric=RUBRIC, api_key=KEY),
        "api_key_env: String should match pattern": dict(rubric=RUBRIC, api_key_env=KEY),  # pasted where the name goes
    }
    for expected, values in cases.items():
        with pytest.raises(ValidationError) as exc:
            JudgeSettings.model_validate(base | values)
        lines = "\n".join(configs.error_lines(exc.value, model=JudgeSettings))
        assert expected in lines, lines
        assert KEY not in lines
    with pytest.raises(JudgeError, match="the environment variable EMBER_TEST_UNSET_KEY .api_key_env. is unset or empty"):
        LLMJudge(JudgeSettings.model_validate(base | dict(rubric=RUBRIC, api_key_env="EMBER_TEST_UNSET_KEY")))
    with pytest.raises(JudgeError, match="api_key_file /nonexistent/key: cannot read it: No such file"):
        LLMJudge(JudgeSettings.model_validate(base | dict(rubric=RUBRIC, api_key_env=None, api_key_file="/nonexistent/key")))


def test_parse_score_accepts_one_number_in_range_only() -> None:
    assert parse_score(" 7\n", 0, 10) == 7.0
    assert parse_score("2.5", 0, 10) == 2.5
    for answer in ("", "7/10", "Score: 7", "777", "-1", "7 7", "seven", "1e1"):
        with pytest.raises(ValueError):
            parse_score(answer, 0, 10)


def test_nonsense_answers_are_malformed_after_retries(judge_server: JudgeServer) -> None:
    before = judge_server.chat_requests()
    registry = CollectorRegistry()
    with LLMJudge(settings(judge_server, max_tokens=6, retries=2)) as judge:
        judge.bind_metrics(registry)
        grades = judge.grade_batch([(task, "    return a - b") for task in TASKS[:3]])
    assert [g.verdict for g in grades] == [Verdict.MALFORMED] * 3, grades
    assert all(g.score == 0.0 and not g.components and "after 2 retries" in g.detail for g in grades)
    assert judge_server.chat_requests() - before == 3 * 3  # each asked once and retried twice
    assert registry.get_sample_value("ember_judge_errors_total", {"kind": "malformed"}) == 9, "every try counted"
    assert registry.get_sample_value("ember_judge_request_seconds_count") == 9


def test_a_well_formed_answer_is_scored(judge_server: JudgeServer) -> None:
    with LLMJudge(settings(judge_server, logit_bias=shaped(judge_server, "7"))) as judge:
        grades = judge.grade_batch([(Task("p", "q"), "a"), (Task("r", "s"), "b")])
    assert [(g.verdict, g.score, g.components) for g in grades] == [(Verdict.SCORED, 0.7, {"judge_score": 7.0})] * 2


def test_swap_check_asks_both_orders_and_records_disagreement(judge_server: JudgeServer) -> None:
    """Biased toward 3 and 7 alike, the random model picks one regardless of order (a position bias, which the
    check exists to catch); the grade must state what the server said in each order."""
    config = settings(judge_server, swap_rubric=SWAP, logit_bias=shaped(judge_server, "3", "7"))
    raw = openai.OpenAI(base_url=judge_server.url, api_key=KEY, max_retries=0)
    with LLMJudge(config) as judge:
        items = [(task, f"    return a + b + {i}") for i, task in enumerate(TASKS)]
        grades = judge.grade_batch(items)
        for (task, completion), grade in zip(items, grades):
            first, second = (
                float(raw.chat.completions.create(
                    model=config.model, messages=[{"role": "user", "content": q}], max_tokens=1, temperature=0.0,
                    logit_bias={str(k): v for k, v in config.logit_bias.items()},
                ).choices[0].message.content)
                for q in judge.render(task, completion)
            )  # fmt: skip
            assert grade.verdict is Verdict.SCORED
            assert grade.components["judge_score_first"] == first
            assert grade.components["judge_score_second"] == 10 - second
            assert grade.components["swap_disagreement"] == abs(first - (10 - second)) / 10
            assert grade.score == pytest.approx((first + 10 - second) / 20)
    assert any(g.components["swap_disagreement"] > 0 for g in grades), "the random judge agreed with itself in both orders"


def request_times(into: list[float]) -> httpx.AsyncClient:
    async def record(request: httpx.Request) -> None:
        into.append(time.monotonic())

    return httpx.AsyncClient(event_hooks={"request": [record]})


def test_requests_per_minute_holds(judge_server: JudgeServer) -> None:
    sent: list[float] = []
    n, rpm = 8, 240  # 0.25 s apart
    config = settings(judge_server, requests_per_minute=rpm, max_concurrency=4, logit_bias=shaped(judge_server, "7"))
    with LLMJudge(config, http_client=request_times(sent)) as judge:
        grades = judge.grade_batch([(task, f"c{i}") for i, task in enumerate(TASKS + TASKS[:2])])
    assert all(g.verdict is Verdict.SCORED for g in grades)
    assert len(sent) == n
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert sent[-1] - sent[0] >= (n - 1) * 60 / rpm * 0.95, gaps
    assert statistics.median(gaps) >= 60 / rpm * 0.95, gaps


def test_tokens_per_minute_holds(judge_server: JudgeServer) -> None:
    """A minute's bucket holds 10 requests' tokens: those go at once, the 11th waits for one request's refill (6 s)."""
    sent: list[float] = []
    items = [(Task("p", "q"), f"c{i:02d}") for i in range(11)]  # every question the same length
    per_request = -(-len(RUBRIC.format(prompt="q", completion="c00").encode()) // 3) + 1  # the judge's estimate
    config = settings(judge_server, tokens_per_minute=10 * per_request, logit_bias=shaped(judge_server, "7"))
    with LLMJudge(config, http_client=request_times(sent)) as judge:
        grades = judge.grade_batch(items)
    assert all(g.verdict is Verdict.SCORED for g in grades)
    assert sent[9] - sent[0] < 6.0 * 0.95  # the burst did not wait for a refill...
    assert sent[10] - sent[0] >= 6.0 * 0.95  # ...the request past it did


def test_a_slow_answer_times_out_and_is_unavailable(judge_server: JudgeServer) -> None:
    """400 tokens take the tiny model most of a second; a 50 ms limit cuts every try."""
    sent: list[float] = []
    registry = CollectorRegistry()
    with LLMJudge(settings(judge_server, max_tokens=400, timeout_s=0.05, retries=1), http_client=request_times(sent)) as judge:
        judge.bind_metrics(registry)
        (grade,) = judge.grade_batch([(Task("slow", "q"), "c")])
    assert grade.verdict is Verdict.UNAVAILABLE, grade
    assert registry.get_sample_value("ember_judge_errors_total", {"kind": "timeout"}) == 2
    assert "APITimeoutError" in grade.detail and "slow" in grade.detail
    assert len(sent) == 2


def test_the_server_killed_mid_request_and_restarted_is_survived(judge_server: JudgeServer) -> None:
    """SIGKILL while a batch streams requests 4 at a time; the judge retries through the restart and every grade is
    the server's answer, none UNAVAILABLE."""
    config = settings(
        judge_server, logit_bias=shaped(judge_server, "7"), retries=20, backoff_s=1.0, backoff_max_s=10.0
    )  # ~3 min of retries, for a restart that takes 20-50 s on a loaded machine
    items = [(Task(f"k{i}", "q"), f"c{i}") for i in range(40)]
    served = judge_server.chat_requests()
    grades: list = []
    with LLMJudge(config) as judge:
        batch = threading.Thread(target=lambda: grades.extend(judge.grade_batch(items)))
        batch.start()
        deadline = time.monotonic() + 60
        while judge_server.chat_requests() == served and time.monotonic() < deadline:
            time.sleep(0.01)
        judge_server.kill()
        answered_before_kill = judge_server.chat_requests() - served
        judge_server.start()
        batch.join(timeout=300)
        assert not batch.is_alive()
    assert 0 < answered_before_kill < len(items), "the kill did not land inside the batch"
    assert [g.verdict for g in grades] == [Verdict.SCORED] * len(items), grades
    # every item answered, before the kill or after (one answered just as the server died is asked again)
    assert judge_server.chat_requests() - served >= len(items)


def test_a_refused_request_is_unavailable_at_once(judge_server: JudgeServer) -> None:
    """A 4xx (here a 404 from a wrong base_url) would be refused again: no retry."""
    wrong = settings(judge_server, base_url=judge_server.url.removesuffix("/v1") + "/nope", retries=3)
    with LLMJudge(wrong) as judge:
        (grade,) = judge.grade_batch([(Task("lost", "q"), "c")])
    assert grade.verdict is Verdict.UNAVAILABLE and "refused: HTTP 404" in grade.detail, grade
    assert judge_server.log_path.read_text(errors="replace").count('"POST /nope/chat/completions') == 1


def test_a_dead_endpoint_is_unavailable_and_the_key_never_shows(
    judge_server: JudgeServer, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.DEBUG)
    dead = settings(judge_server, base_url="http://127.0.0.1:9/v1", retries=1)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    nonsense = settings(judge_server, api_key_env=None, api_key_file=key_file, max_tokens=4, retries=0)
    with LLMJudge(dead) as down, LLMJudge(nonsense) as babbling:
        (unavailable,) = down.grade_batch([(Task("down", "q"), "c")])
        (malformed,) = babbling.grade_batch([(Task("babble", "q"), "c")])
    assert unavailable.verdict is Verdict.UNAVAILABLE and "APIConnectionError" in unavailable.detail
    assert malformed.verdict is Verdict.MALFORMED
    out, err = capfd.readouterr()
    seen = "\n".join([caplog.text, out, err, unavailable.detail, malformed.detail, judge_server.log_path.read_text(errors="replace")])
    assert "judge: prompt down unavailable" in caplog.text  # the logs were captured, and hold no key
    assert KEY not in seen


def test_the_cache_means_a_restarted_judge_never_asks_again(judge_server: JudgeServer, tmp_path: Path) -> None:
    config = settings(judge_server, cache_dir=tmp_path / "cache", logit_bias=shaped(judge_server, "7"))
    items = [(task, "    return a + b") for task in TASKS[:3]]
    start = judge_server.chat_requests()
    with LLMJudge(config) as judge:
        first = judge.grade_batch(items)
    assert judge_server.chat_requests() - start == 3
    with LLMJudge(config) as restarted:
        again = restarted.grade_batch(items)
        keyed = restarted.grade_batch(items[:1], keys=["rollout-sha256-of-a-new-rollout"])
    assert again == first and [g.verdict for g in keyed] == [Verdict.SCORED]
    assert judge_server.chat_requests() - start == 4  # only the new key was asked
    with LLMJudge(config.model_copy(update={"rubric": RUBRIC + " "})) as changed:
        changed.grade_batch(items[:1])
    assert judge_server.chat_requests() - start == 5  # another rubric's grades are not reused
