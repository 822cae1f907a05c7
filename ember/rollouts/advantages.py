"""Reward shaping and group advantages: pure functions over numpy arrays, no I/O, no state.

The ETL computes advantages once, at group completion, so every trainer step and every replay
with the same settings sees the same numbers.
"""

from __future__ import annotations

from enum import Enum
from typing import Mapping, Sequence

import numpy as np


class Estimator(str, Enum):
    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"


def _rewards(rewards: Sequence[float] | np.ndarray) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or len(r) == 0:
        raise ValueError(f"rewards must be a non-empty 1-D array, got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards must be finite")
    return r


def grpo_advantages(rewards: Sequence[float] | np.ndarray, epsilon: float = 1e-6) -> np.ndarray:
    """GRPO: (r - mean) / (std + eps) over the group; std is unbiased (ddof=1) as in verl and DeepSeekMath."""
    r = _rewards(rewards)
    std = float(np.std(r, ddof=1)) if len(r) > 1 else 0.0
    return (r - r.mean()) / (std + epsilon)


def dr_grpo_advantages(rewards: Sequence[float] | np.ndarray) -> np.ndarray:
    """Dr.GRPO: r - mean, no std division (it up-weights easy and hard prompts, see Liu et al. 2025)."""
    r = _rewards(rewards)
    return r - r.mean()


def rloo_advantages(rewards: Sequence[float] | np.ndarray) -> np.ndarray:
    """RLOO: r_i - mean of the other samples; needs at least two samples."""
    r = _rewards(rewards)
    n = len(r)
    if n < 2:
        raise ValueError("RLOO needs at least 2 samples per group (leave-one-out baseline)")
    return r - (r.sum() - r) / (n - 1)


def group_advantages(rewards: Sequence[float] | np.ndarray, estimator: Estimator, epsilon: float = 1e-6) -> np.ndarray:
    estimator = Estimator(estimator)
    if estimator is Estimator.GRPO:
        return grpo_advantages(rewards, epsilon)
    if estimator is Estimator.DR_GRPO:
        return dr_grpo_advantages(rewards)
    return rloo_advantages(rewards)


def is_zero_variance(rewards: Sequence[float] | np.ndarray, tolerance: float = 1e-9) -> bool:
    """DAPO dynamic sampling: a group whose rewards are all equal carries no policy-gradient signal."""
    r = _rewards(rewards)
    return bool(np.ptp(r) <= tolerance)


def overlong_penalty(num_tokens: int, max_tokens: int, cache_tokens: int) -> float:
    """DAPO soft overlong punishment: 0 up to max - cache, then linear down to -1 at max, -1 beyond."""
    if max_tokens <= 0 or not 0 <= cache_tokens <= max_tokens:
        raise ValueError(f"need max_tokens > 0 and 0 <= cache_tokens <= max_tokens, got {max_tokens}, {cache_tokens}")
    free = max_tokens - cache_tokens
    if num_tokens <= free:
        return 0.0
    if num_tokens > max_tokens:
        return -1.0
    return (free - num_tokens) / cache_tokens


def combine_reward(components: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """Weighted sum of named reward components; a weighted component that is absent is an error, not a 0."""
    missing = sorted(set(weights) - set(components))
    if missing:
        raise KeyError(f"reward components {missing} are weighted but missing (have {sorted(components)})")
    return float(sum(w * float(components[name]) for name, w in weights.items()))


def token_advantages(advantage: float, loss_mask: np.ndarray) -> np.ndarray:
    """Broadcast a sequence advantage to its tokens; tokens the policy did not produce get 0."""
    return (loss_mask.astype(np.float32) * np.float32(advantage)).astype(np.float32, copy=False)


def staleness(policy_version: int, latest_version: int | None, created_at_us: int, now_us: int) -> tuple[int, float]:
    """(versions behind the latest published policy, seconds since the rollout was created)."""
    lag = 0 if latest_version is None else max(0, int(latest_version) - int(policy_version))
    return lag, max(0.0, (now_us - created_at_us) / 1e6)
