"""The RL stage of `ember demo`: sampler -> Kafka -> ETL -> a few `midtrain rl` steps with router replay.

`run` is the whole loop on the toy verifiable task: the reference sampler (the tiny MoE policy with
perturbed router weights: inference numerics) generates, scores and records routing, publishes
rollouts and rewards; the ETL turns them into batches; the trainer starts from the sampler's initial
policy and replays its routing. `run_demo_steps` trains on any train-batches topic, sizing the policy
from the batches. Trainer and sampler run in subprocesses: megatron-core's global parallel state must
not live in the demo's own process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from rich.console import Console

from ember.demo import sampler as rl_sampler
from ember.midtrain.rl import step_math
from ember.rollouts.reader import RolloutBatchReader
from ember.rollouts.topics import Topics


def _shape(topic: str, group_id: str, batches: int) -> tuple[int, tuple[int, int, int] | None, bool]:
    """(largest token id, (MoE layers, top_k, largest expert id) or None, whether some token's
    top-k repeats an expert) over the first batches."""
    max_token, experts, repeats = 0, None, False
    with RolloutBatchReader(topic, group_id=group_id, idle_timeout_s=10) as reader:
        for i, read in enumerate(reader):
            max_token = max(max_token, int(read.batch.tokens.max()))
            routed = read.batch.routed_experts
            if routed is not None:
                top = max(int(routed.max()), experts[2] if experts else 0)
                experts = (routed.shape[1], routed.shape[2], top)
                repeats = repeats or step_math.repeats_an_expert(torch.from_numpy(routed.astype(np.int64)))
            if i + 1 == batches:
                break
    if max_token == 0:
        raise RuntimeError(f"{topic} holds no batches to train on")
    return max_token, experts, repeats


def demo_config(topic_prefix: str, workdir: Path, steps: int) -> tuple[Path, str]:
    """The RL config for the batches, and why router replay is on or off."""
    max_token, experts, repeats = _shape(Topics(topic_prefix).train_batches, f"{topic_prefix}-rl-demo-peek", steps)
    layers, top_k, max_expert = experts or (2, 2, 3)
    num_experts = max(top_k, 2 ** math.ceil(math.log2(max_expert + 1)))
    config = {
        "run_dir": str(workdir / "run"),
        "model": {
            "tokenizer": "demo", "vocab_size": max_token + 1, "seq_len": 64,
            "num_layers": layers, "hidden_size": 32, "num_attention_heads": 4,
        },
        "moe": {"num_experts": num_experts, "router_topk": top_k, "ffn_hidden_size": 32, "load_balancing": "none"},
        "optimizer": {"lr": 1e-4, "weight_decay": 0.0},
        "rollouts": {"topic_prefix": topic_prefix, "group_id": f"{topic_prefix}-rl-demo", "idle_timeout_s": 10},
        # Replay needs real top-k sets; synthetic expert ids that repeat within a token are only compared.
        "rl": {"steps": steps, "replay": "replay" if experts and not repeats else "off", "correction": "mis", "save_interval": 0},
    }
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "rl.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    if not experts:
        return path, "off: the batches carry no routed experts"
    if repeats:
        return path, "off: the batches' expert ids repeat within a token (synthetic, not a router's top-k); routing only compared"
    return path, "on: the sampler's experts are forced in every MoE layer"


def run(console: Console, workdir: Path, groups: int = 6, steps: int = 3) -> list[tuple[str, str]]:
    """Samples `groups` groups of 4, batches them through the real ETL, trains `steps` steps."""
    from ember.rollouts.config import parse_config as parse_etl_config
    from ember.rollouts.etl import EtlService, prepare_topics

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    prefix = f"ember-demo-rl-{time.strftime('%Y%m%d%H%M%S')}"
    etl = parse_etl_config({
        "kafka": {"topic_prefix": prefix, "partitions": 1, "group_id": f"{prefix}-etl"},
        "groups": {"size": 4, "timeout_s": 60},
        "rewards": {"graders": [rl_sampler.TOY_GRADER], "timeout_s": 60},
        "filters": {"max_policy_lag": None, "max_tokens": 64, "vocab_size": rl_sampler.TOY_VOCAB},
        "advantages": {"drop_zero_variance": False},
        "batches": {"token_budget": 64, "min_fill": 0.9, "max_wait_s": 0.5},
    })
    prepare_topics(etl, create=True)
    policy = workdir / "policy.yaml"
    policy.write_text(yaml.safe_dump(rl_sampler.toy_policy_config(workdir / "policy", prefix)))
    with console.status(f"RL: the reference sampler generates {groups} groups with perturbed routers..."):
        result = subprocess.run([sys.executable, "-m", "ember.demo.sampler", str(policy), str(groups), "0.01"],
                                capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"the reference sampler failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    with console.status("RL: rollout ETL into batches..."):
        EtlService(etl, "demo-rl").run(until_idle_s=2.0)
    config = rl_sampler.toy_policy_config(workdir / "run", prefix, steps=steps, correction="mis", save_interval=0)
    config["init_checkpoint"] = str(workdir / "policy" / "checkpoints" / "step_00000000")
    config_path = workdir / "rl.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    rows = [("rl data", f"{groups * 4} rollouts from the reference sampler (router weights perturbed: sampler numerics), "
                        f"toy task: reward 1 when the completion holds token {rl_sampler.TOY_TARGET}")]
    return rows + _train(console, config_path, "on: the sampler's experts are forced in every MoE layer")


def run_demo_steps(console: Console, topic_prefix: str, workdir: Path, steps: int = 3) -> list[tuple[str, str]]:
    """Trains up to `steps` RL steps on the prefix's train-batches topic and returns summary rows,
    the mismatch metrics of every step among them."""
    config_path, replay_note = demo_config(topic_prefix, Path(workdir), steps)
    return _train(console, config_path, replay_note)


def _train(console: Console, config_path: Path, replay_note: str) -> list[tuple[str, str]]:
    config = yaml.safe_load(config_path.read_text())
    steps, topic_prefix = config["rl"]["steps"], config["rollouts"]["topic_prefix"]
    with console.status(f"RL: {steps} megatron-core MoE steps on {Topics(topic_prefix).train_batches}..."):
        result = subprocess.run(
            [sys.executable, "-m", "ember.midtrain.rl.run", str(config_path)], capture_output=True, text=True, timeout=900
        )
    if result.returncode != 0:
        raise RuntimeError(f"midtrain rl {config_path} failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (Path(config["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "step" in r and "event" not in r]
    if not records:
        raise RuntimeError(f"midtrain rl {config_path} trained no step:\n{result.stdout[-3000:]}")
    m, moe = config["model"], config["moe"]

    def per_step(fn) -> str:
        return " -> ".join(fn(r) for r in records)

    rows = [
        ("rl model", f"GPTModel {m['num_layers']} MoE layers x {moe['num_experts']} experts (top-{moe['router_topk']}), "
                     f"vocab {m['vocab_size']}"),
        ("rl router replay", replay_note),
        ("rl steps", f"{len(records)} batches, {sum(r['tokens'] for r in records)} tokens, "
                     f"{sum(r['sequences'] for r in records)} rollouts; policy versions 1..{records[-1]['policy_version']} published"),
        ("rl loss per step", per_step(lambda r: f"{r['loss']:.4f}")),
        ("rl mean |delta logp| (trainer vs sampler)", per_step(lambda r: f"{r['mismatch']['mean_abs_delta_logp']:.3f}")),
        ("rl KL(mu||pi)", per_step(lambda r: f"{r['mismatch']['kl_mu_pi']:.3f}")),
        ("rl tokens with rho outside [0.5, 2]", per_step(lambda r: f"{r['mismatch']['frac_outside']:.2f}")),
        ("rl kept by masked IS", per_step(lambda r: f"{r['correction_kept_frac']:.2f}")),
        ("rl step time", per_step(lambda r: f"{r['step_seconds']:.2f}s")),
    ]
    if "routing_disagreement" in records[0]:
        rows.append(("rl routing vs sampler (tokens differing)", per_step(lambda r: f"{r['routing_disagreement']:.3f}")))
    return rows
