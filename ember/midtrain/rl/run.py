"""`midtrain rl CONFIG` (`python -m ember.midtrain.rl.run`): the RL trainer wired to Kafka.

Batches come from `<prefix>.train-batches` through `RolloutBatchReader` (read_committed only, on rank
0; with several ranks each decodes only its share of a batch); after each step the reader commits.
The ETL's batches are by reference: every rank fetches its own share's rollouts from the rollouts
topic (`RolloutFetcher`), so no rank downloads the others' routed experts.
Policy versions are announced on the policy-versions topic once their checkpoint is exported (URI +
sha256 in the record, see `rl_trainer.run_rl` for which versions).
Each batch carries the reader position it leaves behind, the trainer checkpoints it, and a restart
hands it back to the reader, so the run resumes on the batch after the checkpoint even if it had
stepped (and committed) further before it crashed. SIGTERM/SIGUSR1 finish the step, checkpoint and
exit 0. The training itself is `ember.midtrain.rl.trainer`, which never sees Kafka.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Iterator

from ember import storage
from ember.configs import MidtrainConfigError
from ember.midtrain import runtime
from ember.midtrain.launch import check_runnable
from ember.midtrain.config import RLConfig, load_rl_config
from ember.midtrain.rl.ranks import BatchMessage
from ember.midtrain.runtime import StopRequest
from ember.midtrain.slurm import LaunchError
from ember.rollouts.records import PolicyVersion
from ember.rollouts.security import KafkaSecurity

# How often the idle trainer wakes up to notice a stop signal or its idle timeout.
_POLL_S = 1.0


class PolicyVersionPublisher:
    """Announces policy versions, in the encoding the ETL's PolicyWatcher reads; waits for the broker's ack."""

    def __init__(self, prefix: str, bootstrap: str, security: KafkaSecurity):
        from kafka import KafkaProducer

        from ember.rollouts.admin import ensure_topics
        from ember.rollouts.topics import Topics
        from ember.rollouts.transport import producer_config

        from ember.rollouts.simulate import latest_policy_version

        spec = Topics(prefix).specs()["policy_versions"]
        ensure_topics(bootstrap, [spec], security)
        self.topic = spec.name
        self.producer = KafkaProducer(**producer_config(security, bootstrap_servers=bootstrap))
        self.latest = latest_policy_version(self.topic, security, bootstrap)
        self.warned = False

    def publish(self, version: PolicyVersion) -> None:
        """Announce `version`; one that goes backwards is announced (a restart re-announces, the topic is a log) but
        said once: the ETL measures staleness against the highest version on the topic, not this run's."""
        if self.latest is not None and version.policy_version < self.latest and not self.warned:
            self.warned = True
            print(
                f"[rl] warning: announcing policy version {version.policy_version}, but {self.topic} already holds "
                f"version {self.latest} (from `ember rollouts simulate`, `publish-policy` or another run): the ETL keeps "
                f"judging staleness against {self.latest}, so this run's rollouts look stale; set "
                f"rl.initial_policy_version to {self.latest + 1} or more, or use a topic prefix of this run's own",
                flush=True,
            )
        self.producer.send(self.topic, key=b"policy", value=version.encode()).get(timeout=30)
        self.latest = max(version.policy_version, self.latest if self.latest is not None else version.policy_version)

    def close(self) -> None:
        self.producer.close()


class KafkaTransport:
    """The trainer's Kafka side, on rank 0 only: batch records in from the train-batches topic (every
    rank decodes its own share, see `ember.midtrain.rl.ranks`), policy versions out."""

    def __init__(self, config: RLConfig, position: dict[str, Any] | None):
        from ember.rollouts.reader import RolloutBatchReader
        from ember.rollouts.config import kafka_bootstrap

        bootstrap = config.rollouts.bootstrap or kafka_bootstrap()
        self.idle_timeout_s = config.rollouts.idle_timeout_s
        security = config.rollouts.security
        self.publisher = PolicyVersionPublisher(config.rollouts.topic_prefix, bootstrap, security)
        self.reader = RolloutBatchReader(
            config.rollouts.batches_topic, group_id=config.rollouts.group_id, state=position, bootstrap=bootstrap,
            idle_timeout_s=_POLL_S, security=security,
        )

    def messages(self) -> Iterator[BatchMessage | None]:
        """Batch records as they become readable, None after each poll interval without one; ends after
        `idle_timeout_s` without a batch (stop requests are the ranks' decision, `RankBatches`)."""
        idle_since = time.monotonic()
        while True:
            raw = self.reader.next_message()
            if raw is None:
                idle = self.idle_timeout_s
                if idle is not None and time.monotonic() - idle_since > idle:
                    print(f"[rl] no batch for {idle:.0f}s: stopping", flush=True)
                    return
                yield None
                continue
            yield BatchMessage(raw.value, offset=raw.offset, position=raw.position)
            idle_since = time.monotonic()

    def step_done(self) -> None:
        """The step on the last batch finished: commit the read position."""
        self.reader.commit()

    def announce(self, version: PolicyVersion) -> None:
        """A policy version whose weights are exported (`run_rl` calls this only after the export is durable)."""
        self.publisher.publish(version)

    def close(self) -> None:
        self.reader.close()
        self.publisher.close()


def run(config: RLConfig, stop: StopRequest) -> int:
    from ember.midtrain.rl.trainer import RLTrainer, run_rl  # megatron: after main's checks and warning filters

    from ember.rollouts.config import kafka_bootstrap
    from ember.rollouts.reader import RolloutFetcher

    trainer = RLTrainer(config)
    transport = KafkaTransport(config, trainer.data_position) if trainer.rank == 0 else None
    fetcher = RolloutFetcher(bootstrap=config.rollouts.bootstrap or kafka_bootstrap(), security=config.rollouts.security)
    try:
        batches = trainer.rank_batches(transport.messages() if transport else None, stop, fetcher.rollouts)
        run_rl(trainer, batches, transport, stop)
    finally:
        fetcher.close()
        if transport:
            transport.close()
    trainer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m ember.midtrain.rl.run CONFIG [--threads N]`; the config is checked before
    megatron loads (a mistake is one line on stderr and exit 2)."""
    stop = StopRequest()
    stop.install()
    runtime.silence_known_warnings()
    args = runtime.parse_entry_args("python -m ember.midtrain.rl.run", sys.argv[1:] if argv is None else argv)
    try:
        config = runtime.with_threads(load_rl_config(args.config), args.threads)
        check_runnable(config, int(os.environ.get("WORLD_SIZE", "1")))
        if config.rl.publish_uri is not None:  # a typo'd bucket or missing credentials, before megatron loads
            storage.preflight(config.rl.publish_uri, write=True)
    except (MidtrainConfigError, LaunchError, storage.StorageError) as exc:
        print(f"[rl] {exc}", file=sys.stderr, flush=True)
        return 2
    return run(config, stop)


if __name__ == "__main__":
    sys.exit(main())
