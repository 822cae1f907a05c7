"""Helpers shared by tests/infra: run infra/*.sh and parse their status lines."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"


def ember_home() -> Path:
    return Path(os.environ.get("EMBER_HOME") or REPO / ".ember").resolve()


def run_infra(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run infra/<script> with args; never raises on a non-zero exit."""
    try:
        return subprocess.run(
            [str(INFRA / script), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"infra/{script} {' '.join(args)} timed out after {timeout}s\n"
            f"--- stdout ---\n{exc.stdout or ''}\n--- stderr ---\n{exc.stderr or ''}",
            pytrace=False,
        )


def require_ok(proc: subprocess.CompletedProcess[str], what: str) -> subprocess.CompletedProcess[str]:
    if proc.returncode != 0:
        pytest.fail(
            f"{what} failed with exit code {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}",
            pytrace=False,
        )
    return proc


def status_fields(script: str) -> list[str]:
    proc = require_ok(run_infra(script, "status", timeout=60), f"infra/{script} status")
    return proc.stdout.rstrip("\n").split("\t")


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path
    controller: str  # host:port
