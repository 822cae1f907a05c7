"""Warmup-stable-decay learning rate, as a pure function of the step (megatron's "WSD" shape).

Why WSD for mid-training: the constant phase lets a run be extended or branched at any step, and
the final decay is a fixed number of steps wherever the run ends.
"""

from __future__ import annotations

import math
from typing import Literal

DecayStyle = Literal["linear", "cosine", "exponential", "minus_sqrt"]


def wsd_lr(
    step: int, *, lr: float, min_lr: float, total_steps: int, warmup_steps: int, decay_steps: int, decay_style: DecayStyle
) -> float:
    """Learning rate of update number `step` (1-based: the first optimizer update is step 1).

    Linear warmup reaches `lr` at step == warmup_steps, it stays at `lr` until
    total_steps - decay_steps, then falls to `min_lr` at total_steps (and stays there after).
    """
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    if warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    anneal_start = total_steps - decay_steps
    if step <= anneal_start:
        return lr
    if step >= total_steps:
        return min_lr
    ratio = (step - anneal_start) / decay_steps
    coeff = {
        "linear": lambda r: 1.0 - r,
        "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
        "exponential": lambda r: 2.0 * 0.5**r - 1.0,
        "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
    }[decay_style](ratio)
    return min_lr + coeff * (lr - min_lr)
