"""Live progress for local runs: workers drop per-stage counters into a directory, the driver sums them.

Beam's FnApiRunner reports metrics only when the job ends and its workers are separate processes,
so each DoFn instance writes `{stage: documents}` to its own small JSON file (atomically, at most every
half second); the driver polls the directory and renders documents/s per stage. Display only: the
counts of record are in stats.json.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

STAGES = ("read", "filter", "redact", "exact_dedup", "near_dedup", "write")
FLUSH_SECONDS = 0.5


class ProgressWriter:
    """Counters of one DoFn instance; a no-op when no progress directory was given."""

    def __init__(self, directory: str | None):
        self._path = Path(directory) / f"{os.getpid()}-{uuid.uuid4().hex}.json" if directory else None
        self._counts: dict[str, int] = {}
        self._last = 0.0

    def add(self, stage: str, n: int = 1) -> None:
        if self._path is None:
            return
        self._counts[stage] = self._counts.get(stage, 0) + n
        now = time.monotonic()
        if now - self._last >= FLUSH_SECONDS:
            self.flush()
            self._last = now

    def flush(self) -> None:
        if self._path is None or not self._counts:
            return
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._counts))
        os.replace(tmp, self._path)


def read_progress(directory: str | Path) -> dict[str, int]:
    totals: dict[str, int] = {}
    for path in Path(directory).glob("*.json"):
        try:
            counts = json.loads(path.read_text())
        except (OSError, ValueError):  # a file being replaced right now; the next poll reads it
            continue
        for stage, n in counts.items():
            totals[stage] = totals.get(stage, 0) + int(n)
    return totals


def _table(totals: dict[str, int], elapsed: float) -> Table:
    table = Table("stage", "documents", "docs/s", title=f"corpus build — {elapsed:5.1f} s")
    for stage in STAGES:
        n = totals.get(stage, 0)
        table.add_row(stage, f"{n:,}", f"{n / elapsed:,.0f}" if elapsed > 0 else "-")
    return table


def watch(directory: str | Path, done: threading.Event, console: Console) -> dict[str, int]:
    """Render the live table until `done` is set; returns the last totals."""
    start = time.monotonic()
    totals: dict[str, int] = {}
    with Live(_table(totals, 0.0), console=console, refresh_per_second=4, transient=False) as live:
        while not done.wait(FLUSH_SECONDS):
            totals = read_progress(directory)
            live.update(_table(totals, time.monotonic() - start))
        totals = read_progress(directory)
        live.update(_table(totals, time.monotonic() - start))
    return totals
