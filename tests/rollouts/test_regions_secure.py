"""`ember dev up --regions us --secure`: a regional cluster secured like kafka-secure, mirrored into it over SASL_SSL.

A set of its own (infra/regions.sh --secure: own ports, names and MM2), started once for this file and stopped after
it when started here; the plaintext set of test_regions.py serves the fault tests and the join across two regions.
Both share the xdist group "regions", so the two sets never start side by side on this small machine. One region
keeps the start inside the suite's budget (a second one costs a broker and two more MM2 workers: 139 s against 88 s
for this file at load 10); MM2's ACLs for several regions are the same function, unit-tested in test_security.py.
Rollouts are sampled in us as ember-inference, graded there as ember-grader, copied by MM2 as ember-mirror and
batched by the ETL as ember-etl, each with only the ACLs `ember rollouts acls --region` grants; an independent
read_committed count checks exactly once.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import yaml
from kafka import KafkaAdminClient, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from typer.testing import CliRunner

from ember.cli import app
from ember.dev import services
from ember.rollouts.admin import list_topics
from ember.rollouts.config import parse_config
from ember.rollouts.etl import prepare_topics
from ember.rollouts.security import KafkaSecurity
from ember.rollouts.topics import Topics
from ember.schemas import encode
from tests.rollouts.etl_support import Deployment, EtlThread, books, etl_settings
from tests.rollouts.helpers import reward, rollout

REGIONS = ("us",)
PREFIX = "regsec-"
pytestmark = pytest.mark.xdist_group("regions")


@pytest.fixture(scope="module")
def secure_regions(secure_kafka) -> Iterator[dict[str, str]]:
    """Region -> bootstrap of its secured cluster, MM2 mirroring it into kafka-secure (shared with other tests, so
    only this file's policy versions go out), started by `ember dev up --regions us --secure` (idempotent)."""
    started_here = "\nmm2-secure\trunning" not in "\n" + services.run_script("regions.sh", "--secure", "status", check=False).stdout
    os.environ["EMBER_MM2_OUT_TOPICS"] = PREFIX + r".*\.policy-versions"
    try:  # the user's command, narrowed to the services this file needs
        up = CliRunner().invoke(app, ["dev", "up", "--only", "kafka-secure", "--regions", ",".join(REGIONS), "--secure"])
    finally:
        del os.environ["EMBER_MM2_OUT_TOPICS"]
    assert up.exit_code == 0, f"ember dev up --regions us --secure failed:\n{up.output}"
    status = services.run_script("regions.sh", "--secure", "status").stdout
    assert all(f"{name}\trunning" in status for name in ("kafka-secure-us", "mm2-secure")), status
    yield {region: services.region_bootstrap(region, secure=True) for region in REGIONS}
    if started_here:
        services.stop_regions(secure=True)


def test_a_secured_region_refuses_plaintext_and_a_wrong_password(secure_kafka, secure_regions, tmp_path):
    us = secure_regions["us"]
    with pytest.raises(KafkaError):
        KafkaAdminClient(bootstrap_servers=us, request_timeout_ms=2000, bootstrap_timeout_ms=2000).list_topics()
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    intruder = KafkaSecurity(
        security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_plain_username="ember-etl",
        sasl_plain_password_file=wrong, ssl_cafile=secure_kafka.cafile,
    )
    with pytest.raises(KafkaError):
        KafkaAdminClient(bootstrap_servers=us, request_timeout_ms=2000, bootstrap_timeout_ms=2000, **intruder.client_kwargs()).list_topics()


def cli(deployment: Deployment, outputs: list[str], role: str, *args: str):
    result = CliRunner(env=deployment.environment(role)).invoke(app, ["rollouts", *args])
    outputs.append(result.output)  # searched for passwords by the `secured` fixture
    assert result.exit_code == 0, result.output
    return result


def produce(bootstrap: str, security: KafkaSecurity, topic: str, records: list[tuple[str, bytes]]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", **security.client_kwargs())
    try:
        for key, value in records:
            producer.send(topic, key=key.encode(), value=value)
        producer.flush()
    finally:
        producer.close()


def committed_keys(deployment: Deployment, topic: str, expected: int, timeout_s: float) -> Counter:
    """Keys of `topic`'s committed records in central, read as the admin until `expected` arrived (or the time is up)."""
    consumer = deployment.consumer("admin")
    keys: Counter = Counter()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + timeout_s
        while sum(keys.values()) < expected and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                keys.update(r.key.decode() for r in batch)
        return keys
    finally:
        consumer.close()


def test_rollouts_sampled_and_graded_in_secured_regions_are_batched_exactly_once_over_sasl_ssl(
    secure_kafka, secure_regions, secured, caplog, tmp_path
):
    deployment, outputs = secured
    prefix = f"{PREFIX}{uuid.uuid4().hex[:10]}"
    topics = Topics(prefix)
    for region in REGIONS:  # the admin makes each region's topics and grants every role, the mirror included
        cli(deployment, outputs, "admin", "topics", "create", "--prefix", prefix, "--partitions", "2", "--region", region)
    granted = cli(deployment, outputs, "admin", "acls", "--prefix", prefix, "--region", "us", "--apply")
    assert "central  mirror" in granted.output and "us       mirror" in granted.output, granted.output

    mirrored = {f"{r}.{t}" for r in REGIONS for t in (topics.rollouts, topics.rewards)}
    deadline = time.monotonic() + 90
    while not mirrored <= set(list_topics(deployment.bootstrap, deployment.security("etl"))):  # as the ETL sees it
        assert time.monotonic() < deadline, "MM2 did not make the mirrored topics in kafka-secure within 90 s"
        time.sleep(1)
    settings = etl_settings(
        prefix, partitions=2, kafka={**deployment.kafka_section("etl"), "regions": secure_regions},
        groups={"size": 2, "quorum": 2, "timeout_s": 20}, rewards={"timeout_s": 10, "orphan_timeout_s": 30},
    )
    config = parse_config(settings)
    (tmp_path / "etl.yaml").write_text(yaml.safe_dump(settings))
    prepare_topics(config.with_overrides(kafka=deployment.kafka_section("admin")), create=True)

    groups = {f"g{i}": [rollout(f"g{i}", j) for j in range(2)] for i in range(6)}  # sampled and graded in us
    produce(secure_regions["us"], deployment.security("inference"), topics.rollouts,
            [(g, encode(r)) for g, rs in groups.items() for r in rs])
    produce(secure_regions["us"], deployment.security("grader"), topics.rewards,
            [(g, encode(reward(r, float(j)))) for g, rs in groups.items() for j, r in enumerate(rs)])
    sent = [r.rollout_id for rs in groups.values() for r in rs]

    etl = EtlThread(config, "a")
    etl.start()
    try:
        deadline = time.monotonic() + 120
        while len(books(topics, deployment).batched) < len(sent) and time.monotonic() < deadline:
            time.sleep(1)
    finally:
        etl.finish()
    batched = Counter(books(topics, deployment).batched)  # read_committed, independently of the ETL
    copied = committed_keys(deployment, f"us.{topics.rollouts}", len(sent), 30)
    assert copied == Counter({g: 2 for g in groups}), f"the mirror copied {copied}"
    doubled = {rid: n for rid, n in batched.items() if n > 1}
    assert set(batched) == set(sent) and not doubled, f"lost {sorted(set(sent) - set(batched))}, doubled {doubled}"
    assert "cannot be asked what MM2 has not copied" not in caplog.text  # the ETL reached both regions as ember-etl
    lag = cli(deployment, outputs, "etl", "stats", str(tmp_path / "etl.yaml"), "--region", "us", "--window", "0")
    rows = [line.split() for line in lag.output.splitlines() if line.split()[1:2] == ["us"]]
    assert len(rows) == 4 and all(row[-2] == "0" for row in rows), lag.output  # 2 topics x 2 partitions


def test_no_password_in_mm2s_config_topics_or_logs(secure_kafka, secure_regions, secured):
    """MM2 stores its connectors' configs in Kafka (mm2-configs.<source>.internal): they hold the `${file:...}`
    reference, never the password it resolves to."""
    deployment, _outputs = secured
    home = secure_kafka.credentials.parent.parent
    texts = {str(path): path.read_text(errors="replace") for path in [
        home / "mm2-secure" / "mm2.properties", home / "mm2-secure" / "logs" / "mm2.log",
        *(home / f"kafka-secure-{r}" / "logs" / "server.log" for r in REGIONS)]}
    consumer = deployment.consumer("admin", consumer_timeout_ms=1500)  # MM2 wrote them at its start: all there
    try:
        tps = [TopicPartition("mm2-configs.us.internal", p) for p in consumer.partitions_for_topic("mm2-configs.us.internal")]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        texts["mm2-configs.us.internal"] = "\n".join((r.value or b"").decode(errors="replace") for r in consumer)
    finally:
        consumer.close()
    passwords = {role: secure_kafka.password_file(role).read_text().strip() for role in services.ROLES}
    leaks = [(where, role) for where, text in texts.items() for role, p in passwords.items() if p in text]
    assert not leaks, f"a password appears in: {leaks}"
    assert "${file:" in texts["mm2-configs.us.internal"] and "${file:" in texts[str(home / "mm2-secure" / "mm2.properties")]
