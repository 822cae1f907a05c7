"""Warmup-stable-decay learning rate."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.midtrain.schedule import wsd_lr

ARGS = dict(lr=1.0, min_lr=0.1, total_steps=100, warmup_steps=10, decay_steps=20)


@pytest.mark.parametrize(
    ("style", "mid_decay"),
    [("linear", 0.55), ("cosine", 0.55), ("exponential", 0.1 + 0.9 * (2 * 0.5**0.5 - 1)), ("minus_sqrt", 0.1 + 0.9 * (1 - 0.5**0.5))],
)
def test_phases(style, mid_decay):
    lr = lambda step: wsd_lr(step, decay_style=style, **ARGS)  # noqa: E731
    assert lr(1) == pytest.approx(0.1)
    assert lr(5) == pytest.approx(0.5)
    assert lr(10) == lr(11) == lr(80) == 1.0  # stable until total - decay
    assert lr(90) == pytest.approx(mid_decay)
    assert lr(100) == lr(150) == 0.1


@settings(max_examples=80, deadline=None)
@given(
    total=st.integers(1, 500),
    warmup_frac=st.floats(0, 1),
    decay_frac=st.floats(0, 1),
    style=st.sampled_from(["linear", "cosine", "exponential", "minus_sqrt"]),
)
def test_rises_then_never_increases_and_stays_between_bounds(total, warmup_frac, decay_frac, style):
    warmup = int(warmup_frac * total)
    decay = int(decay_frac * (total - warmup))
    values = [wsd_lr(s, lr=2.0, min_lr=0.2, total_steps=total, warmup_steps=warmup, decay_steps=decay, decay_style=style) for s in range(1, total + 1)]
    peak = max(range(len(values)), key=values.__getitem__)
    assert all(a <= b + 1e-12 for a, b in zip(values[:peak], values[1 : peak + 1]))
    assert all(a >= b - 1e-12 for a, b in zip(values[peak:], values[peak + 1 :]))
    assert all(0 < v <= 2.0 for v in values)
    if decay:
        assert math.isclose(values[-1], 0.2)


def test_step_is_one_based():
    with pytest.raises(ValueError):
        wsd_lr(0, decay_style="linear", **ARGS)
