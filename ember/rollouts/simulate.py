"""Synthetic agent rollouts and rewards with realistic shapes, for the demo, tests and benchmarks.

A rollout is a multi-turn episode: prompt (user), then alternating assistant and tool turns; only
assistant tokens carry loss and sampler log-probs.
"""

from __future__ import annotations

import time
import uuid

import numpy as np

from ember.schemas.rollouts import Reward, Rollout, Turn, routed_experts_dtype

REGIONS = ("us-east", "eu-west", "ap-south")


def synthetic_rollout(
    rng: np.random.Generator,
    *,
    group_id: str,
    prompt_id: str,
    num_tokens: int = 8192,
    prompt_tokens: int = 512,
    turns: int = 4,
    vocab_size: int = 151_000,
    layers: int | None = 61,
    top_k: int = 8,
    num_experts: int = 256,
    policy_version: int = 0,
    rollout_id: str | None = None,
) -> Rollout:
    prompt_tokens = min(prompt_tokens, num_tokens - 1)
    remaining = num_tokens - prompt_tokens
    cut_points = np.sort(rng.choice(np.arange(1, remaining), size=min(turns - 1, remaining - 1), replace=False))
    bounds = [0, prompt_tokens, *(prompt_tokens + cut_points).tolist(), num_tokens]
    turn_list = [Turn("user", 0, prompt_tokens)]
    loss_mask = np.zeros(num_tokens, dtype=np.uint8)
    for i, (start, end) in enumerate(zip(bounds[1:-1], bounds[2:])):
        role = "assistant" if i % 2 == 0 else "tool"
        turn_list.append(Turn(role, start, end))
        if role == "assistant":
            loss_mask[start:end] = 1
    logprobs = np.where(loss_mask == 1, -rng.exponential(0.7, num_tokens), 0.0).astype(np.float32)
    experts = None
    if layers:
        experts = rng.integers(0, num_experts, size=(num_tokens, layers, top_k)).astype(
            routed_experts_dtype(num_experts)
        )
    finish = "length" if rng.random() < 0.05 else "stop"
    return Rollout(
        rollout_id=rollout_id or uuid.uuid4().hex,
        group_id=group_id,
        prompt_id=prompt_id,
        policy_version=policy_version,
        sampler="sglang-sim/0",
        region=str(rng.choice(REGIONS)),
        created_at_us=time.time_ns() // 1000,
        tokens=rng.integers(0, vocab_size, size=num_tokens).astype(np.uint32),
        loss_mask=loss_mask,
        sampler_logprobs=logprobs,
        turns=turn_list,
        routed_experts=experts,
        finish_reason=finish,
        truncated=finish == "length",
        prompt_tokens=prompt_tokens,
    )


def synthetic_reward(rng: np.random.Generator, rollout: Rollout, grader: str = "unit-tests") -> Reward:
    passed = float(rng.random() < 0.5)
    style = float(rng.uniform(0, 1))
    return Reward(
        rollout_id=rollout.rollout_id,
        group_id=rollout.group_id,
        grader=grader,
        score=0.9 * passed + 0.1 * style,
        created_at_us=time.time_ns() // 1000,
        components={"tests_passed": passed, "style": style},
    )
