"""Live progress for local runs: workers drop per-stage counters into a directory, the driver sums them.

Beam's FnApiRunner reports metrics only when the job ends and its workers are separate processes,
so each DoFn instance writes `{stage: documents}` to its own small JSON file (atomically, at most every
half second); the driver polls the directory and shows documents/s per stage - a rich progress display
on a terminal, plain periodic lines otherwise. Display only: the counts of record are in stats.json.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

STAGES = ("read", "filter", "redact", "decontaminate", "exact_dedup", "near_dedup", "write")
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


PLAIN_EVERY_SECONDS = 15.0
"""How often the plain display (stdout not a terminal: CI logs, pipes) prints the stages that moved."""


def _rate(n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f}/s" if seconds > 0 else "-"


def _plain_line(stage: str, n: int, total: int | None, elapsed: float, stage_seconds: float) -> str:
    """One stage's line, at most ~70 columns: elapsed, stage, documents (of the total), documents/s."""
    of = f" of {total:,}" if total else ""
    return f"[{elapsed:7.1f} s] {stage:<12} {n:>13,}{of} docs  {_rate(n, stage_seconds):>12}"


class _Stages:
    """Per-stage counts and when each stage started (the poll before its first count), for documents/s."""

    def __init__(self, stages: tuple[str, ...]):
        self.stages = stages
        self.start = self.last_poll = time.monotonic()
        self.first_seen: dict[str, float] = {}
        self.totals: dict[str, int] = {}

    def update(self, totals: dict[str, int]) -> None:
        for stage, n in totals.items():
            if n:
                self.first_seen.setdefault(stage, self.last_poll)
        self.totals = totals
        self.last_poll = time.monotonic()

    def ordered(self) -> list[str]:
        known = [s for s in self.stages if s in self.first_seen]
        return known + sorted(s for s in self.first_seen if s not in self.stages)

    def seconds(self, stage: str) -> float:
        return time.monotonic() - self.first_seen.get(stage, self.start)


def _watch_plain(directory: str | Path, done: threading.Event, console: Console, stages: _Stages,
                 expected: dict[str, int]) -> None:
    printed: dict[str, int] = {}

    def emit() -> None:
        """The stages whose count moved since they were last printed: a phase's end repeats no line."""
        elapsed = time.monotonic() - stages.start
        for stage in stages.ordered():
            n = stages.totals.get(stage, 0)
            if printed.get(stage) != n:
                console.print(_plain_line(stage, n, expected.get(stage), elapsed, stages.seconds(stage)),
                              highlight=False, soft_wrap=True)
                printed[stage] = n

    last = time.monotonic()
    while not done.wait(FLUSH_SECONDS):
        stages.update(read_progress(directory))
        if time.monotonic() - last >= PLAIN_EVERY_SECONDS:
            emit()
            last = time.monotonic()
    stages.update(read_progress(directory))
    emit()


def _watch_live(directory: str | Path, done: threading.Event, console: Console, stages: _Stages,
                expected: dict[str, int], title: str) -> None:
    columns = (
        TextColumn("{task.description:<12}"), BarColumn(bar_width=24), TextColumn("{task.fields[count]:>22}"),
        TextColumn("{task.fields[rate]:>11}"), TextColumn("{task.fields[eta]}"), TimeRemainingColumn(), TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False, refresh_per_second=4) as progress:
        console.print(title, highlight=False)
        tasks: dict[str, TaskID] = {}

        def refresh() -> None:
            for stage in stages.ordered():
                n, total = stages.totals.get(stage, 0), expected.get(stage)
                if stage not in tasks:
                    tasks[stage] = progress.add_task(stage, total=total, count="", rate="", eta="ETA" if total else "   ")
                count = f"{n:,} of {total:,}" if total else f"{n:,} docs"
                progress.update(tasks[stage], completed=n, count=count, rate=_rate(n, stages.seconds(stage)))

        while not done.wait(FLUSH_SECONDS):
            stages.update(read_progress(directory))
            refresh()
        stages.update(read_progress(directory))
        refresh()
        for stage, task in tasks.items():  # finished: no bar left pulsing, an ETA of zero
            progress.update(task, total=stages.totals.get(stage, 0))


def watch(directory: str | Path, done: threading.Event, console: Console, *, title: str = "corpus build",
          stages: tuple[str, ...] = STAGES, expected: dict[str, int] | None = None) -> dict[str, int]:
    """Show per-stage progress until `done` is set and return the last totals: a rich progress display
    (documents/s, ETA for stages whose total is `expected`) on a terminal, otherwise a plain line per
    stage that moved every `PLAIN_EVERY_SECONDS` and one per stage at the end, so CI logs stay short."""
    state = _Stages(stages)
    if console.is_terminal:
        _watch_live(directory, done, console, state, expected or {}, title)
    else:
        console.print(f"{title}: progress every {PLAIN_EVERY_SECONDS:.0f} s", highlight=False)
        _watch_plain(directory, done, console, state, expected or {})
    return state.totals
