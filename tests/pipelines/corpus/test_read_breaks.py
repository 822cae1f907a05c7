"""A build over inputs that break part way or hold control characters: the read stage's rejects, its
`files` / `files_unreadable` counts in stats.json, and the report line that states the rule."""

from __future__ import annotations

import json
from pathlib import Path

import zstandard

from ember.pipelines.corpus.config import parse_config
from ember.pipelines.corpus.report import read_stats, render_report, summary_rows

from tests.pipelines.corpus_support import build, rows


def _lines(texts: list[str]) -> bytes:
    return b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts)


def test_a_cut_zstd_file_and_control_characters_are_counted_and_reported(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    compress = zstandard.ZstdCompressor().compress
    first = [f"def f{i}(value):\n    return value * {i} + {i * 7} - offset_{i}\n" for i in range(40)]
    second = [f"def g{i}(value):\n    return value // {i + 1} - {i * 3} + offset_{i}\n" for i in range(40)]
    cut = compress(_lines(second))
    (inputs / "a.jsonl.zst").write_bytes(compress(_lines(first)) + cut[: len(cut) // 2])
    (inputs / "b.jsonl.zst").write_bytes(compress(_lines(["def h(x):\n    return x\x00 + 1  # a NUL in the text\n"])))
    out = tmp_path / "out"
    config = parse_config({
        "sources": [{"name": "code", "kind": "code", "inputs": [str(inputs / "*.jsonl.zst")], "format": "jsonl.zst"}],
        "dedup": {"exact": False, "near": False},
        "output": {"directory": str(out)},
    })
    assert build(config) == "DONE"

    stats = read_stats(str(out))
    read = stats["sources"]["code"]["stages"]["read"]
    assert (read["files"], read["files_unreadable"], read["docs_out"]) == (2, 1, 40)
    assert stats["sources"]["code"]["rejected"] == {"read:unreadable_file": 1, "read:control_characters": 1}
    assert stats["totals"]["balanced"] and stats["totals"]["docs_in"] == 42
    rejects = {r["reason"]: r for r in rows(out, "rejects")}
    assert rejects["unreadable_file"]["location"] == f"{inputs / 'a.jsonl.zst'}:line=41"
    assert rejects["control_characters"]["location"] == f"{inputs / 'b.jsonl.zst'}:line=1"
    assert rejects["control_characters"]["detail"] == "1 control character(s), the first U+0000 at character 22"
    assert not any("\x00" in d["text"] for d in rows(out, "documents"))

    assert "Input files unreadable past a point: **1 of 2**" in render_report(str(out))
    summary = dict(summary_rows(stats))["input files unreadable past a point"]
    assert summary.startswith("1 of 2 (rows before a break are kept")
