"""The main job end to end: `ember demo` on its embedded defaults, against the real services."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def test_demo_runs_every_stage_and_its_checks_hold(kafka, slurm):
    result = subprocess.run(
        [sys.executable, "-m", "ember.cli", "demo"], cwd=REPO, capture_output=True, text=True, timeout=1500,
        env={**os.environ, "COLUMNS": "200"},
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "demo OK" in out, out[-6000:]
    for row in ("records read back equal", "corpus accounted (in = kept + rejected)", "verify", "midtrain loss per step",
                "books balance", "rl routing vs sampler (tokens differing)", "slurm job"):
        assert row in out, f"the demo summary lacks '{row}'"
    assert "FAILED" not in out
    loop = next((line for line in out.splitlines() if line.startswith("loop: ")), "")
    assert "versions gone round" in loop and "decided once: yes" in loop and "sha256 = trainer's export: yes" in loop, out[-6000:]
