"""The metrics log: JSON lines and TensorBoard events, across a resume that redoes steps."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ember.midtrain.runtime import MetricsLog


def test_a_resume_replaces_the_redone_steps_in_tensorboard(tmp_path):
    """A run that logged steps 1-3 but checkpointed at 2 redoes step 3: TensorBoard keeps the new value,
    metrics.jsonl keeps both lines (the reader takes the last per step)."""
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path, enabled=True) as log:
        for step in (1, 2, 3):
            log.write({"step": step, "loss": 10.0 - step, "mismatch": {"kl": 0.1 * step}, "sample_ids": [step]})
    with MetricsLog(path, enabled=True, first_step=3) as log:
        log.write({"event": "resumed", "step": 2})
        for step in (3, 4):
            log.write({"step": step, "loss": 100.0 + step, "mismatch": {"kl": 1.0 * step}, "sample_ids": [step]})
    assert [json.loads(line).get("step") for line in path.read_text().splitlines()] == [1, 2, 3, 2, 3, 4]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "mismatch/kl"}
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 9.0), (2, 8.0), (3, 103.0), (4, 104.0)]
    assert [e.value for e in events.Scalars("mismatch/kl")] == pytest.approx([0.1, 0.2, 3.0, 4.0])


def test_off_rank_zero_nothing_is_written(tmp_path):
    with MetricsLog(tmp_path / "metrics.jsonl", enabled=False) as log:
        log.write({"step": 1, "loss": 1.0})
    assert list(tmp_path.iterdir()) == []
