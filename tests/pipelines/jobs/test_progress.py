"""Live progress files: per-DoFn counters, summed by the driver."""

from __future__ import annotations

import re
import threading
import time
from io import StringIO
from pathlib import Path

from rich.console import Console

from ember.pipelines.jobs import progress
from ember.pipelines.jobs.progress import FLUSH_SECONDS, ProgressWriter, read_progress, watch


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


def test_a_terminal_gets_a_progress_display_with_rate_and_eta(tmp_path: Path) -> None:
    writer = ProgressWriter(str(tmp_path))
    writer.add("tokenize", 5)
    writer.flush()
    done = threading.Event()
    out = StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    thread = threading.Thread(target=watch, args=(tmp_path, done, console),
                              kwargs={"title": "tokenize", "stages": ("tokenize",), "expected": {"tokenize": 10}})
    thread.start()
    time.sleep(3 * FLUSH_SECONDS)
    done.set()
    thread.join()
    text = out.getvalue()
    assert "5 of 10" in text and "/s" in text and "ETA" in text and "━" in text  # a bar, as the total is known
    assert all(len(line) <= 100 for line in text.replace("\r", "\n").splitlines() if "\x1b" not in line)


def test_without_a_terminal_progress_is_periodic_plain_lines(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(progress, "PLAIN_EVERY_SECONDS", FLUSH_SECONDS)
    writer = ProgressWriter(str(tmp_path))
    writer.add("read", 1234567)
    writer.flush()
    done = threading.Event()
    out = StringIO()
    thread = threading.Thread(target=watch, args=(tmp_path, done, Console(file=out, width=200)))
    thread.start()
    time.sleep(4 * FLUSH_SECONDS)
    writer.add("filter", 3)
    writer.flush()
    time.sleep(4 * FLUSH_SECONDS)
    done.set()
    thread.join()
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue() and all(len(line) <= 100 for line in lines)
    read_lines = [line for line in lines if " read " in line]
    assert len(read_lines) == 1, lines  # once when it moved; unchanged stages stay quiet, the end included
    assert "1,234,567 docs" in read_lines[0] and "/s" in read_lines[0]
    assert re.search(r"\] filter +3 docs", lines[-1]), lines
