"""Real rollouts for the grading service: HumanEval as `ember corpus benchmarks fetch` writes it, completions
tokenized with a real tokenizer, `ember rollouts grade` as a killable child process, and an independent
read_committed count of what it published."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import yaml
from typer.testing import CliRunner

from ember.pipelines.cli import app as corpus_app
from ember.rollouts.acls import role_bindings
from ember.rollouts.admin import apply_acls, ensure_topics
from ember.rollouts.grading.base import Task
from ember.rollouts.topics import Topics
from ember.schemas import Rollout, Turn, decode_reward
from ember.tokenize.config import TokenizerConfig
from ember.tokenize.tokenizers import load_tokenizer
from tests.rollouts.etl_support import Deployment, ServiceProcess, read_topic

TOKENIZER = load_tokenizer(TokenizerConfig(name="cl100k_base"))


def fetch_humaneval(directory: Path) -> Path:
    """What `ember corpus benchmarks fetch humaneval --out DIR` writes, written by that very command."""
    result = CliRunner().invoke(corpus_app, ["benchmarks", "fetch", "humaneval", "--out", str(directory)])
    assert result.exit_code == 0, result.output
    return directory / "humaneval.jsonl"


def fenced(code: str) -> str:
    return f"Here is the solution:\n\n```python\n{code}```\n"


def code_rollout(task: Task | str, completion: str, group: str, index: int) -> Rollout:
    """A rollout as an inference worker writes it: the prompt's tokens (not trained), then the completion's."""
    prompt_id = task if isinstance(task, str) else task.prompt_id
    prompt_text = "" if isinstance(task, str) else task.prompt
    prompt, answer = TOKENIZER.encode_ordinary([prompt_text or "?", completion])
    tokens = np.array(prompt + answer, dtype=np.uint32)
    mask = np.array([0] * len(prompt) + [1] * len(answer), dtype=np.uint8)
    return Rollout(
        rollout_id=f"{group}-{index}", group_id=group, prompt_id=prompt_id, policy_version=0, sampler="test",
        region="here", created_at_us=time.time_ns() // 1000, tokens=tokens, loss_mask=mask,
        sampler_logprobs=np.zeros(len(tokens), np.float32),
        turns=[Turn("user", 0, len(prompt)), Turn("assistant", len(prompt), len(tokens))], prompt_tokens=len(prompt),
    )


GRADERS = [
    {"name": "exact", "version": "1", "kind": "rule", "settings": {"match": "exact"}},
    {"name": "contains", "version": "2", "kind": "rule", "settings": {"match": "contains"}},
]


def grader_settings(prefix: str, tasks: Path, deployment: Deployment, **sections) -> dict:
    settings = {
        "kafka": {
            "topic_prefix": prefix, "group_id": f"{prefix}-grader", "session_timeout_ms": 6000,
            "heartbeat_interval_ms": 1000, "transaction_timeout_ms": 5000, "max_poll_records": 20,
            **deployment.kafka_section("grader"),
        },
        "tasks": {"path": str(tasks)},
        "tokenizer": {"name": "cl100k_base"},
        "graders": GRADERS,
        "metrics": {"status_interval_s": 1},
    }
    for name, values in sections.items():
        settings[name] = values if isinstance(values, list) else {**settings.get(name, {}), **values}
    return settings


def prepare(deployment: Deployment, prefix: str, partitions: int = 3) -> Topics:
    """The operator's part: topics made (and on the secured broker the ACLs applied) by the admin."""
    topics = Topics(prefix)
    ensure_topics(deployment.bootstrap, list(topics.specs(partitions).values()), deployment.security("admin"))
    if deployment.roles:
        apply_acls(deployment.bootstrap, role_bindings(prefix), deployment.security("admin"))
    return topics


class GraderProcess(ServiceProcess):
    """`ember rollouts grade CONFIG` as a child process."""

    def __init__(self, config: Path, instance: str, log_dir: Path, *args: str, fault: str | None = None):
        super().__init__("grade", config, instance, log_dir, *args, fault=fault)


def write_config(path: Path, settings: dict) -> Path:
    path.write_text(yaml.safe_dump(settings))
    return path


def reward_counts(topics: Topics, deployment: Deployment) -> tuple[Counter, list]:
    """(rollout_id, grader) -> rewards committed, read read_committed from the start by a consumer of its own;
    and the decoded rewards."""
    rewards = [(r.partition, decode_reward(r.value)) for r in read_topic(topics.rewards, deployment=deployment)]
    return Counter((r.rollout_id, r.grader) for _p, r in rewards), rewards


def wait_for_rewards(topics: Topics, deployment: Deployment, expected: int, timeout_s: float, alive=lambda: True) -> Counter:
    deadline = time.monotonic() + timeout_s
    while True:
        counts, _ = reward_counts(topics, deployment)
        if sum(counts.values()) >= expected:
            return counts
        assert alive(), "a grader exited early"
        assert time.monotonic() < deadline, f"{sum(counts.values())} of {expected} rewards within {timeout_s}s"
        time.sleep(0.5)
