"""A line bomb through the real `ember corpus build`: a compressed file of a few hundred KiB holding one
200 MB JSONL line costs the build no more memory than a build without it.

Measured on this machine (FnApiRunner in the CLI's job process, peak RSS of the whole process tree):
before bounded lines 1,208 MiB (the line decoded, parsed and filtered as a too_long document), after 313 MiB
(the same build without the bomb: 305 MiB).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import zstandard

from ember.pipelines.corpus.report import read_stats

from tests.peak_memory import run_with_peak_rss
from tests.pipelines.corpus_support import rows

EMBER = Path(sys.executable).with_name("ember")
BOMB_MIB = 200
PEAK_RSS_LIMIT = 768 * 2**20  # ~2.5x the build's own footprint; the unbounded reader needed 1.2 GiB


def _good(prefix: str) -> list[bytes]:
    return [json.dumps({"text": f"def {prefix}_{i}(value):\n    return value * {i} + {i * 7} - offset_{i}\n"}).encode() + b"\n"
            for i in range(3)]


def _write_bomb(out, name: str) -> None:
    """Three good lines, the bomb (line 4), three good lines; written in pieces."""
    for line in _good(f"{name}_before"):
        out.write(line)
    out.write(b'{"text": "')
    for _ in range(BOMB_MIB):
        out.write(b"x" * 2**20)
    out.write(b'"}\n')
    for line in _good(f"{name}_after"):
        out.write(line)


def _build(config: Path) -> tuple[int, int, str]:
    """(exit code, peak RSS in bytes of the build and every process it waited for, output) of `ember corpus build`."""
    done, peak = run_with_peak_rss([str(EMBER), "corpus", "build", str(config), "--runner=FnApiRunner"], config.parent,
                                   env={**os.environ, "COLUMNS": "200"})
    return done.returncode, peak, done.stdout.decode()


def test_a_200_mb_line_is_a_line_too_long_reject_and_the_build_stays_small(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    with gzip.open(inputs / "a.jsonl.gz", "wb", compresslevel=1) as out:
        _write_bomb(out, "gz")
    with zstandard.ZstdCompressor().stream_writer((inputs / "b.jsonl.zst").open("wb")) as out:
        _write_bomb(out, "zst")
    assert (inputs / "a.jsonl.gz").stat().st_size < 2**20 and (inputs / "b.jsonl.zst").stat().st_size < 2**16
    config = tmp_path / "corpus.yaml"
    config.write_text(f"""
sources:
  - {{name: gz, kind: code, inputs: ["{inputs}/*.jsonl.gz"], format: jsonl.gz}}
  - {{name: zst, kind: code, inputs: ["{inputs}/*.jsonl.zst"], format: jsonl.zst}}
dedup: {{exact: false, near: false}}
output: {{directory: "{tmp_path / 'out'}"}}
""")
    code, peak, output = _build(config)
    assert code == 0, output

    out = str(tmp_path / "out")
    stats = read_stats(out)
    assert stats["totals"]["balanced"] and stats["totals"]["docs_in"] == 14
    assert [stats["sources"][s]["rejected"] for s in ("gz", "zst")] == [{"read:line_too_long": 1}] * 2
    rejects = sorted(rows(tmp_path / "out", "rejects"), key=lambda r: r["location"])
    assert [(r["location"], r["reason"]) for r in rejects] == [
        (f"{inputs / 'a.jsonl.gz'}:line=4", "line_too_long"), (f"{inputs / 'b.jsonl.zst'}:line=4", "line_too_long")]
    assert all(f"{BOMB_MIB * 2**20 + 13:,} bytes" in r["detail"] for r in rejects)
    kept = sorted(d["text"].split("(")[0] for d in rows(tmp_path / "out", "documents"))
    assert kept == sorted(f"def {s}_{when}_{i}" for s in ("gz", "zst") for when in ("before", "after") for i in range(3))
    assert peak < PEAK_RSS_LIMIT, f"the build peaked at {peak / 2**20:,.0f} MiB"
