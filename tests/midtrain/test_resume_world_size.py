"""Resume at another world size from real checkpoints: 1 rank -> 2 ranks -> 1 rank.

Each phase ends by the real preemption path (SIGUSR1 to every trainer: finish the step, checkpoint with
megatron dist checkpointing, exit 0); the next phase starts at the other data-parallel size from that
checkpoint. The global sample order must continue with none repeated or skipped, and the loss must
follow an uninterrupted single-rank run on the same shard sets.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ember.midtrain.config import load_config

from .configs import tiny_run

# Several megatron processes one after another (4 runs of 1-2 ranks): more than the default timeout on a busy machine.
pytestmark = pytest.mark.timeout(1500)

STEPS = 10
GLOBAL_BATCH = 8
MIDTRAIN = [sys.executable, "-m", "ember.midtrain.cli", "train"]


def _steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _start(config_path: Path, ranks: int, stdout=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen(
        [*MIDTRAIN, str(config_path), "--threads", "1", *(["--nproc-per-node", str(ranks)] if ranks > 1 else [])],
        stdout=stdout, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _phase(config_path: Path, ranks: int, stop_at: int | None) -> str:
    """One run at `ranks` ranks; with `stop_at`, every trainer gets SIGUSR1 once step `stop_at` is logged."""
    metrics = load_config(config_path).metrics_path
    proc = _start(config_path, ranks)
    try:
        if stop_at is not None:
            deadline = time.monotonic() + 400
            while not any(r["step"] >= stop_at for r in _steps(metrics)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the run ended or stalled before step {stop_at}:\n{proc.communicate()[0][-4000:]}")
                time.sleep(0.02)
            trainers = psutil.Process(proc.pid).children() if ranks > 1 else [psutil.Process(proc.pid)]
            assert len(trainers) == ranks
            for trainer in trainers:
                trainer.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    return out


def test_resume_at_another_world_size_continues_the_sample_order_and_the_loss(tmp_path):
    baseline_config = tiny_run(tmp_path / "baseline", steps=STEPS, save_interval=0)
    # The uninterrupted run trains beside the phases (one thread each; most phases leave a core idle).
    baseline_log = tmp_path / "baseline.log"
    with open(baseline_log, "w") as log:
        uninterrupted = _start(baseline_config, 1, stdout=log)
    try:
        config_path = tiny_run(tmp_path / "resized", steps=STEPS, save_interval=0)
        config = load_config(config_path)
        outputs = [_phase(config_path, 1, 2)]
        first = _steps(config.metrics_path)[-1]["step"]
        outputs.append(_phase(config_path, 2, first + 2))
        second = _steps(config.metrics_path)[-1]["step"]
        assert second < STEPS, "the two-rank phase must stop before the end for the way back to one rank"
        outputs.append(_phase(config_path, 1, None))
        records = _steps(config.metrics_path)
        assert uninterrupted.wait(timeout=400) == 0, baseline_log.read_text()[-4000:]
    finally:
        if uninterrupted.poll() is None:
            uninterrupted.kill()
    baseline = _steps(load_config(baseline_config).metrics_path)

    assert [r["dp_size"] for r in records] == [1] * first + [2] * (second - first) + [1] * (STEPS - second)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "each phase resumed at the step after the last"
    ids = [i for r in records for i in r["sample_ids"]]
    assert ids == list(range(STEPS * GLOBAL_BATCH)), "a sample was repeated or skipped across a world-size change"
    assert [r["rows"] for r in records] == [r["rows"] for r in baseline], "the same shard rows in the same order"
    for output in outputs[1:]:
        assert "new parallel layout: RNG re-seeded" in output
    assert "dp 2" in outputs[1] and "dp 1" in outputs[2]
    for ours, theirs in zip(records, baseline):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-4), (ours["step"], ours["dp_size"])
