"""The operator's rollout tools on the secured broker (SASL_SSL, SCRAM-SHA-512, ACLs), through the real CLI:
`tail`, `stats` and `replay` as the roles whose ACLs allow them, and refused with exit 2 and why as a role
whose ACLs do not; `acls --apply` refused for a role principal, then applied by the admin (once: a second
run finds every binding), after which the refused operation goes through. The `secured` fixture searches every
output, log and file of each test for a password afterwards."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.ipc as ipc
import pytest
import yaml
from kafka.errors import TopicAuthorizationFailedError
from typer.testing import CliRunner

from ember.rollouts.acls import Binding, role_bindings
from ember.rollouts.admin import apply_acls, ensure_topics
from ember.rollouts.cli import rollouts_app
from ember.rollouts.etl import EtlService
from ember.rollouts.simulate import publish_workload
from ember.rollouts.topics import Topics, TopicSpec
from ember.rollouts.transport import RolloutWriter, WriteFailed
from tests.rollouts.etl_support import Deployment, Workload, books, read_topic, setup_etl, workload
from tests.rollouts.helpers import rollout

pytestmark = pytest.mark.integration

REWARD_TIMEOUT_S = 6.0
runner = CliRunner()


def _cli(deployment: Deployment, outputs: list[str], role: str, *args: str):
    """`ember rollouts ARGS` in-process, connecting as `role` through EMBER_KAFKA_* (commands that take a config
    connect as its kafka.security says, and ignore these)."""
    result = runner.invoke(rollouts_app, list(args), env=deployment.environment(role))
    outputs.append(result.output)
    assert "Traceback" not in result.output, result.output
    return result


def _published(deployment: Deployment, prefix: str, root: Path, *, etl: bool) -> tuple[Path, Topics, Workload]:
    """The prefix's topics and ACLs made by the admin, its ETL config (as ember-etl) in root/etl.yaml, a small
    faulty workload published by inference, the graders and the trainer; with `etl`, one ETL run until idle."""
    _prefix, config, topics = setup_etl(root, deployment, partitions=2, prefix=prefix, rewards={"timeout_s": REWARD_TIMEOUT_S})
    work = workload(prefix, groups=6, p_malformed=0.2)
    publish_workload(work.events, topics, time_scale=4.0, security=deployment.publishers, bootstrap=deployment.bootstrap)
    if etl:
        EtlService(config, "0").run(until_idle_s=2.0)
    return root / "etl.yaml", topics, work


def _as(role: str, deployment: Deployment, config: Path, root: Path) -> Path:
    """The ETL config at `config`, connecting as `role` instead."""
    data = yaml.safe_load(config.read_text())
    data["kafka"] = {**data["kafka"], **deployment.kafka_section(role)}
    path = root / f"etl-as-{role}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _lines(output: str, topic: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(f"{topic}[")]


def test_tail_reads_what_the_role_may_read_and_refuses_the_rest(secured, topic_prefix, tmp_path):
    deployment, outputs = secured
    _config, topics, work = _published(deployment, topic_prefix, tmp_path, etl=True)
    found = books(topics, deployment)
    assert found.batch_ids and found.dead_letter_records

    batches = _cli(deployment, outputs, "trainer", "tail", topics.train_batches, "--limit", "1000")
    assert batches.exit_code == 0, batches.output
    lines = _lines(batches.output, topics.train_batches)
    assert len(lines) == len(found.batch_ids) and all(re.match(r"\S+\[\d\]@\d+ batch \S+ step \d+ ", line) for line in lines), lines

    ledger = _cli(deployment, outputs, "etl", "tail", topics.outcomes, "--limit", "1000")
    assert ledger.exit_code == 0, ledger.output
    lines = _lines(ledger.output, topics.outcomes)
    assert len(lines) == len(read_topic(topics.outcomes, deployment=deployment)) and all(" ledger " in line for line in lines)

    dead = _cli(deployment, outputs, "admin", "tail", topics.dead_letter, "--limit", "1000")
    assert dead.exit_code == 0, dead.output
    lines = _lines(dead.output, topics.dead_letter)
    assert len(lines) == work.malformed and all(" dead letter malformed from " in line for line in lines), lines

    hidden = _cli(deployment, outputs, "trainer", "tail", topics.rewards)
    assert hidden.exit_code == 2, hidden.output
    assert f"{topics.rewards} does not exist, or SASL_SSL SCRAM-SHA-512 as ember-trainer may not read it" in " ".join(
        hidden.output.split()
    )
    write_only = _cli(deployment, outputs, "inference", "tail", topics.rollouts)
    assert write_only.exit_code == 2 and not _lines(write_only.output, topics.rollouts), write_only.output
    refusal = " ".join(write_only.output.split())
    assert "refused by the broker: TopicAuthorizationFailedError(" in refusal and topics.rollouts in refusal, refusal


def test_stats_as_the_etl_and_refused_as_another_role(secured, topic_prefix, tmp_path):
    deployment, outputs = secured
    config, topics, work = _published(deployment, topic_prefix, tmp_path, etl=True)
    found = books(topics, deployment)

    shown = _cli(deployment, outputs, "etl", "stats", str(config), "--window", "0")
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    assert re.search(rf"batches committed │ {len(found.batch_ids)} \(all time\)", text), text
    assert re.search(rf"rollouts batched │ {len(found.batched)} ", text), text
    assert re.search(rf"dead letters │ {work.malformed} ", text), text
    # A partition that no record was keyed to has end offset 0 and no committed offset (None): no lag either.
    lags = re.findall(rf"{re.escape(topic_prefix)}\.(rollouts|rewards) │ \d │ (\d+) │ (\d+|None) │ (\d+)", text)
    assert len(lags) == 4 and all(
        (end == committed or (end, committed) == ("0", "None")) and lag == "0" for _, end, committed, lag in lags
    ), text

    refused = _cli(deployment, outputs, "etl", "stats", str(_as("inference", deployment, config, tmp_path)), "--window", "0")
    assert refused.exit_code == 2, refused.output
    assert f"refused by the broker: GroupAuthorizationFailedError('{topic_prefix}-etl')" in " ".join(refused.output.split())


def test_replay_as_the_etl_to_a_directory_and_to_a_topic_it_may_write(secured, topic_prefix, tmp_path):
    deployment, outputs = secured
    config, topics, work = _published(deployment, topic_prefix, tmp_path, etl=False)

    out = tmp_path / "replayed"
    to_dir = _cli(deployment, outputs, "etl", "replay", str(config), "--to", str(out), "--advantage", "rloo")
    assert to_dir.exit_code == 0, to_dir.output
    summary = json.loads((out / "summary.json").read_text())
    table = ipc.open_file(str(out / "batches.arrow")).read_all()
    assert table.num_rows == summary["batches"] > 0
    assert set(table.column("advantage_estimator").to_pylist()) == {"rloo"}
    dropped = sum(n for key, n in summary["outcomes"].items() if key.startswith("rollout_dropped/"))
    assert summary["rollouts"] + dropped == work.rollout_messages
    assert summary["outcomes"].get("dead_letter/malformed") == work.malformed

    target = f"{topic_prefix}.replayed"
    ensure_topics(deployment.bootstrap, [TopicSpec(target, 1)], deployment.security("admin"))
    refused = _cli(deployment, outputs, "etl", "replay", str(config), "--to", f"topic:{target}")
    assert refused.exit_code == 2, refused.output
    assert f"refused by the broker: TopicAuthorizationFailedError('{target}')" in " ".join(refused.output.split())
    assert not read_topic(target, deployment=deployment), "a refused replay wrote batches"

    apply_acls(deployment.bootstrap, [Binding("etl", "User:ember-etl", "WRITE", "TOPIC", target)], deployment.security("admin"))
    to_topic = _cli(deployment, outputs, "etl", "replay", str(config), "--to", f"topic:{target}", "--json")
    assert to_topic.exit_code == 0, to_topic.output
    written = json.loads(to_topic.output)
    assert written["batches"] == len(read_topic(target, deployment=deployment)) > 0


def test_acls_apply_is_refused_for_a_role_then_applied_by_the_admin_once(secured, topic_prefix, tmp_path):
    deployment, outputs = secured
    topics = Topics(topic_prefix)
    created = _cli(deployment, outputs, "admin", "topics", "create", "--prefix", topic_prefix, "--partitions", "1")
    assert created.exit_code == 0 and created.output.count(": created") == len(topics.specs()), created.output
    bindings = role_bindings(topic_prefix)

    writer = RolloutWriter(topic_prefix, security=deployment.security("inference"), bootstrap_servers=deployment.bootstrap)
    with pytest.raises(TopicAuthorizationFailedError, match=topics.rollouts):
        writer.write(rollout("before-acls", 0)).get(timeout=30)
    with pytest.raises(WriteFailed, match=f"1 of 1 records sent to {topics.rollouts} were not written"):
        writer.close()
    before = _cli(deployment, outputs, "trainer", "tail", topics.train_batches)
    assert before.exit_code == 2 and "as ember-trainer may not read it" in " ".join(before.output.split()), before.output

    wrong = _cli(deployment, outputs, "etl", "acls", "--prefix", topic_prefix, "--apply")
    assert wrong.exit_code == 2, wrong.output
    assert "SASL_SSL SCRAM-SHA-512 as ember-etl may not read ACLs: apply them as a super user" in " ".join(wrong.output.split())

    applied = _cli(deployment, outputs, "admin", "acls", "--prefix", topic_prefix, "--apply")
    assert applied.exit_code == 0, applied.output
    rows = [line.split() for line in applied.output.splitlines() if line.startswith(("inference ", "grader ", "etl ", "trainer "))]
    assert len(rows) == len(bindings) and {row[-1] for row in rows} == {"created"}, applied.output
    again = _cli(deployment, outputs, "admin", "acls", "--prefix", topic_prefix, "--apply")
    assert again.exit_code == 0, again.output
    rows = [line.split() for line in again.output.splitlines() if line.startswith(("inference ", "grader ", "etl ", "trainer "))]
    assert len(rows) == len(bindings) and {row[-1] for row in rows} == {"exists"}, again.output

    with RolloutWriter(topic_prefix, security=deployment.security("inference"), bootstrap_servers=deployment.bootstrap) as writer:
        writer.write(rollout("after-acls", 0)).get(timeout=30)
    after = _cli(deployment, outputs, "trainer", "tail", topics.rollouts)
    assert after.exit_code == 0, after.output
    lines = _lines(after.output, topics.rollouts)
    assert len(lines) == 1 and " rollout after-acls-0 " in lines[0], after.output
