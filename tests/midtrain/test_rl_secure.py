"""`midtrain rl` with two ranks on the secured broker (SASL_SSL, SCRAM-SHA-512, ACLs): rollouts sampled by the tiny
policy are published by the inference principal, their rewards by the grader, batched by the ETL as ember-etl, and
trained on by `midtrain rl --nproc-per-node 2` connecting only through its config's `rollouts.security` as
ember-trainer: rank 0 reads and commits the batches with the trainer's group, each rank fetches its own share's
rollouts, and the policy versions are announced on the trainer's topic. The `secured` fixture searches every output,
log and file of the run (checkpoints and exported weights included) for a password afterwards.

Megatron-core keeps global parallel state, so the sampler and the trainers run in subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from kafka import TopicPartition

from ember.rollouts.etl import EtlService
from ember.rollouts.records import PolicyVersion
from ember.rollouts.transport import RewardWriter, RolloutWriter
from ember.schemas import decode, decode_train_batch
from tests.rollouts.etl_support import REPO, SECURITY_ENV, read_topic

from .rl_support import etl_config, trainer_config

pytestmark = pytest.mark.integration

GROUPS = 3  # one group of 4 rollouts per 64-token batch: 3 steps, 2 rollouts per rank


def test_two_ranks_train_on_batches_made_and_read_over_sasl_ssl(secured, topic_prefix, tmp_path, sampled_policy):
    deployment, outputs = secured
    etl = etl_config(topic_prefix, token_budget=64).with_overrides(kafka=deployment.kafka_section("etl"))
    topics = deployment.prepare(topic_prefix, etl)

    records = sampled_policy.copy_records(GROUPS, tmp_path / "records")
    fleet = {"inference": (RolloutWriter, "*.rollout"), "grader": (RewardWriter, "*.reward")}
    for role, (writer_class, pattern) in fleet.items():
        with writer_class(topic_prefix, security=deployment.security(role), bootstrap_servers=deployment.bootstrap) as writer:
            for path in sorted(records.glob(pattern)):
                writer.write(decode(path.read_bytes())).get(timeout=30)
    EtlService(etl, "rl-secure").run(until_idle_s=2.0)
    batches = read_topic(topics.train_batches, deployment=deployment)
    decoded = [decode_train_batch(r.value) for r in batches]
    assert len(decoded) == GROUPS and all(b.by_reference for b in decoded), "each rank must fetch its share's rollouts"
    ids = [b.batch_id for b in decoded]

    config = trainer_config(tmp_path, "trainer", topic_prefix, sampled_policy.init_checkpoint, steps=len(ids), correction="tis")
    data = yaml.safe_load(config.read_text())
    security = deployment.security("trainer").model_dump(mode="json", exclude_none=True)
    data["rollouts"].update(bootstrap=deployment.bootstrap, security=security)
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    env = {**os.environ, **{name: "" for name in SECURITY_ENV}}  # the config alone says how to connect
    trained = subprocess.run(
        [sys.executable, "-m", "ember.midtrain.cli", "rl", str(config), "--nproc-per-node", "2", "--threads", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=420,
    )
    outputs.append(trained.stdout + trained.stderr)
    assert trained.returncode == 0, (trained.stdout + trained.stderr)[-4000:]

    steps = [json.loads(line) for line in (tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "event" not in r]
    assert [r["batch_id"] for r in steps] == ids, "every batch trained once, in order"
    assert all(r["ranks"] == 2 and r["rank_sequences"] == [2, 2] and r["replayed"] for r in steps)
    announced = [PolicyVersion.decode(r.value) for r in read_topic(topics.policy_versions, deployment=deployment)]
    assert [v.policy_version for v in announced] == list(range(len(ids) + 1)), "the start, then every checkpoint"
    assert all(v.carries_weights for v in announced)
    after_last = {}
    for record in batches:
        after_last[TopicPartition(record.topic, record.partition)] = record.offset + 1
    group = deployment.consumer("admin", group_id=data["rollouts"]["group_id"])
    try:
        assert {tp: group.committed(tp) for tp in after_last} == after_last, "the trainer's group committed every step"
    finally:
        group.close(autocommit=False)
