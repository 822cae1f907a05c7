"""RL test helpers: tiny policy configs, in-memory batches, and the megatron-side work that must run
in a subprocess.

`python -m tests.midtrain.rl_support toy CONFIG ITERATIONS OUT.json` runs the verifiable-task loop:
sample from the trainer's own policy (ember.demo.sampler), reward, publish, ETL, RL steps.
`python -m tests.midtrain.rl_support sample CONFIG GROUPS DIR` saves the initial policy and samples it with the
reference sampler (router weights perturbed), writing DIR/batches (one encoded batch per group, as the ETL would
publish it) and DIR/records (the same samples as encoded rollouts and rewards, `NNNN.rollout`, `NNNN.reward`, for a
test to publish as the fleet's principals); the tests share one such sample (conftest's `sampled_policy`).
`... memory CONFIG DIR OUT.json` runs `run_rl` on a directory of batches, no broker (under torchrun: on every rank). `... score CONFIG IN.json OUT.json` scores IN's {"sequences": [...]} with the trainer's
model at its latest checkpoint (megatron forward, as the trainer computes log-probs).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import yaml

from ember.schemas import Reward, Rollout, TrainBatch, decode_train_batch, encode, encode_train_batch

# torch and ember.demo.sampler (megatron-core) are imported inside the functions: every trainer process
# starts megatron's checkpoint-writer helper by multiprocessing spawn, which imports the `__main__` module
# again, so this module's own imports are paid once more by each of its subprocesses.


def rl_config(path: Path, run_dir: Path, prefix: str, *, replay: str = "replay", steps: int = 100, **rl) -> Path:
    from ember.demo.sampler import toy_policy_config

    path.write_text(yaml.safe_dump(toy_policy_config(run_dir, prefix, replay=replay, steps=steps, **rl), sort_keys=False))
    return path


def trainer_config(root: Path, name: str, prefix: str, init: Path, **rl) -> Path:
    """root/NAME.yaml: the tiny policy trained in root/NAME (consumer group `<prefix>-NAME`), starting from `init`."""
    path = rl_config(root / f"{name}.yaml", root / name, prefix, **rl)
    data = yaml.safe_load(path.read_text())
    data["init_checkpoint"] = str(init)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def etl_config(prefix: str, *, token_budget: int):
    from ember.rollouts.config import parse_config
    from tests.rollouts.etl_support import etl_settings

    return parse_config(
        etl_settings(
            prefix,
            partitions=1,
            groups={"size": 4, "quorum": 4, "timeout_s": 30},
            filters={"max_tokens": token_budget},
            batches={"token_budget": token_budget, "min_fill": 0.9, "max_wait_s": 0.5},
            advantages={"drop_zero_variance": False},
        )
    )


def train_batch(rollouts: list[Rollout], rewards: list[Reward], step: int) -> TrainBatch:
    """One group's rollouts packed as the ETL would, advantages = reward - group mean on policy tokens."""
    scores = np.array([r.score for r in rewards], dtype=np.float32)
    advantages = scores - scores.mean()
    cu = np.zeros(len(rollouts) + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(r.tokens) for r in rollouts])
    return TrainBatch(
        batch_id=f"memory-{step}",
        step=step,
        tokens=np.concatenate([r.tokens for r in rollouts]),
        loss_mask=np.concatenate([r.loss_mask for r in rollouts]),
        advantages=np.concatenate([np.where(r.loss_mask == 1, a, 0).astype(np.float32) for r, a in zip(rollouts, advantages)]),
        sampler_logprobs=np.concatenate([r.sampler_logprobs for r in rollouts]),
        cu_seqlens=cu,
        policy_versions=np.array([r.policy_version for r in rollouts], dtype=np.int64),
        rollout_ids=[r.rollout_id for r in rollouts],
        routed_experts=np.concatenate([r.routed_experts for r in rollouts]),
    ).validate()


class BatchFeed:
    """A fresh `<prefix>.train-batches` topic that a test fills by hand with encoded batches, so a trainer
    can never run ahead of the point where the test stops, kills or preempts it."""

    def __init__(self, prefix: str):
        from kafka import KafkaProducer

        from ember.rollouts.admin import ensure_topics
        from ember.rollouts.config import kafka_bootstrap
        from ember.rollouts.security import KafkaSecurity
        from ember.rollouts.topics import Topics

        spec = Topics(prefix).specs()["train_batches"]
        ensure_topics(kafka_bootstrap(), [spec], KafkaSecurity())
        self.topic = spec.name
        self.producer = KafkaProducer(bootstrap_servers=kafka_bootstrap())

    def send(self, values: list[bytes]) -> None:
        for value in values:
            self.producer.send(self.topic, value=value).get(timeout=30)

    def close(self) -> None:
        self.producer.close()


def sample_main(config_path: str, groups: int, out_dir: str) -> None:
    """Saves the initial policy (step 0 in the config's run_dir), samples `groups` groups of 4 with perturbed
    routers and writes them as batches (out_dir/batches/NNNN.batch, one per group) and as records
    (out_dir/records/NNNN.rollout and NNNN.reward)."""
    import torch

    from ember.demo.sampler import make_rollouts, perturb_routers, toy_prompts
    from ember.midtrain.config import load_rl_config
    from ember.midtrain.rl.trainer import RLTrainer

    trainer = RLTrainer(load_rl_config(config_path))
    trainer.save()
    perturb_routers(trainer.model, 0.01, seed=5)
    generator = torch.Generator().manual_seed(3)
    rollouts, rewards = make_rollouts(
        trainer.model, toy_prompts(groups, 4, generator), 8, generator, tag="sampled", version=0, group_size=4
    )
    trainer.close()
    batches, records = Path(out_dir) / "batches", Path(out_dir) / "records"
    batches.mkdir(parents=True)
    records.mkdir(parents=True)
    for g in range(groups):
        batch = train_batch(rollouts[g * 4 : g * 4 + 4], rewards[g * 4 : g * 4 + 4], g)
        (batches / f"{g:04d}.batch").write_bytes(encode_train_batch(batch))
    for i, (rollout, reward) in enumerate(zip(rollouts, rewards)):
        (records / f"{i:04d}.rollout").write_bytes(encode(rollout))
        (records / f"{i:04d}.reward").write_bytes(encode(reward))


class Channel:
    """`run_rl`'s PolicyChannel in memory: counts steps, keeps the announcements."""

    def __init__(self) -> None:
        self.steps = 0
        self.announced: list = []

    def step_done(self) -> None:
        self.steps += 1

    def announce(self, version) -> None:
        self.announced.append(version)


def memory_main(config_path: str, batch_dir: str, out: str) -> None:
    """`run_rl` on the encoded batches in `batch_dir`, no broker, on one rank or each rank of a torchrun
    group (rank 0 reads the files, every rank decodes its share); rank 0 writes the versions it published."""
    from ember.midtrain.config import load_rl_config
    from ember.midtrain.rl.ranks import BatchMessage
    from ember.midtrain.rl.trainer import RLTrainer, run_rl
    from ember.midtrain.runtime import StopRequest

    trainer = RLTrainer(load_rl_config(config_path))
    paths = sorted(Path(batch_dir).glob("*.batch"))
    lead = trainer.rank == 0
    stop = StopRequest()
    channel = Channel() if lead else None
    messages = [BatchMessage(p.read_bytes()) for p in paths] if lead else None
    run_rl(trainer, trainer.rank_batches(messages, stop), channel, stop)
    trainer.close()
    if channel is not None:
        ids = [decode_train_batch(p.read_bytes()).batch_id for p in paths]
        published = [v.policy_version for v in channel.announced]
        Path(out).write_text(json.dumps({"published": published, "steps": channel.steps, "batch_ids": ids}))


def score_main(config_path: str, source: str, out: str) -> None:
    from ember.demo.sampler import score
    from ember.midtrain.config import load_rl_config
    from ember.midtrain.rl.trainer import RLTrainer

    trainer = RLTrainer(load_rl_config(config_path))
    sequences = [np.array(s, dtype=np.int64) for s in json.loads(Path(source).read_text())["sequences"]]
    logprobs = [logp.tolist() for logp, _ in score(trainer.model, sequences)]
    Path(out).write_text(json.dumps({"step": trainer.state.step, "logprobs": logprobs}))
    trainer.close()


def toy_main(config_path: str, iterations: int, out: str) -> None:
    """On-policy loop through the real data path; writes the mean reward of every iteration."""
    import torch

    from ember.demo.sampler import make_rollouts, publish, toy_prompts
    from ember.midtrain.rl.batch import rl_batch
    from ember.midtrain.config import load_rl_config
    from ember.midtrain.rl.trainer import RLTrainer
    from ember.rollouts.etl import EtlService, prepare_topics
    from ember.rollouts.reader import RolloutBatchReader

    config = load_rl_config(config_path)
    prefix = config.rollouts.topic_prefix
    etl = etl_config(prefix, token_budget=128)
    prepare_topics(etl, create=True)
    trainer = RLTrainer(config)
    stop = threading.Event()
    service = threading.Thread(target=EtlService(etl, "toy").run, kwargs={"stop": stop}, daemon=True)
    service.start()
    generator = torch.Generator().manual_seed(11)
    means, steps = [], []
    reader = RolloutBatchReader(config.rollouts.batches_topic, group_id=config.rollouts.group_id, idle_timeout_s=60)
    try:
        for it in range(iterations):
            rollouts, rewards = make_rollouts(
                trainer.model, toy_prompts(4, 4, generator), 6, generator, tag=f"{prefix}-it{it}",
                version=trainer.policy_version, group_size=4,
            )
            means.append(float(np.mean([r.score for r in rewards])))
            publish(prefix, rollouts, rewards)
            waiting = {r.rollout_id for r in rollouts}
            while waiting:
                read = next(reader)
                waiting -= set(read.batch.rollout_ids)
                trainer.train_step(rl_batch(read.batch))
                reader.commit()
                steps.append(read.batch.batch_id)
    finally:
        reader.close()
        stop.set()
        service.join(timeout=60)
    Path(out).write_text(json.dumps({"mean_reward": means, "batches": steps}))
    trainer.close()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "toy":
        toy_main(args[0], int(args[1]), args[2])
    elif mode == "sample":
        sample_main(args[0], int(args[1]), args[2])
    elif mode == "memory":
        memory_main(args[0], args[1], args[2])
    elif mode == "score":
        score_main(args[0], args[1], args[2])
    else:
        raise SystemExit(f"unknown mode {mode}")
