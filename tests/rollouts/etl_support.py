"""Running real ETL processes against the real broker (PLAINTEXT, or SASL_SSL with one principal per
role) and checking the books afterwards."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from kafka import KafkaConsumer, TopicPartition

from ember.dev.services import SecureBroker
from ember.rollouts.acls import role_bindings
from ember.rollouts.admin import apply_acls
from ember.rollouts.config import EtlConfig, kafka_bootstrap, parse_config
from ember.rollouts.etl import EtlService, prepare_topics
from ember.rollouts.reader import RolloutBatchReader
from ember.rollouts.records import Outcome
from ember.rollouts.replay import parse_start, replay
from ember.rollouts.security import ENVIRONMENT, PASSWORD_ENV, PASSWORD_FILE_ENV, KafkaSecurity, role_securities
from ember.rollouts.simulate import LARGE_VOCAB, Event, PolicyShape, PublishStats, WorkloadSpec, plan_workload, publish_workload
from ember.rollouts.topics import Topics
from ember.rollouts.transport import consumer_config
from ember.schemas import Reward, Rollout, decode_train_batch

REPO = Path(__file__).resolve().parents[2]
SECURITY_ENV = [*ENVIRONMENT.values(), PASSWORD_ENV, PASSWORD_FILE_ENV]


@dataclass(frozen=True)
class Deployment:
    """A broker and how each role connects to it: on the PLAINTEXT broker every role is anonymous."""

    bootstrap: str
    roles: dict[str, KafkaSecurity] = field(default_factory=dict)

    @classmethod
    def plaintext(cls) -> "Deployment":
        return cls(kafka_bootstrap())

    @classmethod
    def secured(cls, broker: SecureBroker) -> "Deployment":
        return cls(
            broker.bootstrap,
            role_securities(broker),
        )

    def security(self, role: str) -> KafkaSecurity:
        return self.roles.get(role) or KafkaSecurity(security_protocol="PLAINTEXT")

    def environment(self, role: str) -> dict[str, str]:
        """EMBER_KAFKA_BOOTSTRAP and every EMBER_KAFKA_* security variable for a command without a config to connect
        as `role` (the password by its file); a variable the role does not use is empty, which counts as unset."""
        kwargs = self.security(role).model_dump(mode="json", exclude_none=True)
        env = {name: "" for name in SECURITY_ENV}
        env.update({variable: str(kwargs[key]) for key, variable in ENVIRONMENT.items() if key in kwargs})
        if "sasl_plain_password_file" in kwargs:
            env[PASSWORD_FILE_ENV] = str(kwargs["sasl_plain_password_file"])
        return {"EMBER_KAFKA_BOOTSTRAP": self.bootstrap, **env}

    def kafka_section(self, role: str = "etl") -> dict:
        """The `kafka:` keys an ETL config needs to connect as `role`."""
        return {"bootstrap": self.bootstrap, "security": self.security(role).model_dump(mode="json", exclude_none=True)}

    @property
    def publishers(self) -> dict[str, KafkaSecurity]:
        """Who writes each simulated event: the inference fleet, the graders, the trainer."""
        return {"rollouts": self.security("inference"), "rewards": self.security("grader"), "policy_versions": self.security("trainer")}

    def consumer(self, role: str = "admin", **overrides) -> KafkaConsumer:
        return KafkaConsumer(**consumer_config(self.security(role), bootstrap_servers=self.bootstrap, **overrides))

    def prepare(self, prefix: str, config: EtlConfig) -> Topics:
        """What an operator does before the ETL starts: topics created (and, when secured, ACLs applied) as the admin."""
        topics = prepare_topics(config.with_overrides(kafka=self.kafka_section("admin")), create=True)
        if self.roles:
            apply_acls(self.bootstrap, role_bindings(prefix), self.security("admin"))
        return topics


def etl_settings(prefix: str, *, partitions: int = 4, **sections) -> dict:
    settings = {
        "kafka": {
            "topic_prefix": prefix,
            "partitions": partitions,
            "group_id": f"{prefix}-etl",
            "session_timeout_ms": 6000,
            "heartbeat_interval_ms": 1000,
            "transaction_timeout_ms": 5000,
        },
        "groups": {"size": 4, "quorum": 2, "timeout_s": 10},
        "rewards": {"graders": ["unit-tests"], "timeout_s": 6, "orphan_timeout_s": 8},
        "filters": {"max_policy_lag": None, "max_tokens": 512, "truncated": "keep", "vocab_size": LARGE_VOCAB},
        "batches": {"token_budget": 512, "min_fill": 0.5, "max_wait_s": 0.3},
        "commit": {"interval_ms": 100},
    }
    for name, values in sections.items():
        settings[name] = {**settings.get(name, {}), **values}
    return settings


def write_config(path: Path, settings: dict) -> EtlConfig:
    path.write_text(yaml.safe_dump(settings))
    return parse_config(settings)


class ServiceProcess:
    """`ember rollouts COMMAND CONFIG --instance I ...` as a child process, killable with SIGKILL; its output in a
    log file. `fault` sets EMBER_FAULT (ember.rollouts.faults) for this child only."""

    def __init__(self, command: str, config_path: Path, instance: str, log_dir: Path, *args: str, fault: str | None = None):
        self.log = log_dir / f"{command}-{instance}-{time.monotonic_ns()}.log"
        env = {k: v for k, v in os.environ.items() if k != "EMBER_FAULT"}
        if fault:
            env["EMBER_FAULT"] = fault
        self._file = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "rollouts", command, str(config_path), "--instance", instance, *args],
            cwd=REPO, env=env, stdout=self._file, stderr=subprocess.STDOUT,
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._file.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self._file.close()

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self._file.close()

    def output(self) -> str:
        return self.log.read_text()


class EtlProcess(ServiceProcess):
    """`ember rollouts etl CONFIG` as a child process."""

    def __init__(self, config_path: Path, instance: str, log_dir: Path, fault: str | None = None):
        super().__init__("etl", config_path, instance, log_dir, fault=fault)


class EtlThread(threading.Thread):
    """One ETL process of the group, in this test process (a second one is a rebalance)."""

    def __init__(self, config, instance: str):
        super().__init__(daemon=True)
        self.service, self.stop, self.error = EtlService(config, instance), threading.Event(), None

    def run(self) -> None:
        try:
            self.service.run(self.stop)
        except BaseException as exc:  # surfaced by the test, not lost in a thread
            self.error = exc

    def finish(self) -> None:
        self.stop.set()
        self.join(timeout=60)
        assert self.error is None, f"ETL {self.service.instance} failed: {self.error!r}"


def wait_for_line(proc: ServiceProcess, needle: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while needle not in proc.output():
        assert proc.proc.poll() is None, proc.output()[-3000:]
        assert time.monotonic() < deadline, f"{needle!r} not logged within {timeout_s}s:\n{proc.output()[-3000:]}"
        time.sleep(0.2)


def read_topic(
    topic: str, timeout_s: float = 60.0, deployment: Deployment | None = None, isolation_level: str = "read_committed"
) -> list:
    """Every committed record of a topic, up to its end at the time of the call (read as the admin); with
    `isolation_level="read_uncommitted"`, the records of aborted and open transactions too."""
    consumer = (deployment or Deployment.plaintext()).consumer(group_id=None, isolation_level=isolation_level)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        if not tps:
            return []
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        records = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"could not read {topic} to its end within {timeout_s}s"
            for batch in consumer.poll(timeout_ms=500).values():
                records += [r for r in batch if r.offset < ends[TopicPartition(r.topic, r.partition)]]
        return records
    finally:
        consumer.close()


@dataclass
class Workload:
    spec: WorkloadSpec
    events: list[Event]

    @property
    def rollout_messages(self) -> int:
        return sum(1 for e in self.events if isinstance(e.record, Rollout))

    @property
    def malformed(self) -> int:
        return sum(1 for e in self.events if e.record is None)

    def complete_groups(self, reward_timeout_s: float, margin_s: float = 2.0) -> set[str]:
        """Rollouts of groups where every sample has an on-time reward: these must all be batched."""
        published: dict[str, float] = {}
        rewarded: dict[str, float] = {}
        for e in self.events:
            if isinstance(e.record, Rollout) and not e.note:
                published[e.record.rollout_id] = e.at_s
            if isinstance(e.record, Reward) and not e.note:
                rewarded[e.record.rollout_id] = e.at_s
        by_group: dict[str, list[str]] = {}
        for rid in published:
            by_group.setdefault(rid.rsplit("-", 1)[0], []).append(rid)
        expected = set()
        for ids in by_group.values():
            if len(ids) == self.spec.group_size and all(
                r in rewarded and rewarded[r] - published[r] < reward_timeout_s - margin_s for r in ids
            ):
                expected.update(ids)
        return expected


def workload(prefix: str, **overrides) -> Workload:
    spec = WorkloadSpec(
        **{
            "groups": 30,
            "group_size": 4,
            "tokens": 48,
            "length_sigma": 0.4,
            "shape": PolicyShape(vocab_size=LARGE_VOCAB, layers=2, top_k=2, num_experts=256, max_tokens=128),
            "regions": {"us-east": 0.0, "eu-west": 0.3, "ap-south": 0.8},
            "group_interval_s": 0.3,
            "episode_s": 0.2,
            "reward_delay_s": 0.3,
            "p_missing_reward": 0.05,
            "p_duplicate_reward": 0.1,
            "p_duplicate_rollout": 0.1,
            "p_malformed": 0.05,
            "seed": 11,
            "group_prefix": prefix,
            **overrides,
        }
    )
    return Workload(spec, plan_workload(spec))


def publish_in_background(
    work: Workload, topics: Topics, time_scale: float = 1.0, deployment: Deployment | None = None
) -> tuple[threading.Thread, list]:
    result: list[PublishStats] = []
    deployment = deployment or Deployment.plaintext()

    def publish() -> None:
        stats = publish_workload(work.events, topics, time_scale=time_scale, security=deployment.publishers, bootstrap=deployment.bootstrap)
        result.append(stats)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    return thread, result


@dataclass
class Books:
    batch_ids: list[str]
    batched: list[str]
    ledger_batched: list[str]
    dropped: list[Outcome]
    rewards_dropped: list[Outcome]
    dead_letters: list[Outcome]
    dead_letter_records: list

    @property
    def accounted(self) -> int:
        return len(self.ledger_batched) + len(self.dropped)


def books(topics: Topics, deployment: Deployment | None = None) -> Books:
    outcomes = [Outcome.decode(r.value) for r in read_topic(topics.outcomes, deployment=deployment)]
    batches = [decode_train_batch(r.value) for r in read_topic(topics.train_batches, deployment=deployment)]
    return Books(
        batch_ids=[b.batch_id for b in batches],
        batched=[rid for b in batches for rid in b.rollout_ids],
        ledger_batched=[rid for o in outcomes if o.kind == "batch" for rid in o.detail["rollout_ids"]],
        dropped=[o for o in outcomes if o.kind == "rollout_dropped"],
        rewards_dropped=[o for o in outcomes if o.kind == "reward_dropped"],
        dead_letters=[o for o in outcomes if o.kind == "dead_letter"],
        dead_letter_records=read_topic(topics.dead_letter, deployment=deployment),
    )


def ledger_counts(topic: str, deployment: Deployment | None = None) -> tuple[int, int]:
    """(rollouts accounted for, dead letters) in the ledger so far."""
    accounted = dead = 0
    for record in read_topic(topic, deployment=deployment):
        outcome = Outcome.decode(record.value)
        if outcome.kind == "batch":
            accounted += len(outcome.detail["rollout_ids"])
        elif outcome.kind == "rollout_dropped":
            accounted += 1
        elif outcome.kind == "dead_letter":
            dead += 1
    return accounted, dead


def wait_for_books(
    topics: Topics, work: Workload, timeout_s: float, alive=lambda: True, deployment: Deployment | None = None
) -> None:
    """Poll the ledger until every rollout message and malformed message is accounted for."""
    deadline = time.monotonic() + timeout_s
    seen = (0, 0)
    while time.monotonic() < deadline:
        assert alive(), "the ETL process died"
        seen = ledger_counts(topics.outcomes, deployment)
        if seen[0] >= work.rollout_messages and seen[1] >= work.malformed:
            return
        time.sleep(1.0)
    raise AssertionError(f"after {timeout_s}s the ledger accounts for {seen}, expected {(work.rollout_messages, work.malformed)}")


def check_books(topics: Topics, work: Workload, reward_timeout_s: float, deployment: Deployment | None = None) -> Books:
    found = books(topics, deployment)
    duplicates = [b for b, n in Counter(found.batch_ids).items() if n > 1]
    assert not duplicates, f"batch ids committed twice: {duplicates}"
    twice = [r for r, n in Counter(found.batched).items() if n > 1]
    assert not twice, f"rollouts in more than one committed batch: {twice}"
    assert Counter(found.batched) == Counter(found.ledger_batched), "ledger and train-batches disagree"
    positions = Counter((o.partition, o.offset) for o in found.dropped)
    assert max(positions.values(), default=1) == 1, "a rollout message was dropped twice"
    assert found.accounted == work.rollout_messages, (
        f"{len(found.batched)} batched + {len(found.dropped)} dropped != {work.rollout_messages} published"
    )
    missing = work.complete_groups(reward_timeout_s) - set(found.batched)
    assert not missing, f"rewarded rollouts of complete groups never batched: {sorted(missing)}"
    assert len(found.dead_letters) == work.malformed == len(found.dead_letter_records), (
        len(found.dead_letters), work.malformed, len(found.dead_letter_records)
    )
    return found


def check_replay(config: EtlConfig, topics: Topics, out: Path, deployment: Deployment | None = None) -> None:
    """`ember rollouts replay` of the same log with the live settings writes the live ledger, record for record
    (batches, drops, reasons and the log time of each decision), whatever crashes and rebalances the live run had."""
    replay(config, parse_start("earliest"), to_dir=out)
    replayed = sorted((out / "outcomes.jsonl").read_text().splitlines())
    live = sorted(Outcome.decode(r.value).encode().decode() for r in read_topic(topics.outcomes, deployment=deployment))
    only_live, only_replayed = sorted(set(live) - set(replayed)), sorted(set(replayed) - set(live))
    assert live == replayed, (
        f"{len(live)} live ledger records, {len(replayed)} replayed; only live: {only_live[:3]}; only replayed: {only_replayed[:3]}"
    )


def trainer_batch_ids(topics: Topics, deployment: Deployment, prefix: str) -> list[str]:
    """Every batch id the trainer principal reads from train-batches with its own group, as `midtrain rl` does."""
    with RolloutBatchReader(
        topics.train_batches, group_id=f"{prefix}-trainer", bootstrap=deployment.bootstrap,
        security=deployment.security("trainer"), idle_timeout_s=5,
    ) as reader:
        ids = [read.batch.batch_id for read in reader]
        reader.commit()
    return ids


REWARD_TIMEOUT_S = 6.0


def setup_etl(
    tmp_path: Path, deployment: Deployment, partitions: int = 4, prefix: str | None = None, **sections
) -> tuple[str, EtlConfig, Topics]:
    """A prefix (fresh unless given), its ETL config (connecting as the etl role) in tmp_path/etl.yaml, and its prepared topics."""
    prefix = prefix or f"test-fault-{uuid.uuid4().hex[:8]}"
    kafka = {**deployment.kafka_section("etl"), **sections.pop("kafka", {})}
    config = write_config(tmp_path / "etl.yaml", etl_settings(prefix, partitions=partitions, kafka=kafka, **sections))
    return prefix, config, deployment.prepare(prefix, config)


def finish(procs: list[EtlProcess]) -> None:
    for proc in procs:
        code = proc.stop()
        assert code == 0, f"ETL exited with {code}:\n{proc.output()[-3000:]}"


def kill_9_scenario(deployment: Deployment, tmp_path: Path, processes: list[EtlProcess]) -> Books:
    """ETL processes killed at crash points inside the transaction (before its offsets, before its
    commit), right after it, and at random moments while the stream flows; a survivor finishes."""
    prefix, config, topics = setup_etl(tmp_path, deployment)
    work = workload(prefix, groups=48, group_interval_s=0.25)
    thread, _ = publish_in_background(work, topics, deployment=deployment)
    rng = random.Random(7)
    for fault in ["etl.before_commit:2", "etl.before_send_offsets:1", "etl.after_commit:2", None, None]:
        proc = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path, fault=fault)
        processes.append(proc)
        if fault:
            try:
                proc.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{fault} never fired within 120 s:\n{proc.output()[-3000:]}") from None
            assert proc.proc.returncode == -signal.SIGKILL, f"{fault}: exit {proc.proc.returncode}\n{proc.output()[-3000:]}"
            proc.kill()
        else:
            time.sleep(rng.uniform(1.5, 3.5))
            assert proc.proc.poll() is None, proc.output()[-3000:]
            proc.kill()
    survivor = EtlProcess(tmp_path / "etl.yaml", "0", tmp_path)
    processes.append(survivor)
    deadline = time.monotonic() + 120  # the survivor must really take over, not be stopped while still starting
    while "owns shards" not in survivor.output():
        assert survivor.proc.poll() is None and time.monotonic() < deadline, survivor.output()[-3000:]
        time.sleep(0.2)
    thread.join(timeout=120)
    wait_for_books(topics, work, timeout_s=120, alive=lambda: survivor.proc.poll() is None, deployment=deployment)
    finish([survivor])
    found = check_books(topics, work, REWARD_TIMEOUT_S, deployment)
    assert found.batch_ids
    assert sorted(trainer_batch_ids(topics, deployment, prefix)) == sorted(found.batch_ids)
    check_replay(config, topics, tmp_path / "replayed", deployment)
    return found


def takeover_scenario(deployment: Deployment, tmp_path: Path, processes: list[EtlProcess]) -> Books:
    """Two ETL processes share the shards; one is killed with -9 and the other takes over all of them."""
    prefix, config, topics = setup_etl(tmp_path, deployment)
    work = workload(prefix, groups=30, group_interval_s=0.25)
    first = EtlProcess(tmp_path / "etl.yaml", "a", tmp_path)
    second = EtlProcess(tmp_path / "etl.yaml", "b", tmp_path)
    processes.extend([first, second])
    thread, _ = publish_in_background(work, topics, deployment=deployment)
    time.sleep(4.0)
    assert first.proc.poll() is None and second.proc.poll() is None, first.output()[-3000:] + second.output()[-3000:]
    first.kill()
    thread.join(timeout=120)
    wait_for_books(topics, work, timeout_s=120, alive=lambda: second.proc.poll() is None, deployment=deployment)
    finish([second])
    found = check_books(topics, work, REWARD_TIMEOUT_S, deployment)
    assert "owns shards [0, 1, 2, 3]" in second.output(), "the survivor never took over every partition"
    check_replay(config, topics, tmp_path / "replayed", deployment)
    return found
