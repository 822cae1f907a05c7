"""Named crash points for fault-injection tests: `EMBER_FAULT=etl.before_commit:3` makes the process
SIGKILL itself the 3rd time it reaches that point, so a test can kill -9 the ETL exactly mid-transaction
instead of hoping a random kill lands there. Unset (production), a crash point costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "EMBER_FAULT"
_hits: dict[str, int] = {}


def _parse(spec: str) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, count = spec.partition(":")
    try:
        return name, int(count or 1)
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected <point>[:<nth hit>], e.g. etl.before_commit:3") from None


_target = _parse(os.environ.get(FAULT_ENV, ""))


def crash_point(name: str) -> None:
    if _target is None or _target[0] != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= _target[1]:
        os.kill(os.getpid(), signal.SIGKILL)
