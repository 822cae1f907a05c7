"""A throwaway, freshly formatted KRaft broker for one test: what a newcomer's first `make demo` meets, and a
broker a test may stop and start without stopping the suite's (so that test need not run alone).

It is `infra/kafka.sh` under another instance name (`EMBER_KAFKA_NAME`): the same jars and broker
settings, its own state directory under $EMBER_HOME, pid file and lock, on free ports, so the broker the
rest of the suite uses is never touched. `infra/kafka.sh start` returns as soon as the broker answers
metadata requests, before `__consumer_offsets` and `__transaction_state` exist: exactly the state in
which the first run of the demo used to fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "infra" / "kafka.sh"


def _script(action: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["bash", str(SCRIPT), action], env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"infra/kafka.sh {action} ({env['EMBER_KAFKA_NAME']}) failed:\n{result.stdout}\n{result.stderr}")
    return result


@dataclass(frozen=True)
class FreshBroker:
    """A running throwaway broker: its bootstrap, and its own `infra/kafka.sh stop` / `start` (same data, same ports)."""

    bootstrap: str
    env: dict[str, str]

    def stop(self) -> None:
        _script("stop", self.env, 90)

    def start(self) -> None:
        _script("start", self.env, 180)


@contextmanager
def fresh_broker() -> Iterator[FreshBroker]:
    """Format and start a new single-node broker; yields it; stops it and deletes its data."""
    port, controller = free_ports(2)
    name = f"kafka-fresh-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "EMBER_KAFKA_NAME": name,
        "EMBER_KAFKA_PORT": str(port),
        "EMBER_KAFKA_CONTROLLER_PORT": str(controller),
        "EMBER_KAFKA_HEAP": "384m",
    }
    home = Path(env.get("EMBER_HOME", REPO / ".ember")).resolve()
    try:
        _script("start", env, 180)
        yield FreshBroker(f"127.0.0.1:{port}", env)
    finally:
        _script("reset", env, 90)
        shutil.rmtree(home / name, ignore_errors=True)
        (home / "run" / f"{name}.lock").unlink(missing_ok=True)
