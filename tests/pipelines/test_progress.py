"""Live progress files: per-DoFn counters, summed by the driver."""

from __future__ import annotations

import threading
from io import StringIO
from pathlib import Path

from rich.console import Console

from ember.pipelines.progress import ProgressWriter, read_progress, watch


def test_writers_flush_and_the_driver_sums_them(tmp_path: Path) -> None:
    a, b = ProgressWriter(str(tmp_path)), ProgressWriter(str(tmp_path))
    for _ in range(3):
        a.add("read")
    b.add("read", 4)
    b.add("filter", 2)
    a.flush()
    b.flush()
    assert read_progress(tmp_path) == {"read": 7, "filter": 2}
    (tmp_path / "torn.json").write_text("{not json")
    assert read_progress(tmp_path) == {"read": 7, "filter": 2}


def test_no_directory_means_no_files(tmp_path: Path) -> None:
    writer = ProgressWriter(None)
    writer.add("read")
    writer.flush()
    assert list(tmp_path.iterdir()) == []


def test_watch_renders_documents_per_stage(tmp_path: Path) -> None:
    writer = ProgressWriter(str(tmp_path))
    writer.add("near_dedup", 12)
    writer.flush()
    done = threading.Event()
    done.set()
    out = StringIO()
    assert watch(tmp_path, done, Console(file=out, width=100)) == {"near_dedup": 12}
    assert "near_dedup" in out.getvalue() and "12" in out.getvalue()
