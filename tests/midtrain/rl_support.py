"""RL test helpers: tiny policy configs, and the megatron-side work that must run in a subprocess.

`python -m tests.midtrain.rl_support toy CONFIG ITERATIONS OUT.json` runs the verifiable-task loop:
sample from the trainer's own policy (ember.demo.sampler), reward, publish, ETL, RL steps.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import torch
import yaml

from ember.demo.sampler import make_rollouts, publish, toy_policy_config, toy_prompts


def rl_config(path: Path, run_dir: Path, prefix: str, *, replay: str = "replay", steps: int = 100, **rl) -> Path:
    path.write_text(yaml.safe_dump(toy_policy_config(run_dir, prefix, replay=replay, steps=steps, **rl), sort_keys=False))
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


def toy_main(config_path: str, iterations: int, out: str) -> None:
    """On-policy loop through the real data path; writes the mean reward of every iteration."""
    from ember.midtrain.rl import RLTrainer
    from ember.midtrain.rl_config import load_rl_config
    from ember.rollouts.etl import EtlService, prepare_topics
    from ember.rollouts.reader import RolloutBatchReader

    config = load_rl_config(config_path)
    prefix = config.rollouts.topic_prefix
    etl = etl_config(prefix, token_budget=128)
    prepare_topics(etl)
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
                trainer.train_step(read.batch, read.tensors)
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
    else:
        raise SystemExit(f"unknown mode {mode}")
