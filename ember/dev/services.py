"""Python face of the infra/ scripts: `ember dev up|down|status` and test fixtures call these."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
INFRA_DIR = REPO_ROOT / "infra"
SERVICES = ("kafka", "slurm", "flink")


class ServiceError(RuntimeError):
    """A service script failed; the message carries its output so the cause is visible."""


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    state: str
    address: str
    log: str


def run_script(script: str, action: str, *, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    path = INFRA_DIR / script
    if not path.exists():
        raise ServiceError(f"{path} is missing: is this an ember checkout?")
    result = subprocess.run(
        ["bash", str(path), action], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT
    )
    if check and result.returncode != 0:
        raise ServiceError(
            f"infra/{script} {action} failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}".rstrip()
        )
    return result


def start(service: str) -> str:
    action = "fetch" if service == "flink" else "start"
    return run_script(f"{service}.sh", action).stdout


def stop(service: str) -> str:
    if service == "flink":
        return ""
    return run_script(f"{service}.sh", "stop").stdout


def status() -> list[ServiceStatus]:
    statuses = []
    for service in SERVICES:
        result = run_script(f"{service}.sh", "status", check=False)
        line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else f"{service}\tunknown\t-\t{result.stderr.strip()}"
        name, state, address, log = (line.split("\t") + ["-"] * 4)[:4]
        statuses.append(ServiceStatus(name, state, address, log))
    return statuses
