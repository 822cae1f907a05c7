"""`ember rollouts grade` with the real graders on the real broker: HumanEval completions run against their tests
in the bubblewrap sandbox and judged by an LLM through a real OpenAI-compatible server (`transformers serve`), one
reward per grader per rollout in the transaction that commits the rollouts, counted by an independent consumer."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest

from ember.rollouts.transport import RolloutWriter
from tests.rollouts.etl_support import Deployment
from tests.rollouts.grading.judge_server import JudgeServer
from tests.rollouts.grading.support import (
    GraderProcess,
    code_rollout,
    fetch_humaneval,
    grader_settings,
    prepare,
    reward_counts,
    write_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("judge_server")]

KEY_ENV, KEY = "EMBER_TEST_REAL_GRADERS_KEY", "sk-ember-real-graders-0a1b2c3d"
RUBRIC = "Rate the answer from 0 to 10. Reply with the number only.\nQuestion: {prompt}\nAnswer: {completion}\nScore:"


def test_the_sandbox_and_the_judge_grade_humaneval_through_kafka_exactly_once(tmp_path, judge_server: JudgeServer, monkeypatch):
    from ember.rollouts.grading.tasks import load_tasks

    monkeypatch.setenv(KEY_ENV, KEY)  # the grader process inherits it; the config names the variable only
    path = fetch_humaneval(tmp_path)
    tasks = list(load_tasks(path, {"id": "id", "prompt": "prompt", "tests": "tests", "entry_point": "entry_point",
                                   "reference": "solution"}).values())[:5]
    deployment = Deployment.plaintext()
    prefix = f"test-real-graders-{uuid.uuid4().hex[:8]}"
    topics = prepare(deployment, prefix, partitions=2)
    right = [code_rollout(t, t.reference, f"right{i}", 0) for i, t in enumerate(tasks)]
    wrong = [code_rollout(t, t.reference.replace("return ", "return not ", 1), f"wrong{i}", 0) for i, t in enumerate(tasks)]
    hostile = [code_rollout(tasks[0], "    while True:\n        pass\n", "loop", 0),
               code_rollout(tasks[1], "    import sys\n    sys.exit(0)\n", "exits", 0)]
    with RolloutWriter(prefix, security=deployment.security("inference"), bootstrap_servers=deployment.bootstrap) as writer:
        for r in right + wrong + hostile:
            writer.write(r)

    digits = {judge_server.token_id(d): 100.0 for d in "0123456789"}  # a logit bias: well-formed one-digit scores
    graders = [
        {"name": "tests", "version": "1", "kind": "unit_tests", "settings": {"workers": 2, "limits": {"wall_s": 4, "cpu_s": 3}}},
        {"name": "judge", "version": "1", "kind": "judge", "settings": {
            "base_url": judge_server.url, "model": str(judge_server.model_dir), "api_key_env": KEY_ENV, "rubric": RUBRIC,
            "max_tokens": 1, "logit_bias": digits, "requests_per_minute": 60_000, "retries": 2, "timeout_s": 60,
            "cache_dir": str(tmp_path / "judge-cache")}},
    ]
    config = write_config(tmp_path / "grade.yaml", grader_settings(prefix, path, deployment, graders=graders))
    proc = GraderProcess(config, "0", tmp_path, "--until-idle", "3")
    assert proc.wait(400) == 0, proc.output()[-3000:]
    out = proc.output()
    assert KEY not in out

    counts, rewards = reward_counts(topics, deployment)
    every = right + wrong + hostile
    assert counts == Counter({(r.rollout_id, g): 1 for r in every for g in ("tests", "judge")}), out[-3000:]
    tests = {r.rollout_id: r for _p, r in rewards if r.grader == "tests"}
    assert {tests[r.rollout_id].verdict for r in right} == {"passed"} and {tests[r.rollout_id].score for r in right} == {1.0}
    assert {tests[r.rollout_id].verdict for r in wrong} <= {"failed", "crashed"} and {tests[r.rollout_id].score for r in wrong} == {0.0}
    assert tests["loop-0"].verdict == "timeout" and tests["exits-0"].verdict in ("failed", "crashed"), out[-3000:]
    judged = [r for _p, r in rewards if r.grader == "judge"]
    assert {r.verdict for r in judged} == {"scored"} and all(0.0 <= r.score <= 1.0 for r in judged)
    assert {r.grader_version for r in judged} == {next(iter(judged)).grader_version} and judged[0].grader_version.startswith("1/")
    assert f"{len(every)} rollouts graded, {2 * len(every)} rewards, 0 dead letters" in out, out[-3000:]
