"""`ember rollouts grade` on the real broker: rollouts written through the real producer, graded by child
processes, counted afterwards by an independent read_committed consumer. Exactly one reward per rollout per
grader, in the rollout's partition; ungradable rollouts dead-lettered with their reason and counted; a grader
killed with SIGKILL at random moments (and once exactly between sending its rewards and committing) neither
loses nor doubles a reward."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import replace

import pytest
from kafka import KafkaProducer

from ember.rollouts.admin import ensure_topics
from ember.rollouts.grading.tasks import load_tasks
from ember.rollouts.topics import Topics
from ember.rollouts.transport import RolloutWriter, producer_config
from ember.schemas import encode
from tests.rollouts.etl_support import Deployment, read_topic, wait_for_line
from tests.rollouts.grading.support import (
    GRADERS,
    GraderProcess,
    code_rollout,
    fenced,
    fetch_humaneval,
    grader_settings,
    prepare,
    reward_counts,
    wait_for_rewards,
    write_config,
)

FIELDS = {"id": "id", "prompt": "prompt", "tests": "tests", "entry_point": "entry_point", "reference": "solution"}
NAMES = [g["name"] for g in GRADERS]


@pytest.fixture(scope="module")
def humaneval(tmp_path_factory):
    path = fetch_humaneval(tmp_path_factory.mktemp("benchmarks"))
    return path, load_tasks(path, FIELDS)


@pytest.fixture
def graders():
    started: list[GraderProcess] = []
    yield started
    for proc in started:
        if proc.proc.poll() is None:
            proc.kill()


def _write(deployment: Deployment, prefix: str, rollouts) -> None:
    with RolloutWriter(prefix, security=deployment.security("inference"), bootstrap_servers=deployment.bootstrap) as writer:
        for r in rollouts:
            writer.write(r)


def _dead_reasons(topic: str, deployment: Deployment) -> Counter:
    return Counter(dict(r.headers)["ember.reason"].decode() for r in read_topic(topic, deployment=deployment))


def graded_end_to_end(deployment: Deployment, tmp_path, humaneval, graders: list[GraderProcess]) -> None:
    """Right and wrong answers, unknown prompts, undecodable tokens and a malformed message through one grader
    run until idle: the reward and dead-letter books, checked from the topics."""
    path, tasks = humaneval
    prefix = f"test-grade-{uuid.uuid4().hex[:8]}"
    topics = prepare(deployment, prefix)
    chosen = list(tasks.values())[:12]
    right = [code_rollout(t, fenced(t.reference), f"right{i}", 0) for i, t in enumerate(chosen)]
    wrong = [code_rollout(t, fenced(t.reference.replace("return ", "return not ", 1)), f"wrong{i}", 0) for i, t in enumerate(chosen)]
    unknown = [code_rollout(f"NotHumanEval/{i}", "print(1)", f"unknown{i}", 0) for i in range(3)]
    undecodable = code_rollout(chosen[0], "x", "undecodable", 0)
    undecodable.tokens[-1] = 100256  # inside cl100k's range, but no token has it
    _write(deployment, prefix, right + wrong + unknown + [undecodable])
    producer = KafkaProducer(**producer_config(deployment.security("inference"), bootstrap_servers=deployment.bootstrap))
    producer.send(topics.rollouts, key=b"junk", value=b"not a rollout").get(timeout=30)
    producer.close()

    config = write_config(tmp_path / "grade.yaml", grader_settings(prefix, path, deployment))
    proc = GraderProcess(config, "0", tmp_path, "--until-idle", "3")
    graders.append(proc)
    assert proc.wait(180) == 0, proc.output()[-3000:]
    out = proc.output()

    counts, rewards = reward_counts(topics, deployment)
    graded = right + wrong
    assert counts == Counter({(r.rollout_id, g): 1 for r in graded for g in NAMES}), out[-3000:]
    partitions = {rec.value: rec.partition for rec in read_topic(topics.rollouts, deployment=deployment)}
    by_id = {r.rollout_id: r for r in graded}
    rollout_partition = {r.rollout_id: partitions[encode(r)] for r in graded}
    for partition, reward in rewards:
        assert partition == rollout_partition[reward.rollout_id], "a reward must land in its rollout's partition"
        assert reward.group_id == by_id[reward.rollout_id].group_id
        assert reward.grader_version == {"exact": "1", "contains": "2"}[reward.grader]
        passed = reward.rollout_id.startswith("right")
        assert (reward.verdict, reward.score, reward.components) == (("passed", 1.0, {"match": 1.0}) if passed else ("failed", 0.0, {"match": 0.0}))
    assert _dead_reasons(topics.dead_letter, deployment) == {"unknown_prompt": 3, "undecodable": 1, "malformed": 1}
    assert "24 rollouts graded, 48 rewards, 5 dead letters" in out, out[-3000:]
    assert "dead letters: unknown_prompt 3, " in out, out[-3000:]
    assert "graded " in out and "/s lag " in out, "no status line"
    assert "NotHumanEval/0" in out and "is not in the task set" in out


@pytest.mark.integration
def test_rewards_once_per_grader_and_ungradable_rollouts_dead_lettered(tmp_path, humaneval, graders):
    graded_end_to_end(Deployment.plaintext(), tmp_path, humaneval, graders)


@pytest.mark.integration
def test_kill_9_at_random_moments_loses_and_doubles_no_reward(tmp_path, humaneval, graders):
    """Two graders share a stream written at a steady rate: one kills itself exactly inside a transaction (rewards
    sent, not committed), one stays down past the session timeout (its partitions move, and move back), then
    either is killed with SIGKILL at random moments and restarted."""
    deployment = Deployment.plaintext()
    path, tasks = humaneval
    prefix = f"test-grade-kill-{uuid.uuid4().hex[:8]}"
    topics = prepare(deployment, prefix, partitions=4)
    config = write_config(tmp_path / "grade.yaml", grader_settings(prefix, path, deployment))
    chosen = list(tasks.values())
    rng = random.Random(27)
    stream = [code_rollout(chosen[i % len(chosen)], fenced(chosen[i % len(chosen)].reference if i % 3 else "pass\n"), f"s{i}", 0)
              for i in range(300)]

    def publish() -> None:
        with RolloutWriter(prefix, bootstrap_servers=deployment.bootstrap) as writer:
            for r in stream:
                writer.write(r)
                writer.flush()
                time.sleep(0.05)

    writer = threading.Thread(target=publish, daemon=True)
    graders.append(GraderProcess(config, "0", tmp_path))
    graders.append(GraderProcess(config, "1", tmp_path, fault="grader.before_commit:3"))
    writer.start()
    assert graders[1].wait(120) == -9, "the crash point did not kill the grader mid-transaction"
    graders[1] = GraderProcess(config, "1", tmp_path)
    graders[0].kill()  # down past the session timeout: its partitions move to instance 1, and back on its restart
    time.sleep(8)
    assert writer.is_alive(), "the stream ended before the rebalance: write it slower"
    graders[0] = GraderProcess(config, "0", tmp_path)
    kills = 1
    while writer.is_alive() or kills < 4:
        time.sleep(rng.uniform(0.5, 2.5))
        victim = rng.choice([0, 1])
        graders[victim].kill()
        kills += 1
        graders[victim] = GraderProcess(config, str(victim), tmp_path)
        if kills > 12:
            break
    writer.join(timeout=60)
    expected = len(stream) * len(NAMES)
    counts = wait_for_rewards(topics, deployment, expected, timeout_s=180, alive=lambda: all(p.proc.poll() is None for p in graders))
    time.sleep(3)  # anything doubled would be committed by now: the graders are idle at the end of the stream
    counts, _ = reward_counts(topics, deployment)
    doubled = {k: n for k, n in counts.items() if n != 1}
    assert not doubled and set(counts) == {(r.rollout_id, g) for r in stream for g in NAMES}, doubled
    for proc in graders:  # a process killed moments ago may still be starting: SIGTERM counts once it serves
        wait_for_line(proc, f"reads {topics.rollouts} as", timeout_s=60)
        assert proc.stop() == 0, proc.output()[-3000:]
    assert not read_topic(topics.dead_letter, deployment=deployment)
    assert kills >= 4 and all("rollouts graded" in p.output() for p in graders), "no exit summary"


@pytest.mark.integration
def test_rewards_with_another_partition_count_than_rollouts_is_exit_2(tmp_path, humaneval, graders):
    """The ETL joins rollouts partition p with rewards partition p, so the grader refuses topics it could not serve."""
    deployment = Deployment.plaintext()
    path, _tasks = humaneval
    prefix = f"test-grade-topo-{uuid.uuid4().hex[:8]}"
    specs = Topics(prefix).specs(2)
    specs["rewards"] = replace(specs["rewards"], partitions=3)
    ensure_topics(deployment.bootstrap, list(specs.values()))
    proc = GraderProcess(write_config(tmp_path / "grade.yaml", grader_settings(prefix, path, deployment)), "0", tmp_path)
    graders.append(proc)
    assert proc.wait(120) == 2, proc.output()[-3000:]
    assert f"{prefix}.rollouts has 2 partitions but {prefix}.rewards has 3" in proc.output()
    assert "Traceback" not in proc.output()
