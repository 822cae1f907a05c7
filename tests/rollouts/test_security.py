"""Rollout clients on the secured broker (SASL_SSL, SCRAM-SHA-512, ACLs), one principal per role.

- the ETL's exactly-once fault tests (kill -9 mid-transaction, takeover) with inference writing
  rollouts, graders rewards, the ETL as ember-etl and the trainer reading the batches;
- each role refused outside its ACLs with a clear error, and nothing written anywhere;
- no password in any output, log or error these tests produce (their own, the ETL processes', the broker's);
- the settings model: validation at the edge, environment fallback, no password in a repr or an error.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid

import pytest
from kafka import KafkaProducer, TopicPartition
from kafka.errors import TopicAuthorizationFailedError
from typer.testing import CliRunner

from ember.configs import EtlConfigError
from ember.rollouts.acls import ROLES, mirror_cluster_bindings, region_bindings, role_bindings
from ember.rollouts.cli import app
from ember.rollouts.config import load_config, parse_config
from ember.rollouts.reader import RolloutBatchReader
from ember.rollouts.security import PASSWORD_ENV, KafkaSecurity, KafkaSecurityError
from ember.rollouts.topics import Topics
from ember.rollouts.transport import RolloutWriter, TopicUnavailable, WriteFailed, producer_config
from tests.rollouts.etl_support import REPO, SECURITY_ENV, Deployment, etl_settings, kill_9_scenario, takeover_scenario
from tests.rollouts.helpers import rollout

SECRET = "s3cr3t-Pa55w0rd-that-must-not-leak"


@pytest.fixture
def clean_env(monkeypatch):
    for name in SECURITY_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ---- the settings model ------------------------------------------------------------------------


def _sasl(**keys) -> dict:
    return {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "ember-etl", **keys}


def _required(data: dict) -> dict:
    """`data` with the keys every ETL config must name (prefix, group, vocabulary) added."""
    kafka = {"topic_prefix": "ember", "group_id": "ember-etl", **data.get("kafka", {})}
    return {**data, "kafka": kafka, "filters": {"vocab_size": 151_936, **data.get("filters", {})}}


@pytest.mark.parametrize(
    "keys, named",
    [
        ({"security_protocol": "SASL_SSL", "sasl_plain_username": "u", "sasl_plain_password_env": "X"}, "sasl_mechanism is required"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_password_env": "X"}, "sasl_plain_username is required"),
        (_sasl(), "sasl_plain_password_file or sasl_plain_password_env"),
        (_sasl(sasl_plain_password_file="/f", sasl_plain_password_env="X"), "give one password source"),
        ({"security_protocol": "PLAINTEXT", "sasl_mechanism": "PLAIN"}, "does not use SASL"),
        ({"security_protocol": "TLS"}, "kafka.security.security_protocol"),
    ],
)
def test_incomplete_settings_fail_at_the_edge_naming_the_key(clean_env, keys, named):
    with pytest.raises(EtlConfigError, match=named):
        parse_config(_required({"kafka": {"security": keys}}))


def test_keys_left_out_come_from_the_environment_and_the_config_wins(clean_env, tmp_path):
    secret = tmp_path / "etl.password"
    secret.write_text(SECRET + "\n")
    clean_env.setenv("EMBER_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    clean_env.setenv("EMBER_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    clean_env.setenv("EMBER_KAFKA_SASL_USERNAME", "from-env")
    clean_env.setenv("EMBER_KAFKA_SASL_PASSWORD_FILE", str(secret))
    clean_env.setenv("EMBER_KAFKA_SSL_CAFILE", "/ca.pem")
    clean_env.setenv("EMBER_KAFKA_SSL_CHECK_HOSTNAME", "false")
    from_env = KafkaSecurity()
    assert from_env.client_kwargs() == {
        "security_protocol": "SASL_SSL",
        "ssl_check_hostname": False,
        "ssl_cafile": "/ca.pem",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "from-env",
        "sasl_plain_password": SECRET,
    }
    config = parse_config(_required({"kafka": {"security": {"sasl_plain_username": "ember-etl", "sasl_plain_password_env": "MY_PASSWORD"}}}))
    security = config.kafka.security
    assert (security.sasl_plain_username, security.sasl_plain_password_file, security.ssl_check_hostname) == ("ember-etl", None, False)
    with pytest.raises(KafkaSecurityError, match="MY_PASSWORD .* is not set"):
        security.client_kwargs()
    clean_env.setenv("MY_PASSWORD", SECRET)
    assert security.client_kwargs()["sasl_plain_password"] == SECRET
    assert parse_config(_required({})).kafka.security == from_env


def test_the_password_is_in_no_repr_dump_description_or_error(clean_env, tmp_path):
    clean_env.setenv(PASSWORD_ENV, SECRET)
    security = KafkaSecurity(**_sasl())
    assert security.sasl_plain_password_env == PASSWORD_ENV
    config = parse_config(_required({"kafka": {"security": _sasl()}}))
    shown = [repr(security), str(security), security.describe(), str(security.model_dump()), repr(config), config.model_dump_json()]
    assert not [s for s in shown if SECRET in s]
    assert security.client_kwargs()["sasl_plain_password"] == SECRET  # the one place it is read
    errors = []
    for bad in (
        {"kafka": {"security": _sasl(sasl_plain_password=SECRET)}},
        {"kafka": {"security": _sasl(sasl_plain_pasword=SECRET)}},
        {"kafka": {"sasl_plain_password": SECRET}},
    ):
        with pytest.raises(EtlConfigError) as caught:
            parse_config(_required(bad))
        errors.append(str(caught.value))
    assert "sasl_plain_password cannot be given in a config" in errors[0]
    assert not [e for e in errors if SECRET in e], errors
    missing = tmp_path / "nowhere.password"
    with pytest.raises(KafkaSecurityError, match="nowhere.password: cannot read it"):
        KafkaSecurity(**_sasl(sasl_plain_password_file=missing)).client_kwargs()
    (tmp_path / "empty.password").write_text("\n")
    with pytest.raises(KafkaSecurityError, match="is empty"):
        KafkaSecurity(**_sasl(sasl_plain_password_file=tmp_path / "empty.password")).client_kwargs()


def test_cli_reports_bad_environment_settings_without_a_traceback(clean_env):
    clean_env.setenv("EMBER_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    result = CliRunner().invoke(app, ["tail", "ember.rollouts"])
    assert result.exit_code == 2, result.output
    assert "EMBER_KAFKA_*" in result.output and "sasl_mechanism is required" in result.output


def test_examples_parse_and_metrics_bind_to_loopback_unless_told(clean_env):
    assert str(parse_config(_required({})).metrics.bind) == "127.0.0.1"
    secure = load_config(REPO / "ember" / "rollouts" / "etl.secure.example.yaml")
    assert secure.kafka.security.describe() == "SASL_SSL SCRAM-SHA-512 as ember-etl"
    assert str(secure.metrics.bind) == "0.0.0.0"
    with pytest.raises(EtlConfigError, match="metrics.bind"):
        parse_config(_required({"metrics": {"bind": "everywhere"}}))


def test_acls_give_each_role_only_its_own_topics_and_nobody_create():
    topics = Topics("p")
    bindings = role_bindings("p")
    by_role = {role: {(b.operation, b.resource, b.name, b.pattern) for b in bindings if b.role == role} for role in ROLES}
    assert by_role["inference"] == {("WRITE", "TOPIC", topics.rollouts, "LITERAL"), ("WRITE", "TOPIC", topics.events, "LITERAL")}
    assert by_role["grader"] == {
        ("WRITE", "TOPIC", topics.rewards, "LITERAL"),
        ("WRITE", "TOPIC", topics.dead_letter, "LITERAL"),  # rollouts it cannot grade
        ("READ", "TOPIC", topics.rollouts, "LITERAL"),
        ("READ", "GROUP", "p-grader", "LITERAL"),
        ("WRITE", "TRANSACTIONAL_ID", "p-grader-", "PREFIXED"),  # GradingService.member_id: <group_id>-<instance>
        ("DESCRIBE", "TRANSACTIONAL_ID", "p-grader-", "PREFIXED"),
    }
    assert by_role["trainer"] == {
        ("READ", "TOPIC", topics.train_batches, "LITERAL"),
        ("READ", "TOPIC", topics.rollouts, "LITERAL"),  # batches are by reference: ranks fetch their rollouts
        ("READ", "GROUP", "p-trainer", "LITERAL"),
        ("WRITE", "TOPIC", topics.policy_versions, "LITERAL"),
    }
    etl_reads = {name for op, kind, name, _ in by_role["etl"] if (op, kind) == ("READ", "TOPIC")}
    etl_writes = {name for op, kind, name, _ in by_role["etl"] if (op, kind) == ("WRITE", "TOPIC")}
    assert etl_reads == {topics.rollouts, topics.rewards, topics.events, topics.opt_out, topics.policy_versions, topics.etl_state, topics.outcomes}
    assert etl_writes == {topics.train_batches, topics.dead_letter, topics.outcomes, topics.etl_state}
    # the ETL's transactional ids are `<group_id>-<instance>` (EtlService.member_id)
    assert ("WRITE", "TRANSACTIONAL_ID", "p-etl-", "PREFIXED") in by_role["etl"]
    assert not [b for b in bindings if b.operation not in ("READ", "WRITE", "DESCRIBE")]
    assert {b.principal for b in role_bindings("p", users={"etl": "svc-etl"}) if b.role == "etl"} == {"User:svc-etl"}


def test_acls_command_prints_the_table_without_a_broker():
    result = CliRunner().invoke(app, ["acls", "--prefix", "p", "--etl-group", "etl-a"])
    assert result.exit_code == 0, result.output
    assert "User:ember-inference  WRITE" in result.output and "etl-a-" in result.output
    assert CliRunner().invoke(app, ["acls", "--user", "boss=x"]).exit_code == 2


# ---- on the secured broker ---------------------------------------------------------------------


@pytest.mark.integration
def test_kill_9_mid_transaction_loses_and_doubles_nothing_over_sasl_ssl(secured, tmp_path, processes):
    deployment, _outputs = secured
    kill_9_scenario(deployment, tmp_path, processes)
    assert any("as ember-etl" in p.output() for p in processes), "the ETL did not connect as its own principal"


@pytest.mark.integration
def test_second_process_takes_over_over_sasl_ssl(secured, tmp_path, processes):
    deployment, _outputs = secured
    takeover_scenario(deployment, tmp_path, processes)


def _ends(deployment: Deployment, topics: Topics) -> dict:
    consumer = deployment.consumer("admin", group_id=None)
    try:
        names = [s.name for s in topics.specs().values()]  # the product-only ones do not exist on a groups deployment
        return consumer.end_offsets([TopicPartition(n, p) for n in names for p in sorted(consumer.partitions_for_topic(n) or ())])
    finally:
        consumer.close()


@pytest.mark.integration
def test_each_role_is_refused_outside_its_acls_and_nothing_is_written(secured, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    deployment, outputs = secured
    prefix = f"test-acl-{uuid.uuid4().hex[:8]}"
    config = parse_config(etl_settings(prefix, partitions=2, kafka=deployment.kafka_section("etl")))
    topics = deployment.prepare(prefix, config)
    before = _ends(deployment, topics)

    grader = KafkaProducer(**producer_config(deployment.security("grader"), bootstrap_servers=deployment.bootstrap, max_block_ms=20_000))
    try:
        with pytest.raises(TopicAuthorizationFailedError, match=topics.train_batches):
            grader.send(topics.train_batches, key=b"forged", value=b"a batch the trainer must never see").get(timeout=30)
    finally:
        grader.close(timeout=5)

    trainer = RolloutWriter(prefix, security=deployment.security("trainer"), bootstrap_servers=deployment.bootstrap)
    with pytest.raises(TopicAuthorizationFailedError, match=topics.rollouts):
        trainer.write(rollout("forged", 0)).get(timeout=30)
    with pytest.raises(WriteFailed, match=f"1 of 1 records sent to {topics.rollouts} were not written"):
        trainer.close()

    with pytest.raises(TopicUnavailable, match=f"{topics.rewards} does not exist, or SASL_SSL SCRAM-SHA-512 as ember-inference may not read it"):
        RolloutBatchReader(topics.rewards, group_id=f"{prefix}-trainer", bootstrap=deployment.bootstrap, security=deployment.security("inference"))
    inference = deployment.consumer("inference", group_id=None)
    try:
        with pytest.raises(TopicAuthorizationFailedError, match=topics.rewards):
            inference.end_offsets([TopicPartition(topics.rewards, 0)])
    finally:
        inference.close()

    env = {**os.environ, **deployment.environment("trainer")}
    cli = subprocess.run(
        [sys.executable, "-m", "ember.cli", "rollouts", "simulate", "--prefix", prefix, "--create-topics", "--groups", "1", "--layers", "0", "--time-scale", "1000"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    outputs.append(cli.stdout + cli.stderr)
    assert cli.returncode == 2, cli.stdout + cli.stderr
    assert "ember-trainer, who may not create topics" in " ".join(cli.stdout.split()), cli.stdout
    assert "Traceback" not in cli.stderr, cli.stderr

    assert _ends(deployment, topics) == before, "a refused principal wrote something"


def test_midtrain_rl_takes_the_same_security_section(clean_env):
    from ember.midtrain.config import RolloutsConfig

    rollouts = RolloutsConfig(topic_prefix="p", security=_sasl(sasl_plain_username="ember-trainer", sasl_plain_password_file="/t"))
    assert rollouts.security.describe() == "SASL_SSL SCRAM-SHA-512 as ember-trainer"
    assert RolloutsConfig(topic_prefix="p").security.security_protocol == "PLAINTEXT"


def test_the_mirror_gets_mm2s_own_resources_and_only_the_deployments_data_it_copies():
    topics = Topics("p")
    mm2 = {(b.operation, b.resource, b.name, b.pattern) for b in mirror_cluster_bindings(["us", "eu"])}
    for source in ("us", "eu"):  # exactly-once source: the worker's and each task's transactional ids (Connect docs)
        assert {("WRITE", "TRANSACTIONAL_ID", f"connect-cluster-{source}-mm2", "LITERAL"),
                ("WRITE", "TRANSACTIONAL_ID", f"{source}-mm2-", "PREFIXED"),
                ("READ", "GROUP", f"{source}-mm2", "LITERAL"), ("CREATE", "TOPIC", f"{source}.", "PREFIXED")} <= mm2
    assert ("IDEMPOTENT_WRITE", "CLUSTER", "kafka-cluster", "LITERAL") in mm2
    written = {name for op, resource, name, _ in mm2 if resource == "TOPIC" and op in ("WRITE", "CREATE")}
    assert written == {"mm2-", "heartbeats", "us.", "eu."}  # never a deployment's own topics
    central = [b for b in role_bindings("p", regions=["us"]) if b.role in ("mirror", "etl")]
    assert {(b.operation, b.name) for b in central if b.role == "mirror"} == {
        ("READ", topics.policy_versions), ("DESCRIBE_CONFIGS", topics.policy_versions)}
    assert {("READ", f"us.{topics.rollouts}"), ("READ", "mm2-offsets.us.internal")} <= {(b.operation, b.name) for b in central}
    region = {(b.role, b.operation, b.name) for b in region_bindings("p")}
    assert {("mirror", "READ", topics.rollouts), ("mirror", "READ", topics.rewards), ("etl", "READ", topics.rewards),
            ("inference", "WRITE", topics.rollouts), ("grader", "WRITE", topics.rewards)} <= region
    assert not {name for role, op, name in region if role == "mirror" and op != "READ" and op != "DESCRIBE_CONFIGS"}
    assert role_bindings("p") == [b for b in role_bindings("p", regions=["us"]) if b.role != "mirror" and "us" not in b.name]
