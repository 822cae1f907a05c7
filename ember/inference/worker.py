"""The inference worker's loop: follow the announced policy, generate G completions per task, publish Rollouts.

Weights change only where it is safe: between generation batches, and (with `swap_every_tokens`) between
decode steps of a batch, where the KV cache is rebuilt under the new weights. A new version is used only after
`read_export` verified every file against the announced sha256; one that fails is refused with a one-line
reason and counted, and sampling goes on with the weights it has.

Each rollout carries the span of versions that produced it: `policy_version` (its first sampled token) and
`policy_version_end` (its last). That is prime-rl's per-episode stamp rather than AReaL's version per token:
the trainer's importance weights (TIS/MIS) already correct per token against the sampler's log-probs, which
were recorded under the weights that drew each token, so a per-token version adds wire bytes and buys only a
finer staleness filter; the span bounds it (the ETL judges staleness by the span's start, the oldest weights).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
import numpy as np
import torch
from kafka import KafkaConsumer, TopicPartition

from ember.inference.config import SamplerConfig
from ember.inference.backend import Backend, Completion, Sampling
from ember.inference.generate import generate
from ember.inference.policy import LoadedPolicy, load_policy
from ember.inference.tasks import Task
from ember.midtrain.export_format import PolicyConfig, PolicyFetchError
from ember.rollouts.records import PolicyVersion
from ember.rollouts.transport import RolloutWriter, consumer_config
from ember.schemas import Rollout, Turn
from ember.tokenize.tokenizers import Tokenizer

log = logging.getLogger(__name__)

_VERSION_POLL_S = 0.2
"""How often a sampler that waits for a newer version (`max_groups_per_version`) looks at the policy-versions topic."""


class NoPolicy(RuntimeError):
    """No usable policy: none announced with weights in time, or the one named is not the announced export."""


class PolicyFollower:
    """Reads `<prefix>.policy-versions` from the start; `newest` is the highest version announced with weights
    that is newer than the one in use. Records that do not decode, or carry no weights, are skipped and counted."""

    def __init__(self, config: SamplerConfig):
        topic = f"{config.kafka.topic_prefix}.policy-versions"
        self.consumer = KafkaConsumer(**consumer_config(config.kafka.security, bootstrap_servers=config.kafka.bootstrap, group_id=None))
        self.tp = TopicPartition(topic, 0)
        self.consumer.assign([self.tp])
        self.consumer.seek_to_beginning(self.tp)
        self.pending: PolicyVersion | None = None
        self.skipped = 0

    def poll(self, timeout_ms: int = 0) -> PolicyVersion | None:
        """The highest announced version with weights seen so far and not yet taken (`take`)."""
        for messages in self.consumer.poll(timeout_ms=timeout_ms).values():
            for message in messages:
                try:
                    announced = PolicyVersion.decode(message.value)
                except ValueError as exc:
                    self.skipped += 1
                    log.warning("%s@%d: skipped (%s)", self.tp.topic, message.offset, exc)
                    continue
                if not announced.carries_weights:
                    self.skipped += 1
                    continue
                if self.pending is None or announced.policy_version > self.pending.policy_version:
                    self.pending = announced
        return self.pending

    def wait_first(self, timeout_s: float) -> PolicyVersion:
        deadline = time.monotonic() + timeout_s
        while (found := self.poll(timeout_ms=200)) is None:
            if time.monotonic() > deadline:
                raise NoPolicy(f"{self.tp.topic}: no policy version with weights announced within {timeout_s:.0f}s "
                               "(has the trainer exported one? `midtrain rl` announces each export)")
        return found

    def close(self) -> None:
        self.consumer.close()


@dataclass
class SampleStats:
    rollouts: int = 0
    groups: int = 0
    tokens: int = 0
    generated_tokens: int = 0
    generate_s: float = 0.0
    versions: list[int] = field(default_factory=list)  # every version loaded, in order
    sha256s: list[str] = field(default_factory=list)  # each loaded version's verified export.json digest, in order
    waited_s: float = 0.0  # time spent waiting for a newer version (max_groups_per_version)
    refused: list[str] = field(default_factory=list)  # one line per announced export that failed verification
    rejected_tasks: list[str] = field(default_factory=list)
    failed_groups: list[str] = field(default_factory=list)  # one line per group dropped: a completion could not be had


class Sampler:
    """The transformers backend: holds the policy in use and swaps it for a newer announced one when asked
    (`refresh`): before every batch, and every `swap_every_tokens` decode steps within one."""

    def __init__(self, config: SamplerConfig, follower: PolicyFollower | None, stats: SampleStats):
        self.follower, self.stats = follower, stats
        self.generator = torch.Generator().manual_seed(config.generation.seed)
        self.swap_every = config.generation.swap_every_tokens
        if follower is None:
            self.policy = self._load(config.policy.uri, config.policy.sha256, config.policy.version)
        else:
            first = follower.wait_first(config.policy.wait_s)
            self.policy = self._load(first.weights_uri, first.weights_sha256, first.policy_version)
        self.stats.versions.append(self.policy.version)
        self.stats.sha256s.append(self.policy.sha256)

    @staticmethod
    def _load(uri: str, sha256: str, version: int) -> LoadedPolicy:
        try:
            return load_policy(uri, sha256, version)
        except PolicyFetchError as exc:
            raise NoPolicy(f"policy version {version}: {exc}") from None

    def generate(self, prompts: list[list[int]], texts: list[str], sampling: Sampling) -> list[Completion | str]:
        self.refresh()
        return list(generate(self.policy, prompts, sampling, self.generator,
                             refresh=self.refresh if self.swap_every else None, refresh_every=self.swap_every))

    def follow(self) -> int:
        self.refresh()
        return self.policy.version

    def refresh(self) -> LoadedPolicy | None:
        """The newer announced policy, verified and loaded, now in use; None when there is none (or it was refused)."""
        if self.follower is None:
            return None
        announced = self.follower.poll()
        if announced is None or announced.policy_version <= self.policy.version:
            return None
        self.follower.pending = None
        try:
            policy = load_policy(announced.weights_uri, announced.weights_sha256, announced.policy_version, self.policy)
        except PolicyFetchError as exc:
            line = f"policy version {announced.policy_version} refused, still sampling version {self.policy.version}: {exc}"
            log.error("%s", line)
            self.stats.refused.append(line)
            return None
        self.policy = policy
        self.stats.versions.append(policy.version)
        self.stats.sha256s.append(policy.sha256)
        log.info("swapped to policy version %d (%s)", policy.version, policy.sha256[:12])
        return policy


def group_id(config: SamplerConfig, epoch: int, task: Task) -> str:
    return f"{config.run_id}-e{epoch}-{task.prompt_id}"


def to_rollouts(config: SamplerConfig, epoch: int, tasks: list[Task], completions: list[Completion]) -> list[Rollout]:
    now = time.time_ns() // 1000
    group = config.generation.group_size
    rollouts = []
    for i, done in enumerate(completions):
        task = tasks[i // group]
        gid = group_id(config, epoch, task)
        n = len(done.tokens)
        rollouts.append(Rollout(
            rollout_id=f"{gid}-{i % group}", group_id=gid, prompt_id=task.prompt_id, policy_version=done.first_version,
            sampler=config.sampler, region=config.region, created_at_us=now, tokens=done.tokens,
            loss_mask=(np.arange(n) >= done.prompt_tokens).astype(np.uint8), sampler_logprobs=done.logprobs,
            turns=[Turn("user", 0, done.prompt_tokens), Turn("assistant", done.prompt_tokens, n)],
            routed_experts=done.experts, finish_reason=done.finish_reason, truncated=done.finish_reason == "length",
            prompt_tokens=done.prompt_tokens, policy_version_end=done.last_version,
        ).validate())
    return rollouts


def prompt_ids(config: SamplerConfig, tokenizer: Tokenizer, tasks: list[Task], policy: PolicyConfig | None,
               rejects: list[str]) -> list[tuple[Task, list[int]]]:
    """Each task's prompt as token ids (the tokenizer's BOS first, if it has one); a prompt that leaves no room for
    max_new_tokens within the policy's positions (when the policy is known here), or exceeds max_prompt_tokens, is
    rejected into `rejects`."""
    limit = config.generation.max_prompt_tokens
    if policy is not None:
        limit = min(policy.max_position_embeddings - config.generation.max_new_tokens, limit)
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    kept = []
    for task, ids in zip(tasks, tokenizer.encode_ordinary([t.prompt for t in tasks])):
        if not 0 < len(bos + ids) <= limit:
            rejects.append(f"{config.tasks}: task {task.prompt_id}: {len(bos + ids)} prompt tokens, at most {limit} fit "
                           f"(max_prompt_tokens, and the policy's {policy.max_position_embeddings} positions less max_new_tokens)")
            continue
        kept.append((task, bos + ids))
    return kept


def run(config: SamplerConfig, prompts: list[tuple[Task, list[int]]], sampling: Sampling, writer: RolloutWriter,
        backend: Backend, stats: SampleStats, stop: threading.Event | None = None) -> SampleStats:
    """Every (task, prompt ids) `epochs` times, `batch_size // group_size` tasks per generation batch; `stop` ends
    the run between batches (each batch's rollouts are acked first), also while it waits for a newer version. A group
    with a completion the backend could not deliver is dropped whole (the ETL needs whole groups) and named in
    `stats.failed_groups`."""
    g = config.generation
    per_batch = g.batch_size // g.group_size
    stop = stop or threading.Event()
    per_version: dict[int, int] = {}  # groups started under each version
    for epoch in range(config.epochs):
        for start in range(0, len(prompts), per_batch):
            if stop.is_set():
                return stats
            chunk = prompts[start : start + per_batch]
            version = backend.follow()
            if version is not None:
                version = _within_version_budget(config, backend, version, per_version, stats, stop)
                if version is None:
                    return stats
                per_version[version] = per_version.get(version, 0) + len(chunk)
            began = time.perf_counter()
            completions = backend.generate([ids for _, ids in chunk for _ in range(g.group_size)],
                                           [task.prompt for task, _ in chunk for _ in range(g.group_size)], sampling)
            stats.generate_s += time.perf_counter() - began
            kept_tasks, kept = [], []
            for i, (task, _) in enumerate(chunk):
                group = completions[i * g.group_size : (i + 1) * g.group_size]
                failures = [c for c in group if isinstance(c, str)]
                if failures:
                    stats.failed_groups.append(f"group {group_id(config, epoch, task)}: dropped, {len(failures)} of "
                                               f"{g.group_size} completions failed; first: {failures[0]}")
                    log.warning("%s", stats.failed_groups[-1])
                    continue
                kept_tasks.append(task)
                kept += group
            for rollout in to_rollouts(config, epoch, kept_tasks, kept):
                writer.write(rollout)
                stats.rollouts += 1
                stats.tokens += rollout.num_tokens
                stats.generated_tokens += rollout.num_tokens - rollout.prompt_tokens
            writer.flush()  # acked before the next batch: a crash loses at most the batch in flight
            stats.groups += len(kept_tasks)
    return stats


def _within_version_budget(config: SamplerConfig, backend: Backend, version: int, per_version: dict[int, int],
                           stats: SampleStats, stop: threading.Event) -> int | None:
    """Waits while `version` (the one in use) has its `max_groups_per_version` groups, until the backend takes up
    a newer one (returned) or `stop` is set (None): the trainer's pace bounds how many groups one version samples."""
    limit = config.policy.max_groups_per_version
    began = time.perf_counter()
    while limit is not None and per_version.get(version, 0) >= limit:
        if stop.wait(_VERSION_POLL_S):
            return None
        version = backend.follow()
    stats.waited_s += time.perf_counter() - began
    return version
