"""The grading service on the secured broker (SASL_SSL, SCRAM-SHA-512, ACLs from `ember rollouts acls`): the
grader role reads rollouts with its own group and commits with its own transactional ids, and stays refused
what it must never do: write rollouts or train batches, join another role's group, use another's transactional id."""

from __future__ import annotations

import uuid

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import GroupAuthorizationFailedError, TopicAuthorizationFailedError, TransactionalIdAuthorizationFailedError

from ember.rollouts.transport import RolloutWriter, WriteFailed, consumer_config, producer_config
from tests.rollouts.grading.support import prepare
from tests.rollouts.helpers import rollout
from tests.rollouts.grading.test_service import graded_end_to_end, humaneval  # noqa: F401  (a fixture)
from tests.rollouts.grading.test_service import graders  # noqa: F401  (a fixture)


@pytest.mark.integration
def test_grader_role_grades_end_to_end_over_sasl_ssl(secured, tmp_path, humaneval, graders):  # noqa: F811
    deployment, outputs = secured
    graded_end_to_end(deployment, tmp_path, humaneval, graders)
    outputs.extend(p.output() for p in graders)
    assert "as SASL_SSL SCRAM-SHA-512 as ember-grader with exact (rule v1), contains (rule v2)" in graders[0].output()


@pytest.mark.integration
def test_grader_role_is_refused_outside_its_acls(secured):
    deployment, _outputs = secured
    prefix = f"test-grade-acl-{uuid.uuid4().hex[:8]}"
    topics = prepare(deployment, prefix, partitions=1)
    security = deployment.security("grader")
    producer = KafkaProducer(**producer_config(security, bootstrap_servers=deployment.bootstrap, max_block_ms=20_000))
    try:
        for topic in (topics.rollouts, topics.train_batches):
            with pytest.raises(TopicAuthorizationFailedError, match=topic):
                producer.send(topic, key=b"forged", value=b"not the grader's to write").get(timeout=30)
    finally:
        producer.close(timeout=5)
    writer = RolloutWriter(prefix, security=security, bootstrap_servers=deployment.bootstrap, max_block_ms=20_000)
    writer.write(rollout("forged", 0))
    with pytest.raises(WriteFailed, match=rf"1 of 1 records sent to {topics.rollouts} were not written: .*TopicAuthorizationFailed"):
        writer.close()  # the writer the inference worker holds says so; flushing alone would not
    etl_group = KafkaConsumer(**consumer_config(security, bootstrap_servers=deployment.bootstrap, group_id=f"{prefix}-etl"))
    try:
        etl_group.subscribe([topics.rollouts])
        with pytest.raises(GroupAuthorizationFailedError):
            etl_group.poll(timeout_ms=10_000)
    finally:
        etl_group.close(autocommit=False)
    foreign = KafkaProducer(**producer_config(
        security, bootstrap_servers=deployment.bootstrap, transactional_id=f"{prefix}-etl-0", max_block_ms=20_000
    ))
    try:
        with pytest.raises(TransactionalIdAuthorizationFailedError):
            foreign.init_transactions()
    finally:
        foreign.close(timeout=5)
