"""What an operator sees of a grading process: its /metrics after a run (graded, verdicts, dead letters, wall
time, lag, transactions, a grader's own metrics through the hook) and the dashboard panels that chart them."""

from __future__ import annotations

import json
import re
from dataclasses import replace
import threading
import urllib.request
import uuid
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from ember.rollouts.grading.base import Grade, Task, Verdict
from ember.rollouts.grading.config import build_graders, parse_config
from ember.rollouts.grading.metrics import GraderMetrics
from ember.rollouts.grading.rule import RuleGrader
from ember.rollouts.grading.service import GradingService
from tests.rollouts.etl_support import REPO, Deployment
from tests.rollouts.grading.support import TOKENIZER, code_rollout, fenced, grader_settings, prepare
from tests.rollouts.grading.test_service import _write, humaneval  # noqa: F401  (a fixture)

DASHBOARD = REPO / "infra" / "grafana" / "ember-etl.json"


class CountingRule(RuleGrader):
    """The rule grader plus a metric of its own, registered through the service's hook as the judge's are."""

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        self.graded = Counter("ember_test_grader_items", "Completions this grader saw", registry=registry)

    def grade_batch(self, items: Sequence[tuple[Task, str]]) -> list[Grade]:
        self.graded.inc(len(items))
        return super().grade_batch(items)


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_dashboard_charts_every_grader_metric():
    queried = " ".join(_dashboard_exprs())
    unseen = sorted(f.name for f in GraderMetrics().registry.collect() if f.name not in queried)
    assert not unseen, f"grader metrics without a panel in {DASHBOARD.name}: {unseen}"


@pytest.mark.integration
def test_metrics_after_a_run_count_what_was_committed(humaneval):  # noqa: F811
    path, tasks = humaneval
    deployment = Deployment.plaintext()
    prefix = f"test-grade-metrics-{uuid.uuid4().hex[:8]}"
    prepare(deployment, prefix, partitions=2)
    chosen = list(tasks.values())[:4]
    _write(deployment, prefix, [code_rollout(t, fenced(t.reference), f"m{i}", 0) for i, t in enumerate(chosen)]
           + [code_rollout("nowhere", "x", "lost", 0)])
    config = parse_config(grader_settings(prefix, path, deployment, graders=[{"name": "exact", "version": "1", "kind": "rule"}]))
    (built,) = build_graders(config, tasks)
    hooked = CountingRule(built.spec.name, built.spec.version, built.grader.settings)
    metrics = GraderMetrics()
    port = metrics.serve(0)
    service = GradingService(config, tasks, TOKENIZER.decode, [replace(built, grader=hooked)], "0", metrics)
    runner = threading.Thread(target=service.run, kwargs={"until_idle_s": 1.0, "ready_timeout_s": 60})
    runner.start()
    runner.join(timeout=120)
    assert not runner.is_alive()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("ember_grader_rollouts_total", ())] == 4
    assert samples[("ember_grader_verdicts_total", (("grader", "exact"), ("verdict", Verdict.PASSED.value)))] == 4
    assert samples[("ember_grader_dead_letters_total", (("reason", "unknown_prompt"),))] == 1
    assert samples[("ember_grader_transactions_total", (("result", "committed"),))] >= 1
    assert samples[("ember_grader_batch_seconds_count", (("grader", "exact"),))] >= 1
    assert sum(v for (name, _), v in samples.items() if name == "ember_grader_consumer_lag") == 0
    assert samples[("ember_test_grader_items_total", ())] == 4, "a grader's own metrics are served by the hook"
    queried = {n for expr in _dashboard_exprs() for n in re.findall(r"\bember_grader_[a-z_]+\b", expr)}
    missing = sorted(queried - {name for name, _ in samples})
    assert len(queried) >= 6 and not missing, f"the dashboard queries metrics /metrics does not have: {missing}"
