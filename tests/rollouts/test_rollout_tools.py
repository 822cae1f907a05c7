"""The operator's rollout tools against the real broker: topics created only on purpose (and deleted
with confirmation), a tail that decodes every ember topic, `stats --watch`, the ETL's status lines and
exit summary, and a Grafana dashboard that queries only metrics a running ETL exposes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from ember.rollouts.admin import delete_topics, list_topics
from ember.rollouts.cli import rollouts_app
from ember.rollouts.metrics import EtlMetrics
from ember.rollouts.topics import Topics
from tests.ports import free_port
from tests.rollouts.etl_support import (
    REPO,
    EtlProcess,
    books,
    check_books,
    etl_settings,
    publish_in_background,
    wait_for_books,
    workload,
    write_config,
)

pytestmark = pytest.mark.integration

REWARD_TIMEOUT_S = 6.0
DASHBOARD = REPO / "infra" / "grafana" / "ember-etl.json"
runner = CliRunner()


def _prefix_topics(kafka: str, prefix: str) -> set[str]:
    return {t for t in list_topics(kafka) if t.startswith(prefix + ".")}


def _wait_gone(kafka: str, prefix: str, timeout_s: float = 20.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _prefix_topics(kafka, prefix)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture(scope="module")
def etl_run(kafka, tmp_path_factory):
    """Topics made by `topics create`, a faulty workload, and `ember rollouts etl` as a process with a
    1-second status interval and a /metrics endpoint, scraped once the books balance, then SIGTERM."""
    tmp = tmp_path_factory.mktemp("tools")
    prefix = f"test-tools-{uuid.uuid4().hex[:8]}"
    created = runner.invoke(rollouts_app, ["topics", "create", "--prefix", prefix, "--partitions", "2"])
    assert created.exit_code == 0, created.output
    assert created.output.count(": created") == len(Topics(prefix).specs())
    port = free_port()
    settings = etl_settings(
        prefix,
        partitions=2,
        rewards={"timeout_s": REWARD_TIMEOUT_S},
        metrics={"port": port, "status_interval_s": 1},
    )
    config_path = tmp / "etl.yaml"
    write_config(config_path, settings)
    topics = Topics(prefix)
    work = workload(prefix, groups=12, group_interval_s=0.2, p_malformed=0.2, policy_versions=2)
    proc = EtlProcess(config_path, "0", tmp)
    try:
        thread, _ = publish_in_background(work, topics)
        thread.join(timeout=120)
        wait_for_books(topics, work, timeout_s=120, alive=lambda: proc.proc.poll() is None)
        time.sleep(2.5)  # at least two status intervals after the last batch
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            scraped = response.read().decode()
        code = proc.stop()
    finally:
        proc.kill()
    assert code == 0, proc.output()[-3000:]
    yield {"prefix": prefix, "topics": topics, "work": work, "config": config_path, "log": proc.output(), "metrics": scraped}
    delete_topics(kafka, [s.name for s in topics.specs().values()])


# ---- the ETL's status lines and exit summary ---------------------------------------------------

STATUS = re.compile(r"ETL 0 rollouts [\d.]+/s batches [\d.]+/s unread \d+ held \d+(?: in \d+ groups|/\d+g)? dropped (\d+)")


def test_etl_logs_a_status_line_every_interval_and_a_summary_on_exit(etl_run):
    found = check_books(etl_run["topics"], etl_run["work"], REWARD_TIMEOUT_S)
    lines = etl_run["log"].splitlines()
    status = [line for line in lines if STATUS.search(line)]
    assert len(status) >= 3, etl_run["log"][-3000:]
    assert int(STATUS.search(status[-1]).group(1)) == len(found.dropped)
    assert any(re.search(r"rollouts [1-9][\d.]*/s", line) for line in status), "no line saw rollouts flowing"
    summary_at = next(i for i, line in enumerate(lines) if "ETL 0 stopped after" in line)
    summary = lines[summary_at : summary_at + 4]
    text = "\n".join(summary)
    assert f"{len(found.batch_ids)} batches, {len(found.batched)} rollouts" in text, text
    assert f"{len(found.dropped)} rollouts dropped" in text and f"{len(found.dead_letters)} dead letters" in text, text
    if found.dropped:
        counts = Counter(o.reason for o in found.dropped)
        first = re.search(r"rollouts dropped: (\w+) (\d+)", text)
        assert first and counts[first.group(1)] == int(first.group(2)) == max(counts.values()), (counts, text)
    too_wide = [line for line in status + summary if len(line) > 100]
    assert not too_wide, too_wide


# ---- Grafana ------------------------------------------------------------------------------------


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


REGION_ONLY = {"ember_etl_replication_lag_records", "ember_etl_replication_lag_seconds"}
"""Exposed only by an ETL reading mirrored regions (tests/rollouts/test_regions.py reads them from such an ETL)."""


def test_grafana_dashboard_queries_only_metrics_a_running_etl_exposes(etl_run):
    exposed = {s.name for f in text_string_to_metric_families(etl_run["metrics"]) for s in f.samples}
    queried = {name for expr in _dashboard_exprs() for name in re.findall(r"\bember_etl_[a-z_]+\b", expr)}
    assert len(queried) >= 15
    missing = sorted(queried - exposed - REGION_ONLY)
    assert not missing, f"the dashboard queries metrics /metrics does not have: {missing}"


def test_grafana_dashboard_charts_every_etl_metric():
    queried = " ".join(_dashboard_exprs())
    families = {f.name for f in EtlMetrics().registry.collect()}
    unseen = sorted(f for f in families if f not in queried)
    assert not unseen, f"metrics without a panel in {DASHBOARD.name}: {unseen}"


# ---- tail ---------------------------------------------------------------------------------------

TAIL_LINES = {
    "rollouts": r"rollout \S+ v\d+ \d+ tokens \(\d+ policy\) \w+",
    "rewards": r"reward \S+ unit-tests -?[\d.e+-]+",
    "policy_versions": r"policy version [01] announced \d{4}-\d\d-\d\d",
    "train_batches": r"batch \S+ step \d+ \d+ rollouts ~\d+ groups \d+ tokens v\d+-\d+ adv -?[\d.]+\.\.-?[\d.]+",
    "dead_letter": r"dead letter malformed from {prefix}\.rollouts\[\d\]@\d+ \(\d+ bytes kept\): \S",
    "outcomes": r"ledger (batch \d+ rollouts \d+ tokens v\d+-\d+|rollout_dropped \w+ group \S+ rollout \S+ \d+ tokens from \S+@\d+"
    r"|reward_dropped \w+ group|dead_letter \w+ group)",
    "etl_state": r"etl state shard \d (rewards|rollouts)@\d+",
}


@pytest.mark.parametrize("role", sorted(TAIL_LINES))
def test_tail_decodes_every_ember_topic_and_honours_limit(etl_run, role):
    name = etl_run["topics"].specs()[role].name
    result = runner.invoke(rollouts_app, ["tail", name, "--limit", "2", "--idle-timeout", "3"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 2, result.output
    pattern = re.compile(re.escape(f"{name}[") + r"\d\]@\d+ " + TAIL_LINES[role].replace("{prefix}", re.escape(etl_run["prefix"])))
    # The workload plants malformed rollouts (p 0.2): one of the first two may be one, shown as `bad: <why>`
    # (every bad line and its reason: test_tail_shows_every_message_and_names_the_bad_ones).
    bad = re.compile(re.escape(f"{name}[") + r"\d\]@\d+ bad: \S")
    assert any(pattern.match(line) for line in lines), result.output
    assert all(pattern.match(line) or (role == "rollouts" and bad.match(line)) for line in lines), result.output


def test_tail_shows_every_message_and_names_the_bad_ones(etl_run):
    work = etl_run["work"]
    result = runner.invoke(rollouts_app, ["tail", etl_run["topics"].rollouts, "--limit", "10000", "--idle-timeout", "3"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == work.rollout_messages + work.malformed
    bad = [line for line in lines if " bad: " in line]
    assert len(bad) == work.malformed and all(re.match(r"\S+\.rollouts\[\d\]@\d+ bad: \S", line) for line in bad), bad


def test_tail_of_a_missing_topic_is_an_error(kafka):
    name = f"test-missing-{uuid.uuid4().hex[:8]}.rollouts"
    result = runner.invoke(rollouts_app, ["tail", name, "--limit", "2"])
    assert result.exit_code == 2 and f"topic {name} does not exist" in result.output, result.output
    assert name not in list_topics(kafka), "tail must not create what it reads"


# ---- stats --watch ------------------------------------------------------------------------------


def test_stats_watch_refreshes_until_stopped(etl_run):
    result = runner.invoke(rollouts_app, ["stats", str(etl_run["config"]), "--watch", "--interval", "0.2", "--count", "3", "--window", "0"])
    assert result.exit_code == 0, result.output
    assert result.output.count("Ctrl-C to stop") == 3, result.output
    assert result.output.count("rollout ETL") == 3 and "input lag" in result.output


# ---- topics: created on purpose, deleted with confirmation --------------------------------------


def _etl(config: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ember.cli", "rollouts", "etl", str(config), *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )


def test_etl_refuses_a_prefix_without_topics_unless_told_to_create_them(kafka, tmp_path):
    prefix = f"test-typo-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "etl.yaml"
    write_config(config, etl_settings(prefix, partitions=2))
    refused = _etl(config)
    out = refused.stdout + refused.stderr
    assert refused.returncode == 2, out
    assert f"\n  ember rollouts topics create --prefix {prefix} --partitions 2\n" in out, "the command on a line of its own"
    out = " ".join(out.split())
    needed = {s.name for role, s in Topics(prefix).specs().items() if role not in ("events", "opt_out")}  # product-only
    for name in needed:
        assert name in out, out
    assert "--create-topics" in out, out
    assert not _prefix_topics(kafka, prefix), "a refused prefix must leave no topics behind"
    try:
        created = _etl(config, "--create-topics", "--until-idle", "1")
        assert created.returncode == 0, created.stdout + created.stderr
        assert _prefix_topics(kafka, prefix) == needed
    finally:
        delete_topics(kafka, sorted(_prefix_topics(kafka, prefix)))


def test_topics_delete_lists_asks_and_deletes(kafka):
    prefix = f"test-delete-{uuid.uuid4().hex[:8]}"
    names = {s.name for s in Topics(prefix).specs().values()}
    assert runner.invoke(rollouts_app, ["topics", "create", "--prefix", prefix, "--partitions", "1"]).exit_code == 0
    try:
        declined = runner.invoke(rollouts_app, ["topics", "delete", "--prefix", prefix], input="n\n")
        assert declined.exit_code == 1 and "nothing deleted" in declined.output, declined.output
        assert all(name in declined.output for name in names), declined.output
        assert _prefix_topics(kafka, prefix) == names
        deleted = runner.invoke(rollouts_app, ["topics", "delete", "--prefix", prefix, "--yes"])
        assert deleted.exit_code == 0 and deleted.output.count(": deleted") == len(names), deleted.output
        assert not _wait_gone(kafka, prefix)
        again = runner.invoke(rollouts_app, ["topics", "delete", "--prefix", prefix, "--yes"])
        assert again.exit_code == 2 and "no topic of prefix" in again.output, again.output
    finally:
        delete_topics(kafka, sorted(_prefix_topics(kafka, prefix)))


def test_help_and_readme_name_every_topic_of_a_prefix():
    suffixes = [s.name.removeprefix("P.") for s in Topics("P").specs().values()]
    assert len(suffixes) == 9
    help_text = " ".join(runner.invoke(rollouts_app, ["topics", "create", "--help"], terminal_width=200).output.split())
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "`ember rollouts topics create" in line)
    for suffix in suffixes:
        assert suffix in help_text, (suffix, help_text)
        assert f"`{suffix}`" in row, (suffix, row)



def test_publish_policy_announces_on_existing_topics_only(kafka):
    prefix = f"test-policy-{uuid.uuid4().hex[:8]}"
    refused = runner.invoke(rollouts_app, ["publish-policy", "3", "--prefix", prefix])
    assert refused.exit_code == 2 and f"ember rollouts topics create --prefix {prefix}" in " ".join(refused.output.split())
    assert not _prefix_topics(kafka, prefix), "a typo'd prefix must not get a topic"


def _every_prefix_command(prefix: str, etl_config: Path) -> dict[str, list[str]]:
    """Each rollouts command that names a prefix's topics, the one way: --prefix, or the config's topic_prefix."""
    return {
        "topics describe": ["topics", "describe", "--prefix", prefix],
        "simulate": ["simulate", "--prefix", prefix, "--groups", "1", "--group-size", "2", "--tokens", "32",
                     "--layers", "0", "--time-scale", "inf"],
        "publish-policy": ["publish-policy", "5", "--prefix", prefix],
        "tail": ["tail", "rollouts", "--prefix", prefix, "--idle-timeout", "1"],
        "stats": ["stats", str(etl_config), "--window", "0"],
        "replay": ["replay", str(etl_config), "--to", str(etl_config.parent / "replayed")],
        "topics delete": ["topics", "delete", "--prefix", prefix, "--yes"],
    }


def test_every_rollouts_command_names_its_prefix_one_way_and_only_topics_create_makes_topics(kafka, tmp_path):
    import yaml

    prefix = f"test-prefix-{uuid.uuid4().hex[:8]}"
    etl_config = tmp_path / "etl.yaml"
    etl_config.write_text(yaml.safe_dump(etl_settings(prefix, partitions=1)))
    commands = _every_prefix_command(prefix, etl_config)
    try:
        for name, args in commands.items():
            result = runner.invoke(rollouts_app, args)
            assert result.exit_code == 2, (name, result.output)
            assert name in ("stats", "replay") or prefix in result.output, (name, result.output)
            assert not _prefix_topics(kafka, prefix), f"{name} made a topic of a prefix that had none"
        for name in ("topics create", "topics describe", "topics delete", "publish-policy"):
            words = name.split()
            missing = runner.invoke(rollouts_app, [*words, *(["5"] if name == "publish-policy" else [])])
            assert missing.exit_code == 2 and "--prefix" in missing.output, (name, missing.output)
        assert runner.invoke(rollouts_app, ["topics", "create", "--prefix", prefix, "--partitions", "1"]).exit_code == 0
        for name, args in commands.items():
            result = runner.invoke(rollouts_app, args)
            assert result.exit_code == 0, (name, result.output)
            if name == "replay":
                assert "rollouts" in result.output and "{" not in result.output, "a table, as the other commands print"
        assert not _wait_gone(kafka, prefix), "topics delete removed them"
    finally:
        delete_topics(kafka, sorted(_prefix_topics(kafka, prefix)))


def test_until_idle_says_what_only_time_will_decide_and_when(kafka, caplog):
    """A reward whose rollout never comes (dead-lettered, or lost) waits for rewards.orphan_timeout_s: --until-idle
    used to wait it out with nothing but a status line; it now names the wait and the time left."""
    import logging

    from ember.rollouts.admin import ensure_topics
    from ember.rollouts.config import parse_config
    from ember.rollouts.etl import EtlService
    from ember.rollouts.transport import RecordWriter
    from tests.rollouts.helpers import reward, rollout

    prefix = f"test-idle-{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix)
    config = parse_config(etl_settings(prefix, partitions=1, rewards={"orphan_timeout_s": 6}, metrics={"port": None}))
    ensure_topics(kafka, list(topics.specs(1).values()))
    try:
        writer = RecordWriter(topics.rewards)
        writer.write(reward(rollout("g-lost", 0), 1.0))
        writer.producer.flush()
        writer.producer.close()
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="ember"):
            EtlService(config, "idle").run(until_idle_s=1.0)
        said = [r.getMessage() for r in caplog.records if "--until-idle waits" in r.getMessage()]
        assert said, caplog.text[-2000:]
        assert "next, rewards of group g-lost whose rollouts never came (rewards.orphan_timeout_s), in " in said[0]
        assert time.monotonic() - started >= 5, "it still decides the orphan at its timeout, then exits"
        assert [o.reason for o in books(topics).rewards_dropped] == ["orphan_reward"]
    finally:
        delete_topics(kafka, [s.name for s in topics.specs().values()])
