"""`ember rollouts sample CONFIG`: registered on the rollouts command group by `ember.cli` (rollouts sits below
midtrain, whose export reader the worker needs, so the command lives above both)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.markup import escape

from ember import terminal

console = terminal.console()


def _fail(message: str, code: int) -> typer.Exit:
    console.print(f"[red]{escape(message)}[/red]", soft_wrap=True)
    return typer.Exit(code)


def sample(config_path: Path = typer.Argument(..., metavar="CONFIG", help="Sampler YAML (example: ember/inference/sample.example.yaml).")) -> None:
    """Generate G completions per task (the announced policy in transformers, or an OpenAI-compatible server) and publish them as Rollouts."""
    from ember.configs import ConfigError
    from ember.inference.config import load_config

    try:
        config = load_config(config_path)  # before torch, transformers and Kafka are imported: a typo answers at once
    except ConfigError as exc:
        raise _fail(str(exc), 2) from None
    from kafka.errors import KafkaError

    from ember.inference import worker
    from ember.inference.backend import Sampling
    from ember.inference.http_backend import HTTPBackendError, OpenAIBackend
    from ember.inference.tasks import read_tasks
    from ember.rollouts.transport import BrokerNotReady, RolloutWriter, WriteFailed
    from ember.tokenize.tokenizers import TokenizerLoadError, load_tokenizer

    try:
        tokenizer = load_tokenizer(config.tokenizer)
    except TokenizerLoadError as exc:
        raise _fail(str(exc), 2) from None
    try:
        task_set = read_tasks(config.tasks)
    except OSError as exc:
        raise _fail(f"{config.tasks}: cannot read the task set ({exc.strerror or exc})", 2) from None
    stats = worker.SampleStats(rejected_tasks=list(task_set.rejects))
    follower = None
    try:
        if config.http is not None:  # backend: openai_http
            backend, policy = OpenAIBackend(config.http, tokenizer.identity.vocab_size), None
        else:
            follower = worker.PolicyFollower(config) if config.policy.follow else None
            backend = worker.Sampler(config, follower, stats)
            policy = backend.policy.config
            if tokenizer.identity.vocab_size != policy.ember.tokenizer_vocab_size:
                raise _fail(f"tokenizer {tokenizer.identity.name} has {tokenizer.identity.vocab_size} ids, policy version "
                            f"{backend.policy.version} was trained on {policy.ember.tokenizer} with {policy.ember.tokenizer_vocab_size}", 2)
        prompts = worker.prompt_ids(config, tokenizer, task_set.tasks, policy, stats.rejected_tasks)
        if not prompts:
            raise _fail(f"{config.tasks}: no usable task ({len(stats.rejected_tasks)} rejected; first: "
                        f"{stats.rejected_tasks[0] if stats.rejected_tasks else 'the file is empty'})", 2)
        g = config.generation
        sampling = Sampling(g.temperature, g.top_p, g.max_new_tokens, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, seed=g.seed)
        with (RolloutWriter(config.kafka.topic_prefix, security=config.kafka.security, bootstrap_servers=config.kafka.bootstrap) as writer,
              _stop_on_signals() as stop):
            worker.run(config, prompts, sampling, writer, backend, stats, stop)
    except (worker.NoPolicy, HTTPBackendError) as exc:
        raise _fail(str(exc), 2) from None
    except (BrokerNotReady, WriteFailed, KafkaError) as exc:
        raise _fail(f"Kafka at {config.kafka.bootstrap}: {exc}", 1) from None
    finally:
        if follower is not None:
            follower.close()
    if stats.failed_groups and not stats.rollouts:
        raise _fail(f"no rollout published: all {len(stats.failed_groups)} groups failed; first: {stats.failed_groups[0]}", 1)
    versions = (f"{config.http.policy_version} (stamped: the server holds the weights), no routed experts" if config.http
                else ", ".join(map(str, stats.versions)))
    for line in stats.rejected_tasks[:5] + stats.refused + stats.failed_groups[:5]:
        console.print(f"[yellow]{escape(line)}[/yellow]", soft_wrap=True)
    rate = stats.generated_tokens / stats.generate_s if stats.generate_s else 0.0
    console.print(
        f"published {stats.rollouts} rollouts ({stats.groups} groups, {stats.tokens} tokens, {stats.generated_tokens} "
        f"generated at {rate:.0f} tokens/s) to {config.kafka.topic_prefix}.rollouts; policy versions "
        f"{versions}; {len(stats.rejected_tasks)} tasks rejected, {len(stats.refused)} versions refused, "
        f"{len(stats.failed_groups)} groups failed",
        soft_wrap=True,
    )
    if config.policy.max_groups_per_version is not None:
        console.print(f"waited {stats.waited_s:.1f}s for newer versions (max_groups_per_version "
                      f"{config.policy.max_groups_per_version})", soft_wrap=True)
    for version, digest in zip(stats.versions, stats.sha256s):
        console.print(f"loaded policy version {version}: export.json sha256 {digest} (verified)", soft_wrap=True)


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """An event SIGTERM or SIGINT sets, for the run only (the previous handlers come back after it): the run ends
    after the batch in flight is acked (or at once while it waits for a version), leaving no half-published group."""
    stop = threading.Event()
    previous = {number: signal.signal(number, lambda *_: stop.set()) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for number, action in previous.items():
            signal.signal(number, action)
