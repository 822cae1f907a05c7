"""The closed-loop stage of `ember demo` (its run checked by tests/test_demo.py): the RL loop with no simulator.

Five real processes on one fresh topic prefix, each the CLI a deployment runs: `midtrain rl` (2 ranks, router
replay; it exports and announces its starting weights, then every step's) -> `rollouts sample` (transformers,
following the announcements, at most `groups_per_version` groups from each version so it keeps pace with the
trainer) -> `rollouts grade` (a `rule` grader against each task's reference; the task set is HumanEval-shaped,
so `kind: unit_tests` is a config change) -> `rollouts etl` -> back to the trainer. The stage then stops the
services and reads every topic back read_committed, so its verdicts are counted from what the broker holds,
not from what the processes say they did.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml
from kafka import KafkaConsumer, TopicPartition
from rich.console import Console

from ember.rollouts.records import Outcome, PolicyVersion
from ember.rollouts.topics import Topics
from ember.rollouts.transport import consumer_config
from ember.schemas import Reward, Rollout, decode

GRADER = "reference-match"
GROUP_SIZE = 4
TASKS = [  # HumanEval's fields, for prompts that fit the tiny policy's 64 positions: "return a word holding this
    # letter", which a random policy's completion does about half the time (graded `contains` against the letter; the
    # tests check the same for `unit_tests`), so a group's rewards differ and the trainer's steps move the weights
    {"id": f"loop/{letter}", "prompt": f"def word_with_{letter}():\n    return '", "solution": letter,
     "entry_point": f"word_with_{letter}", "tests": f"def check(f):\n    assert {letter!r} in f()\n"}
    for letter in "updh"
]
_LOADED = re.compile(r"loaded policy version (\d+): export\.json sha256 ([0-9a-f]{64}) \(verified\)")
_EXAMPLE = Path(__file__).resolve().parents[1] / "midtrain" / "examples" / "rl_tiny_cpu.yaml"


@dataclass(frozen=True)
class LoopRecords:
    """What the broker holds after the loop (read_committed), and what the sampler says it loaded."""

    announced: list[PolicyVersion]
    rollouts: list[Rollout]
    rewards: list[Reward]
    outcomes: list[Outcome]
    loaded: list[tuple[int, str]]  # (version, export.json sha256) per load, from the sampler's output
    versions_dir: Path
    seconds: float

    @property
    def initial_version(self) -> int:
        return min(v.policy_version for v in self.announced)

    def later_starts(self) -> set[int]:
        """Versions after the initial one that some rollout started with: versions gone round."""
        return {r.policy_version for r in self.rollouts} - {self.initial_version}

    def fates(self) -> Counter:
        """Rollout id -> how many times the ETL's ledger decided it (batched, dropped or dead-lettered)."""
        decided = Counter(rid for o in self.outcomes if o.kind == "batch" for rid in o.detail["rollout_ids"])
        decided.update(o.rollout_id for o in self.outcomes if o.kind in ("rollout_dropped", "dead_letter") and o.rollout_id)
        return decided

    def sha256_matches(self) -> bool:
        """Each version the sampler loaded: its verified digest is the trainer's announcement and the export's own."""
        announced = {v.policy_version: v.weights_sha256 for v in self.announced}
        return bool(self.loaded) and all(
            announced.get(version) == digest == _export_digest(self.versions_dir, version) for version, digest in self.loaded
        )

    def summary(self) -> str:
        batches = sum(1 for o in self.outcomes if o.kind == "batch")
        dropped = Counter(o.reason for o in self.outcomes if o.kind == "rollout_dropped")
        fates = self.fates()
        exact = set(fates) == {r.rollout_id for r in self.rollouts} and set(fates.values()) == {1}
        graded = Counter((r.rollout_id, r.grader) for r in self.rewards)
        return (
            f"{len(self.later_starts())} versions gone round after v{self.initial_version} "
            f"(rollouts start at {sorted({r.policy_version for r in self.rollouts})}), {len(self.rollouts)} rollouts, "
            f"{len(self.rewards)} rewards ({'one' if set(graded.values()) == {1} else 'NOT one'} per rollout, "
            f"{sum(r.score > 0 for r in self.rewards)} passed), "
            f"{batches} batches, dropped {dict(dropped) or 0}, each rollout decided once: {'yes' if exact else 'NO'}, "
            f"sampler sha256 = trainer's export: {'yes' if self.sha256_matches() else 'NO'}, {self.seconds:.0f}s"
        )


def _export_digest(versions_dir: Path, version: int) -> str | None:
    manifest = versions_dir / f"version_{version}" / "export.json"
    return hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.exists() else None


def train_tokenizer(path: Path, vocab_size: int = 512) -> Path:
    """A byte-level BPE of the tiny policy's vocabulary, trained on the standard library's code (the demo's own
    tokenizer; `model.tokenizer: byte-bpe` in the RL example names one of this kind)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ember.demo.sample_documents import code_documents

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([d.text for d in code_documents(max_files=40, max_chars=20_000)], trainer)
    tokenizer.save(str(path))
    return path


def write_configs(workdir: Path, prefix: str, tokenizer: Path, steps: int, groups_per_version: int) -> dict[str, Path]:
    """The task set and the four services' configs, fitted to each other: one tokenizer (512 ids, the policy's
    vocab_size and the ETL's filter), 64 positions (prompt + max_new_tokens, the ETL's max_tokens), G everywhere."""
    workdir.mkdir(parents=True, exist_ok=True)
    tasks = workdir / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    tokenizer_section = {"name": "byte-bpe", "path": str(tokenizer), "eos_token": "<|endoftext|>"}
    rl = yaml.safe_load(_EXAMPLE.read_text())
    rl.update(run_dir=str(workdir / "rl"), init_checkpoint=None)
    rl["rollouts"] = {"topic_prefix": prefix, "group_id": f"{prefix}-trainer", "idle_timeout_s": 120}
    rl["rl"].update(steps=steps, save_interval=1, keep_versions=steps + 1)
    vocab, seq_len = rl["model"]["vocab_size"], rl["model"]["seq_len"]
    documents = {
        "rl": rl,
        "sample": {
            "kafka": {"topic_prefix": prefix}, "tasks": str(tasks), "tokenizer": tokenizer_section,
            "policy": {"follow": True, "wait_s": 300, "max_groups_per_version": groups_per_version},
            "generation": {"group_size": GROUP_SIZE, "batch_size": GROUP_SIZE * groups_per_version, "temperature": 1.0,
                           "top_p": 1.0, "max_new_tokens": 16, "seed": 1},
            "epochs": 10_000, "run_id": "loop",  # the sampler runs until stopped
        },
        "grade": {
            "kafka": {"topic_prefix": prefix, "group_id": f"{prefix}-grader"}, "tasks": {"path": str(tasks)},
            "tokenizer": tokenizer_section,
            "graders": [{"name": GRADER, "version": "1", "kind": "rule", "settings": {"match": "contains"}}],
            "metrics": {"status_interval_s": 0},
        },
        "etl": {
            "kafka": {"topic_prefix": prefix, "partitions": 1, "group_id": f"{prefix}-etl"},
            "groups": {"size": GROUP_SIZE, "quorum": GROUP_SIZE, "timeout_s": 120},
            "rewards": {"graders": [GRADER], "timeout_s": 120},
            # A random policy seldom says EOS or passes: keep its cut-off completions and its all-zero groups.
            "filters": {"vocab_size": vocab, "max_tokens": seq_len, "max_policy_lag": steps, "truncated": "keep"},
            "advantages": {"drop_zero_variance": False},
            "batches": {"token_budget": GROUP_SIZE * groups_per_version * seq_len, "min_fill": 0.5, "max_wait_s": 0.5},
            "metrics": {"port": None, "status_interval_s": 0},
        },
    }
    paths = {}
    for name, document in documents.items():
        paths[name] = workdir / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(document, sort_keys=False))
    return paths


class _Services:
    """The loop's processes, each logging to workdir/<name>.log; stopped by SIGTERM, as an operator would."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.bin = Path(sys.executable).parent

    def start(self, name: str, command: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
        self.procs[name] = subprocess.Popen([str(self.bin / command[0]), *command[1:]], stdout=log, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)
        log.close()

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def check_alive(self, *names: str) -> None:
        for name in names:
            if (code := self.procs[name].poll()) is not None:
                raise RuntimeError(f"{name} exited {code} early:\n{self.log(name)[-3000:]}")

    def stop(self, name: str, timeout_s: float = 60) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{name} did not stop within {timeout_s:.0f}s of SIGTERM:\n{self.log(name)[-3000:]}") from None

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _read_all(topic: str, decode_value, until=None, timeout_s: float = 30) -> list:
    """Every committed record of `topic`, from the start to its end now (read_committed: aborted writes excluded)."""
    consumer = KafkaConsumer(**consumer_config(group_id=None))
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        end = consumer.end_offsets(parts)
        found, deadline = [], time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in parts):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {topic} to its end within {timeout_s:.0f}s")
            for tp, messages in consumer.poll(timeout_ms=500).items():
                found += [decode_value(m.value) for m in messages if m.offset < end[tp]]
        return found
    finally:
        consumer.close()


def _wait(what: str, done, services: _Services, alive: tuple[str, ...], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        services.check_alive(*alive)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the loop: {what} did not happen within {timeout_s:.0f}s")
        time.sleep(0.25)


def run_loop(workdir: Path, prefix: str, tokenizer: Path, *, steps: int = 3, groups_per_version: int = 2,
             timeout_s: float = 600) -> LoopRecords:
    """Runs the loop until the trainer has taken `steps` steps and the sampler has sampled its last version, drains
    grader and ETL until every rollout is decided, stops them, and returns what the topics hold."""
    started = time.perf_counter()
    paths = write_configs(workdir, prefix, tokenizer, steps, groups_per_version)
    topics = Topics(prefix)
    subprocess.run([str(Path(sys.executable).parent / "ember"), "rollouts", "topics", "create", "--prefix", prefix,
                    "--partitions", "1"], check=True, capture_output=True, timeout=120)
    services = _Services(workdir)
    try:
        services.start("trainer", ["midtrain", "rl", str(paths["rl"]), "--nproc-per-node", "2", "--threads", "1"])
        services.start("grader", ["ember", "rollouts", "grade", str(paths["grade"]), "--instance", "0"])
        services.start("etl", ["ember", "rollouts", "etl", str(paths["etl"]), "--instance", "0"])
        services.start("sampler", ["ember", "rollouts", "sample", str(paths["sample"])])
        deadline = time.monotonic() + timeout_s
        _wait("the trainer's steps", lambda: services.procs["trainer"].poll() is not None, services,
              ("grader", "etl", "sampler"), timeout_s)
        if services.procs["trainer"].returncode != 0:
            raise RuntimeError(f"midtrain rl exited {services.procs['trainer'].returncode}:\n{services.log('trainer')[-3000:]}")
        last = max(v.policy_version for v in _read_all(topics.policy_versions, PolicyVersion.decode))
        _wait(f"a rollout of the last version ({last})",
              lambda: any(r.policy_version == last for r in _read_all(topics.rollouts, decode)), services,
              ("grader", "etl", "sampler"), deadline - time.monotonic())
        if (code := services.stop("sampler")) != 0:
            raise RuntimeError(f"rollouts sample exited {code}:\n{services.log('sampler')[-3000:]}")
        rollouts = {r.rollout_id for r in _read_all(topics.rollouts, decode)}

        def drained() -> bool:
            outcomes = _read_all(topics.outcomes, Outcome.decode)
            decided = {rid for o in outcomes if o.kind == "batch" for rid in o.detail["rollout_ids"]}
            decided |= {o.rollout_id for o in outcomes if o.kind in ("rollout_dropped", "dead_letter")}
            return rollouts <= decided

        _wait("every rollout graded and decided by the ETL", drained, services, ("grader", "etl"), deadline - time.monotonic())
        for name in ("grader", "etl"):
            if (code := services.stop(name)) != 0:
                raise RuntimeError(f"rollouts {name} exited {code}:\n{services.log(name)[-3000:]}")
    finally:
        services.kill_all()
    return read_records(workdir, time.perf_counter() - started)


def read_records(workdir: Path, seconds: float = 0.0) -> LoopRecords:
    """What a finished loop in `workdir` left: its topics (the prefix its configs name) and the sampler's log.
    Public so a test can check the loop `ember demo` ran, rather than running another."""
    topics = Topics(yaml.safe_load((workdir / "sample.yaml").read_text())["kafka"]["topic_prefix"])
    return LoopRecords(
        announced=_read_all(topics.policy_versions, PolicyVersion.decode),
        rollouts=_read_all(topics.rollouts, decode),
        rewards=_read_all(topics.rewards, decode),
        outcomes=_read_all(topics.outcomes, Outcome.decode),
        loaded=[(int(v), d) for v, d in _LOADED.findall((workdir / "sampler.log").read_text(errors="replace"))],
        versions_dir=workdir / "rl" / "versions",
        seconds=seconds,
    )


def run(console: Console, workdir: Path) -> list[tuple[str, str]]:
    """The demo's rows: the loop on a fresh prefix, three trainer steps, summarised in one line."""
    workdir.mkdir(parents=True, exist_ok=True)
    prefix = f"ember-demo-loop-{time.strftime('%Y%m%d%H%M%S')}"
    with console.status("loop: training the policy's byte-level BPE tokenizer..."):
        tokenizer = train_tokenizer(workdir / "tokenizer.json")
    with console.status("loop: midtrain rl (2 ranks) <- etl <- grade <- sample (transformers), versions going round..."):
        records = run_loop(workdir, prefix, tokenizer)
    summary = records.summary()
    console.print(f"loop: {summary}", soft_wrap=True)  # whole, for a reader grepping the log; the table wraps it
    return [("loop", summary)]
