"""A reference CPU sampler for the RL tests, benchmark and demo: the same megatron-core MoE policy,
generating and scoring with "inference numerics".

Why it exists: a real inference engine computes the policy with different kernels, so its log-probs
and (for an MoE) its routing differ slightly from the trainer's. Here the difference is a fixed
perturbation of every router's weights (`perturb_routers`), which flips some top-k choices exactly as
numeric noise does at scale. Scoring records the routed experts per token and layer with
megatron-core's RouterReplay RECORD, in the `Rollout.routed_experts` layout [T, layers, top_k].
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from ember.midtrain.rl import step_math
from ember.midtrain.model import moe_routers, packed_attention
from ember.midtrain.rl.batch import attention_inputs
from ember.rollouts.transport import RewardWriter, RolloutWriter
from ember.schemas import Reward, Rollout, Turn


@torch.no_grad()
def perturb_routers(model, sigma: float, seed: int) -> None:
    """Adds fixed N(0, sigma) noise to every router weight: the sampler's numerics differ from the trainer's."""
    generator = torch.Generator().manual_seed(seed)
    for router in moe_routers(model):
        router.weight.add_(torch.randn(router.weight.shape, generator=generator, dtype=router.weight.dtype) * sigma)


@torch.no_grad()
def score(model, sequences: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-token log-probs (float32, 0 on the first token) and routed experts [L, layers, top_k] (uint8)
    of each sequence, from one packed teacher-forced forward pass with routing RECORD on."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = moe_routers(model)
    if any(r.router_replay is None for r in routers):
        raise ValueError("scoring records routing: build the sampler model with moe.routing_replay: true")
    tokens = torch.from_numpy(np.concatenate(sequences).astype(np.int64))
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([len(s) for s in sequences]), 0)
    positions = torch.arange(len(tokens)) - cu.long()[step_math.segment_ids(cu)]
    labels = step_math.next_token_labels(tokens, cu)
    was_training = model.training
    model.eval()
    for router in routers:
        router.router_replay.clear_indices()
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        mask, packed = attention_inputs(packed_attention(model), cu)  # as the trainer keeps sequences apart
        loss = model(tokens[None], positions[None], mask, labels=labels[None], packed_seq_params=packed)
        recorded = [r.router_replay.get_recorded_indices() for r in routers]
    finally:
        for router in routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()
        model.train(was_training)
    logp = step_math.token_logprobs(-loss[0].float(), cu).numpy().astype(np.float32)
    experts = torch.stack(recorded, dim=1).numpy()
    dtype = np.uint8 if experts.max(initial=0) < 256 else np.uint16
    bounds = cu.tolist()
    return [(logp[a:b], experts[a:b].astype(dtype)) for a, b in zip(bounds[:-1], bounds[1:])]


@torch.no_grad()
def generate(model, prompts: torch.Tensor, new_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Samples `new_tokens` continuations of equal-length prompts [B, P] at temperature 1 over the
    model's whole (padded) vocabulary, the distribution `score` reports (full forward per token: tiny
    models, no KV cache)."""
    was_training = model.training
    model.eval()
    tokens = prompts.long()
    try:
        for _ in range(new_tokens):
            length = tokens.shape[1]
            positions = torch.arange(length)[None].expand_as(tokens)
            mask = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, None]
            logits = model(tokens, positions, mask)[:, -1, :].float()
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
    finally:
        model.train(was_training)
    return tokens


# ---- the toy verifiable task the reference sampler serves (tests, demo) ------------------------

TOY_VOCAB = 16
TOY_PROMPT = 4
TOY_TARGET = 3  # reward 1 when the completion contains this token
TOY_GRADER = "unit-tests"


def toy_policy_config(run_dir: Path, prefix: str, *, replay: str = "replay", steps: int = 100, **rl) -> dict:
    """A tiny MoE policy (2 layers x 8 experts, top-2) over the toy vocabulary, as an RL config."""
    return {
        "run_dir": str(run_dir),
        "model": {
            "tokenizer": "toy", "vocab_size": TOY_VOCAB, "vocab_pad_multiple": 8, "seq_len": 64,
            "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
        },
        "moe": {"num_experts": 8, "router_topk": 2, "ffn_hidden_size": 32, "load_balancing": "none"},
        "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
        "rollouts": {"topic_prefix": prefix, "group_id": f"{prefix}-{Path(run_dir).name}", "idle_timeout_s": 3},
        "rl": {"steps": steps, "replay": replay, "seed": 7, **rl},
    }


def toy_prompts(groups: int, group_size: int, generator: torch.Generator) -> torch.Tensor:
    """`groups` random prompts without the target token, each repeated `group_size` times."""
    base = torch.randint(4, TOY_VOCAB, (groups, TOY_PROMPT), generator=generator)
    return base.repeat_interleave(group_size, dim=0)


def make_rollouts(model, prompts: torch.Tensor, new_tokens: int, generator: torch.Generator, *, tag: str, version: int,
                  group_size: int) -> tuple[list[Rollout], list[Reward]]:
    """Generates, scores (sampler log-probs + routed experts) and rewards completions of `prompts`."""
    sequences = generate(model, prompts, new_tokens, generator).numpy()
    scored = score(model, list(sequences))
    rollouts, rewards = [], []
    now = time.time_ns() // 1000
    for i, (tokens, (logp, experts)) in enumerate(zip(sequences, scored)):
        group = f"{tag}-g{i // group_size}"
        mask = np.zeros(len(tokens), dtype=np.uint8)
        mask[TOY_PROMPT:] = 1
        rollout = Rollout(
            rollout_id=f"{group}-{i % group_size}", group_id=group, prompt_id=group, policy_version=version,
            sampler="ember-reference-sampler", region="local", created_at_us=now, tokens=tokens.astype(np.uint32),
            loss_mask=mask, sampler_logprobs=np.where(mask == 1, logp, 0).astype(np.float32),
            turns=[Turn("user", 0, TOY_PROMPT), Turn("assistant", TOY_PROMPT, len(tokens))], routed_experts=experts,
            prompt_tokens=TOY_PROMPT,
        )
        rollouts.append(rollout.validate())
        rewards.append(Reward(rollout.rollout_id, group, TOY_GRADER, float(TOY_TARGET in tokens[TOY_PROMPT:].tolist()), now))
    return rollouts, rewards


def publish(prefix: str, rollouts: list[Rollout], rewards: list[Reward]) -> None:
    with RolloutWriter(prefix) as rollout_writer, RewardWriter(prefix) as reward_writer:
        for rollout in rollouts:
            rollout_writer.write(rollout)
        for reward in rewards:
            reward_writer.write(reward)


def sample_and_publish(config_path: str | Path, groups: int, sigma: float, group_size: int = 4, new_tokens: int = 8) -> None:
    """Saves the initial policy (step 0 in the config's run_dir), then samples `groups` groups with
    router weights perturbed by `sigma` and publishes them with their rewards, as a fleet would."""
    from ember.midtrain.config import load_rl_config
    from ember.midtrain.rl.trainer import RLTrainer

    config = load_rl_config(config_path)
    trainer = RLTrainer(config)
    trainer.save()
    perturb_routers(trainer.model, sigma, seed=5)
    generator = torch.Generator().manual_seed(3)
    prefix = config.rollouts.topic_prefix
    rollouts, rewards = make_rollouts(
        trainer.model, toy_prompts(groups, group_size, generator), new_tokens, generator, tag=prefix, version=0,
        group_size=group_size,
    )
    publish(prefix, rollouts, rewards)
    trainer.close()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: python -m ember.demo.sampler RL_CONFIG.yaml GROUPS ROUTER_SIGMA")
    sample_and_publish(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
