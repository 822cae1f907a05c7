"""Baselines for single samples: each product prompt is answered once, so there is no group to normalise in.

Both estimators compare a reward with what the same context earned *before* it (log order), never with
itself, so the baseline does not depend on the sampled action and the policy-gradient estimate stays unbiased
in expectation. Their bias is in the other term: the baseline estimates E[r | context] for a policy that has
since moved (EMA: an exponentially weighted past, mean lag about 1/alpha rewards; leave-one-out: the rewards
of the last `window_s`), so advantages carry extra variance when the reward drifts, and the first rewards of
a key have no baseline at all: they only warm it up and are dropped (`baseline_warmup`) rather than trained
with an advantage made up from nothing.

- `ema`: b <- b + alpha (r - b) per (context key, policy version); the advantage is r - b before the update.
  Per version, because a new checkpoint earns different rewards: a version's first reward of a context
  starts its baseline from the previous version's (when it has one), not from zero.
- `loo`: the mean of the same context's rewards (any version) within the last `window_s` of log time, leaving
  this one out; needs `min_history` of them.
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from ember.configs import StrictModel
from ember.schemas.rollouts import SINGLE_SAMPLE_ESTIMATOR_PREFIX


class BaselineKind(str, Enum):
    EMA = "ema"
    LOO = "loo"


class BaselineSettings(StrictModel):
    kind: BaselineKind = Field(BaselineKind.EMA, description="ema (per context key and policy version) or loo (time window)")
    alpha: float = Field(0.05, gt=0, le=1, description="EMA step: weight of the newest reward")
    window_s: float = Field(3600.0, gt=0, description="loo: the rewards of the same context key in this much past log time")
    min_history: int = Field(1, ge=1, description="rewards a key needs before its baseline is used; earlier ones only warm it")

    @property
    def estimator(self) -> str:
        """What a `TrainBatch` says computed its advantages."""
        return f"{SINGLE_SAMPLE_ESTIMATOR_PREFIX}{self.kind.value}"


def ema_step(baseline: float, count: int, reward: float, alpha: float) -> tuple[float, int]:
    """(baseline, count) after one more reward; the first reward of a fresh key is its baseline."""
    if count == 0:
        return reward, 1
    return baseline + alpha * (reward - baseline), count + 1


def loo_baseline(others: list[float]) -> float:
    """Mean of the window's other rewards (the caller checked there are enough)."""
    return sum(others) / len(others)
